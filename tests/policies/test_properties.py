from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.policies import make_policy, policy_names
from kvroute.policies.lmetric import LMetric
from kvroute.views import InstanceView, RequestView

BLOCK = 16


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[RequestView, list[InstanceView]]:
    n = draw(st.integers(1, 8))
    prompt = draw(st.integers(0, 4096))
    cached = tuple(draw(st.integers(0, prompt // BLOCK)) * BLOCK for _ in range(n))
    insts = [
        InstanceView(
            index=draw(st.integers(0, 100)),
            running=draw(st.integers(0, 300)),
            waiting=draw(st.integers(0, 300)),
            queued_prefill_tokens=draw(st.integers(0, 50_000)),
            kv_usage=draw(st.floats(0.0, 1.0)),
            decode_blocks=draw(st.integers(0, 10_000)),
        )
        for _ in range(n)
    ]
    req = RequestView(
        prompt_tokens=prompt, cached_tokens=cached, num_blocks=prompt // BLOCK, block_size=BLOCK
    )
    return req, insts


NAMES = [*policy_names(), "linear:0.3", "lmetric:0.5", "vllm:new", "bailian:minmax"]


@settings(max_examples=60, deadline=None)
@given(scenarios(), st.sampled_from(NAMES))
def test_every_policy_returns_valid_position(scenario, name: str) -> None:
    req, insts = scenario
    d = make_policy(name, random.Random(0)).choose(req, insts)
    assert 0 <= d.choice < len(insts)
    assert len(d.scores) == len(insts)
    for column in d.detail.values():
        assert len(column) in (1, len(insts))


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_lmetric_choice_minimises_score(scenario) -> None:
    req, insts = scenario
    d = LMetric().choose(req, insts)
    expected = [
        (req.prompt_tokens - c + i.queued_prefill_tokens) * (i.running + i.waiting + 1)
        for c, i in zip(req.cached_tokens, insts, strict=True)
    ]
    assert list(d.scores) == expected
    assert d.scores[d.choice] == min(d.scores)
    # among equal scores: lowest BS, then lowest index
    best = min(
        range(len(insts)),
        key=lambda k: (expected[k], insts[k].running + insts[k].waiting, insts[k].index),
    )
    assert (insts[d.choice].running + insts[d.choice].waiting, insts[d.choice].index) == (
        insts[best].running + insts[best].waiting,
        insts[best].index,
    )
