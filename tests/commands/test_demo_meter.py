"""The main job's level ground and per-arm meter (kvroute.commands.demo_meter), on the real
tokenizer's prompt text and the real cyclic garbage collector."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvroute.commands.demo_meter import ArmMeter, level, unlevel
from kvroute.loadgen import BlockText
from kvroute.tokenizer import load_tokenizer
from kvroute.workloads import make_workload
from kvroute.workloads.request import Request


@pytest.fixture(scope="module")
def text() -> BlockText:
    return BlockText(load_tokenizer())


def _requests(seed: int) -> list[Request]:
    return list(make_workload("multiturn", seed=seed, rate_scale=1.0, duration=3.0))


def _send_all(text: BlockText, reqs: list[Request]) -> None:
    """What the load generator does to the text for each request of an arm."""
    for r in reqs:
        text.prompt(r.block_ids, r.block_size, r.prompt_len, r.req_id)


def test_a_levelled_arm_makes_no_prompt_text_and_an_unlevelled_one_does(text: BlockText) -> None:
    reqs = _requests(seed=0)
    try:
        level(text, reqs)
    finally:
        unlevel()
    with ArmMeter(text) as levelled:
        _send_all(text, reqs)
    assert levelled.cost is not None and levelled.cost.text_blocks == 0
    # the first arm of the job before levelling: it made the text the later arms reused
    with ArmMeter(text) as first:
        _send_all(text, _requests(seed=1))
    assert first.cost is not None and first.cost.text_blocks > 0


class _Node:
    other: _Node | None = None


def test_level_collects_the_garbage_and_freezes_what_lives(text: BlockText) -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle only the collector frees
    dead = weakref.ref(a)
    del a, b
    alive = _Node()
    try:
        level(text, [])
        assert dead() is None
        assert gc.get_freeze_count() > 0
        assert not any(o is alive for o in gc.get_objects())  # out of the collector's walks
    finally:
        unlevel()
    assert gc.get_freeze_count() == 0
    assert any(o is alive for o in gc.get_objects())


def test_the_meter_counts_collector_passes_and_cpu_and_leaves_no_callback(text: BlockText) -> None:
    before = list(gc.callbacks)
    with ArmMeter(text) as m:
        assert len(gc.callbacks) == len(before) + 1
        gc.collect()
        sum(i * i for i in range(200_000))
    assert gc.callbacks == before
    cost = m.cost
    assert cost is not None
    assert cost.gc_full >= 1 and cost.gc_passes >= cost.gc_full and cost.gc_pause_s > 0
    assert cost.cpu_s > 0 and cost.text_blocks == 0


def test_the_meter_removes_its_callback_when_the_arm_fails(text: BlockText) -> None:
    before = list(gc.callbacks)
    with pytest.raises(RuntimeError), ArmMeter(text):
        raise RuntimeError("the arm failed")
    assert gc.callbacks == before
