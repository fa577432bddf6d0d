"""EngineModel: scheduling, prefix caching, preemption, stretches == stepping."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.engine.memo import DecodeMemo
from kvroute.engine.model import EngineModel
from kvroute.engine.types import (
    BlockRemoved,
    BlockStored,
    EngineConfig,
    EngineOutput,
    EngineRequest,
    OutputKind,
)


class AffineCost:
    """Test cost model: 10 ms per step + 0.1 ms per prefill token + 0.01 ms per decode sequence +
    1 µs per 1,000 decode context tokens (all in seconds)."""

    name = "test-affine"

    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        return 0.010 + 1e-4 * sum(c for c, _ in prefill) + 1e-5 * num_decode + 1e-9 * decode_kv_tokens


def make_req(rid: int, prompt: int, out: int, prefix: tuple[int, ...] = (), bs: int = 16) -> EngineRequest:
    nblocks = prompt // bs
    hashes = prefix[:nblocks] + tuple(10_000_000 + rid * 1000 + i for i in range(len(prefix), nblocks))
    return EngineRequest(rid, prompt, out, hashes)


def drive(engine: EngineModel, arrivals: list[tuple[float, EngineRequest]]) -> list[EngineOutput]:
    """Minimal driver: arrivals at or before the next step end go first (the simulator's rule)."""
    outs: list[EngineOutput] = []
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while i < len(pending) or not engine.idle:
        nt = engine.next_time()
        if i < len(pending) and (nt is None or pending[i][0] <= nt):
            t, req = pending[i]
            outs += engine.advance(t)
            engine.add_request(req, t)
            i += 1
        else:
            assert nt is not None
            outs += engine.advance(nt)
    return outs


def test_single_request_timing() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=100), AffineCost())
    outs = drive(eng, [(1.0, make_req(1, 160, 4))])
    kinds = [(o.kind, round(o.time, 9)) for o in outs]
    prefill = 0.010 + 1e-4 * 160
    first = 1.0 + prefill
    # three decode steps, contexts 160, 161, 162 tokens
    d = [0.010 + 1e-5 + 1e-9 * c for c in (160, 161, 162)]
    assert kinds == [
        (OutputKind.FIRST_TOKEN, round(first, 9)),
        (OutputKind.FINISHED, round(first + sum(d), 9)),
    ]
    assert eng.stats().used_blocks == 0
    assert eng.stats().cached_blocks == 10  # prompt blocks stay cached (evictable)
    eng.pool.check()


def test_chunked_prefill_respects_token_budget() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=1000, max_num_batched_tokens=512), AffineCost())
    eng.add_request(make_req(1, 1200, 2), 0.0)
    # 1200 tokens need chunks of 512, 512, 176
    t1 = eng.next_time()
    assert t1 == pytest.approx(0.010 + 1e-4 * 512)
    assert eng.advance(t1) == []
    assert eng.stats().queued_prefill_tokens == 1200 - 512
    t2 = eng.next_time()
    assert t2 is not None
    eng.advance(t2)
    t3 = eng.next_time()
    assert t3 is not None
    out = eng.advance(t3)
    assert [o.kind for o in out] == [OutputKind.FIRST_TOKEN]
    assert t3 - t2 == pytest.approx(0.010 + 1e-4 * 176)
    assert eng.stats().queued_prefill_tokens == 0


def test_prefix_cache_hit_is_reported_and_speeds_up_prefill() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=1000), AffineCost())
    shared = tuple(range(1, 41))  # 40 blocks = 640 tokens
    outs = drive(eng, [(0.0, make_req(1, 700, 2, shared)), (5.0, make_req(2, 700, 2, shared))])
    first = {o.req_id: o for o in outs if o.kind is OutputKind.FIRST_TOKEN}
    assert first[1].num_cached_tokens == 0
    assert first[2].num_cached_tokens == 640
    assert first[2].time - 5.0 == pytest.approx(0.010 + 1e-4 * 60)
    st_ = eng.stats()
    assert st_.prefix_query_tokens == 1400 and st_.prefix_hit_tokens == 640


def test_a_waiting_request_queues_only_its_uncached_prefill() -> None:
    """A request waiting behind a step counts, in the queued prefill a router reads, the tokens its
    prefix-cache lookup on arrival left uncached (as the router counts the requests it sends), and
    the count is exact again once it is admitted and when it ends."""
    eng = EngineModel(EngineConfig(num_kv_blocks=1000), AffineCost())
    shared = tuple(range(1, 41))  # 40 blocks = 640 tokens
    drive(eng, [(0.0, make_req(1, 700, 2, shared))])
    assert eng.stats().queued_prefill_tokens == 0
    eng.add_request(make_req(2, 1000, 2), 10.0)  # an idle engine starts a step of it at once
    assert eng.load().queued_prefill_tokens == 1000
    t = eng.next_time()
    assert t is not None
    eng.add_request(make_req(3, 700, 2, shared), t - 1e-3)  # mid-step: waits; 640 tokens cached
    eng.add_request(make_req(4, 700, 2), t - 1e-3)  # waits; nothing cached
    assert eng.load().waiting == 2 and eng.load().queued_prefill_tokens == 1000 + 60 + 700
    assert dict(eng.in_flight())[3] == 60
    eng.advance(t)  # both are admitted into the next step, 3 with its real hit
    assert eng.load().waiting == 0 and eng.load().queued_prefill_tokens == 60 + 700
    drive(eng, [])
    assert eng.stats().queued_prefill_tokens == 0


def test_a_request_preempted_before_its_first_token_reports_its_first_hit() -> None:
    """Preempted mid-prefill and admitted again, a request finds its own computed blocks in the
    cache; it still reports the hit of its first admission (vLLM sets ``num_cached_tokens`` once),
    here none: nothing it shares was cached."""
    eng = EngineModel(EngineConfig(num_kv_blocks=22, max_num_batched_tokens=64), AffineCost())
    outs = drive(eng, [(0.0, make_req(1, 32, 300)), (0.0, make_req(2, 320, 2))])
    assert any(o.kind is OutputKind.PREEMPTED and o.req_id == 2 for o in outs)
    first = next(o for o in outs if o.kind is OutputKind.FIRST_TOKEN and o.req_id == 2)
    assert first.num_cached_tokens == 0
    assert {o.req_id for o in outs if o.kind is OutputKind.FINISHED} == {1, 2}


def test_full_hit_still_computes_last_token() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=100), AffineCost())
    p = tuple(range(1, 11))
    outs = drive(eng, [(0.0, make_req(1, 160, 2, p)), (5.0, make_req(2, 160, 2, p))])
    second = next(o for o in outs if o.req_id == 2 and o.kind is OutputKind.FIRST_TOKEN)
    assert second.num_cached_tokens == 144  # last block recomputed: at least one token computed


def test_kv_events_describe_the_cache() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=12), AffineCost())
    drive(eng, [(0.0, make_req(1, 160, 2)), (1.0, make_req(2, 160, 2))])
    held: set[int] = set()
    for ev in eng.take_events():
        if isinstance(ev, BlockStored):
            held |= set(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            held -= set(ev.block_hashes)
    assert held == set(eng.pool.cached)
    assert len(held) <= 12


def test_preemption_when_blocks_run_out_and_everything_finishes() -> None:
    cfg = EngineConfig(num_kv_blocks=30, max_num_batched_tokens=4096)
    eng = EngineModel(cfg, AffineCost())
    arrivals = [(0.0, make_req(i, 160, 100)) for i in range(4)]  # 4 × (10 + 7) blocks > 30
    outs = drive(eng, arrivals)
    finished = {o.req_id for o in outs if o.kind is OutputKind.FINISHED}
    assert finished == {0, 1, 2, 3}
    assert eng.stats().preemptions > 0
    assert any(o.kind is OutputKind.PREEMPTED for o in outs)
    assert eng.stats().used_blocks == 0 and eng.stats().queued_prefill_tokens == 0
    eng.pool.check()


def test_request_that_can_never_fit_is_aborted_not_queued_forever() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=5), AffineCost())
    eng.add_request(make_req(1, 160, 10), 0.0)
    out = eng.advance(0.0)
    assert [o.kind for o in out] == [OutputKind.ABORTED]
    assert eng.idle


def test_abort_frees_blocks() -> None:
    eng = EngineModel(EngineConfig(num_kv_blocks=100), AffineCost())
    eng.add_request(make_req(1, 320, 1000), 0.0)
    t = eng.next_time()
    assert t is not None
    eng.advance(t)
    assert eng.stats().running == 1 and eng.stats().used_blocks > 0
    assert eng.abort(1, t + 0.05)
    assert eng.stats().running == 0 and eng.stats().used_blocks == 0
    assert not eng.abort(1, t + 0.06)
    eng.pool.check()


def _random_arrivals(rng: random.Random, n: int, shared: int) -> list[tuple[float, EngineRequest]]:
    prefixes = [tuple(range(p * 100 + 1, p * 100 + 60)) for p in range(shared)]
    arr, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        arr.append((t, make_req(i, rng.randint(20, 900), rng.randint(1, 300), rng.choice(prefixes))))
    return arr


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), blocks=st.sampled_from([60, 200, 5000]), memo=st.booleans())
def test_stretches_give_exactly_the_stepping_result(seed: int, blocks: int, memo: bool) -> None:
    """Bit-identical outputs, events and final state, with and without the memo's segments."""
    arrivals = _random_arrivals(random.Random(seed), 40, 3)
    cfg = EngineConfig(num_kv_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=512)
    cost = DecodeMemo(AffineCost(), kv_quantum=16) if memo else AffineCost()
    fast = EngineModel(cfg, cost)
    slow = EngineModel(replace(cfg, report_tokens=True), cost)
    a = [(o.kind, o.req_id, o.time, o.num_cached_tokens) for o in drive(fast, arrivals)]
    b = [
        (o.kind, o.req_id, o.time, o.num_cached_tokens)
        for o in drive(slow, arrivals)
        if o.kind is not OutputKind.TOKEN
    ]
    assert a == b
    assert fast.take_events() == slow.take_events()
    assert fast.stats() == slow.stats()
    fast.pool.check()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_counters_return_to_idle_under_aborts(seed: int) -> None:
    rng = random.Random(seed)
    eng = EngineModel(
        EngineConfig(num_kv_blocks=80, max_num_seqs=6, max_num_batched_tokens=256), AffineCost()
    )
    arrivals = _random_arrivals(rng, 25, 2)
    live: list[int] = []
    for t, req in arrivals:
        eng.advance(t)
        eng.add_request(req, t)
        live.append(int(req.req_id))
        if rng.random() < 0.3:
            eng.abort(live.pop(rng.randrange(len(live))), t)
        eng.pool.check()
        s = eng.stats()
        assert s.queued_prefill_tokens >= 0
    while not eng.idle:
        nt = eng.next_time()
        assert nt is not None
        eng.advance(nt)
    s = eng.stats()
    assert (s.running, s.waiting, s.used_blocks, s.queued_prefill_tokens) == (0, 0, 0, 0)
    eng.pool.check()


def test_decode_memo_is_close_to_the_model_and_segments_are_consistent() -> None:
    inner = AffineCost()
    memo = DecodeMemo(inner, kv_quantum=16)
    for n, kv in [(1, 100), (8, 8 * 1000), (64, 64 * 5000 + 7)]:
        exact = inner.step_time((), n, kv)
        assert memo.step_time((), n, kv) == pytest.approx(exact, rel=1e-3)
        d, m = memo.decode_segment(n, kv)
        assert 1 <= m <= 16
        # the next m-1 steps (context sum + n each) cost exactly d; the one after does not share the bucket
        assert all(memo.step_time((), n, kv + j * n) == d for j in range(m))
        assert (kv + m * n) // n // 16 != kv // n // 16
    assert memo.step_time(((100, 0),), 2, 10) == inner.step_time(((100, 0),), 2, 10)


def _drive_with_aborts(
    engine: EngineModel, events: list[tuple[float, int, EngineRequest | int]]
) -> tuple[list[EngineOutput], bool]:
    """Like ``drive``; an event ``(t, 0, request)`` adds, ``(t, 1, req_id)`` aborts. Checks the
    model's invariants after every call; also says whether the cohort ever had members."""
    outs: list[EngineOutput] = []
    pending = sorted(events, key=lambda e: (e[0], e[1]))
    i = 0
    used_cohort = False
    while i < len(pending) or not engine.idle:
        nt = engine.next_time()
        if i < len(pending) and (nt is None or pending[i][0] <= nt):
            t, kind, what = pending[i]
            outs += engine.advance(t)
            if kind == 0:
                assert isinstance(what, EngineRequest)
                engine.add_request(what, t)
            else:
                assert isinstance(what, int)
                engine.abort(what, t)
            i += 1
        else:
            assert nt is not None
            outs += engine.advance(nt)
        engine.check()
        cohort = engine._cohort
        used_cohort = used_cohort or (cohort is not None and cohort.n > 0)
    return outs, used_cohort


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    blocks=st.sampled_from([40, 90, 300, 5000]),
    seqs=st.sampled_from([4, 8, 32]),
    budget=st.sampled_from([6, 64, 512]),
    bs=st.sampled_from([4, 16]),
    aborts=st.booleans(),
)
def test_decode_cohort_gives_exactly_the_per_request_result(
    seed: int, blocks: int, seqs: int, budget: int, bs: int, aborts: bool
) -> None:
    """The cohort (``report_tokens=False``) against the per-request path (``report_tokens=True``):
    the same outputs, KV events (grouping included) and stats, through evictions, preemptions,
    decoders starved of budget (budget < batch), chunked prefill and aborts mid-stretch."""
    rng = random.Random(seed)
    prefixes = [tuple(range(p * 1000 + 1, p * 1000 + 200)) for p in range(3)]
    events: list[tuple[float, int, EngineRequest | int]] = []
    t = 0.0
    for i in range(30):
        t += rng.expovariate(15.0)
        prompt = rng.randint(5, 700)
        req = make_req(i, prompt, rng.randint(1, 250), rng.choice(prefixes), bs=bs)
        if -(-(prompt + req.output_len) // bs) <= blocks:
            events.append((t, 0, req))
        if aborts and rng.random() < 0.3:
            events.append((t + rng.expovariate(2.0), 1, rng.randrange(i + 1)))
    cfg = EngineConfig(num_kv_blocks=blocks, max_num_seqs=seqs, max_num_batched_tokens=budget, block_size=bs)
    cost = DecodeMemo(AffineCost(), kv_quantum=8)
    fast = EngineModel(cfg, cost)
    slow = EngineModel(replace(cfg, report_tokens=True), cost)
    a, used = _drive_with_aborts(fast, events)
    b, _ = _drive_with_aborts(slow, events)

    # An abort during a stretch reports the output tokens counted at the stretch's start (as before
    # the cohort existed); stepping counts every step. Everything else must match exactly.
    def key(o: EngineOutput) -> EngineOutput:
        return replace(o, num_output_tokens=-1) if o.kind is OutputKind.ABORTED else o

    assert [key(o) for o in a] == [key(o) for o in b if o.kind is not OutputKind.TOKEN]
    assert fast.take_events() == slow.take_events()
    assert fast.stats() == slow.stats()
    # the cohort was exercised wherever a request decoded past its first token (a case whose every
    # request is too big or aborted before that has nothing to decode: seed 18276, 40 blocks of 4)
    decoded = any(o.kind is OutputKind.FINISHED and o.num_output_tokens > 1 for o in a)
    assert used or not decoded


def test_cohort_counts_block_boundaries_like_per_request_arithmetic() -> None:
    """``_Cohort.needing_block`` and ``blocks_for`` against counting each member's boundaries."""
    for bs in (1, 4, 16, 512):
        _check_cohort_counts(random.Random(bs), bs)


def _check_cohort_counts(rng: random.Random, bs: int) -> None:
    from kvroute.engine.model import _Cohort, _Seq

    cohort = _Cohort(bs)
    members: list[_Seq] = []
    for i in range(40):
        seq = _Seq(EngineRequest(i, 100, 10_000))
        seq.computed = rng.randint(1, 500)
        seq.out = 1
        seq.known = seq.computed + 1
        seq.nblocks = -(-seq.computed // bs)
        seq.adm = i
        cohort.join(seq)
        members.append(seq)
        cohort.advance(rng.randint(0, 5))
    for _ in range(50):
        now = {s: s.computed + cohort.d - s.d0 for s in members}
        assert set(cohort.needing_block()) == {s for s, c in now.items() if c % bs == 0}
        for steps in (1, 2, 3, 17, 40, 333, 1500):
            # blocks for tokens c+2..c+steps beyond ceil((c+1)/bs), the first step's allocation
            brute = sum(-(-(c + steps) // bs) - -(-(c + 1) // bs) for c in now.values())
            assert cohort.blocks_for(steps) == brute
        assert cohort.kv == sum(now.values())
        cohort.advance(rng.randint(1, 20))
        if rng.random() < 0.2:  # a member leaves (abort): the counts follow
            cohort.leave(members.pop(rng.randrange(len(members))), 0)


def test_cohort_most_steps_is_the_largest_stretch_the_free_blocks_allow() -> None:
    from kvroute.engine.model import _Cohort, _Seq

    rng = random.Random(3)
    for bs in (1, 4, 16):
        cohort = _Cohort(bs)
        for i in range(rng.randint(1, 30)):
            seq = _Seq(EngineRequest(i, 100, 10_000))
            seq.computed = rng.randint(1, 300)
            seq.out, seq.known, seq.nblocks, seq.adm = 1, seq.computed + 1, -(-seq.computed // bs), i
            cohort.join(seq)
            cohort.advance(rng.randint(0, 3))
        for free in (0, 1, 2, 5, 17, 100, 1000):
            k = cohort.most_steps(free)
            assert cohort.blocks_for(k) <= free < cohort.blocks_for(k + 1)
