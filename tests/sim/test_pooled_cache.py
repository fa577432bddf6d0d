"""The pooled cache (kvroute.sim.pooled_cache) and the bound's KV capacity terms (kvroute.sim.bound):
optimal hits by hand and against every schedule of small cases, the TTFT floor under a hit budget
against enumeration, and no policy beating the KV-capacity bound on capacity-tight clusters."""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from kvroute.policies import policy_names
from kvroute.sim.bound import (
    Engine,
    WorkloadBound,
    bound_summary,
    floor_sum_with_hit_budget_s,
    hit_rate_ceiling,
    oracle_misses,
    pooled_capacity_blocks,
    ttft_floors_s,
    workload_bound,
)
from kvroute.sim.compare import SpecRunner, arm_spec
from kvroute.sim.pooled_cache import pooled_cache_hits
from kvroute.sim.runner import RunSpec
from kvroute.workloads.request import Request


def _hits(
    chains: list[tuple[int, ...]], countable: list[int], capacity: int, order: list[int] | None = None
) -> list[int]:
    ids = np.array([b for c in chains for b in c], dtype=np.uint64)
    lengths = np.array([len(c) for c in chains], dtype=np.int64)
    serve = np.arange(len(chains)) if order is None else np.array(order)
    return pooled_cache_hits(ids, lengths, np.array(countable), serve, capacity).per_request.tolist()


def test_pooled_cache_hits_by_hand() -> None:
    """Capacity 2 blocks; requests in order A = (1, 2), B = (3,), C = (1, 2), D = (3,), E = (1,).

    After A the cache may keep 1 and 2 (next read: C at step 3) or 3 arrives with B (next read: D
    at step 4). Keeping {1, 2} through B gives C two hits; then 3 is gone (it could only be kept by
    dropping 1 or 2 before C), so D misses; E hits 1 (kept from C: next read at step 5). Keeping 3
    instead gives D one hit but then C misses both, and E hits 1 if 1 was kept: at most 1 + 1 = 2.
    The best is C 2 + E 1 = 3 hits: A 0, B 0, C 2, D 0, E 1. With capacity 3 everything fits:
    C 2, D 1, E 1 = 4. With capacity 0: none."""
    chains = [(1, 2), (3,), (1, 2), (3,), (1,)]
    full = [len(c) for c in chains]
    assert _hits(chains, full, 2) == [0, 0, 2, 0, 1]
    assert _hits(chains, full, 3) == [0, 0, 2, 1, 1]
    assert _hits(chains, full, 0) == [0] * 5


def test_pooled_cache_counts_only_countable_blocks_but_inserts_all() -> None:
    """A = (1, 2) with only block 1 countable (a block-aligned prompt: its last block is always
    recomputed), then B = (1, 2) countable in full: B hits both (A inserted block 2 though its own
    read of it did not count). A's read of block 2 would not count, so with capacity 1 the cache
    keeps block 1 (next counted read: B) or block 2 (next counted read: B): one hit."""
    chains = [(1, 2), (1, 2)]
    assert _hits(chains, [1, 2], 2) == [0, 2]
    assert sum(_hits(chains, [1, 2], 1)) == 1
    assert _hits(chains, [1, 1], 5) == [0, 1]


def _best_by_enumeration(chains: list[tuple[int, ...]], countable: list[int], capacity: int) -> int:
    """The most hits over every schedule: after each request, keep any ≤ capacity blocks of the
    cache and that request's blocks."""
    best = 0

    def step(i: int, cache: frozenset[int], hits: int) -> None:
        nonlocal best
        if i == len(chains):
            best = max(best, hits)
            return
        got = sum(1 for b in chains[i][: countable[i]] if b in cache)
        pool = sorted(cache | set(chains[i]))
        for r in range(min(capacity, len(pool)) + 1):
            for keep in itertools.combinations(pool, r):
                step(i + 1, frozenset(keep), hits + got)

    step(0, frozenset(), 0)
    return best


def _random_chains(rng: random.Random, n: int, depth: int = 3) -> list[tuple[int, ...]]:
    """Chained workloads: each request extends a prefix of an earlier one (or starts anew)."""
    chains: list[tuple[int, ...]] = []
    for k in range(n):
        base = rng.choice(chains)[: rng.randint(0, depth)] if chains and rng.random() < 0.7 else ()
        chains.append(base + tuple(100 * (k + 1) + j for j in range(rng.randint(0 if base else 1, 2))))
    return chains


def test_pooled_cache_is_the_best_of_every_schedule() -> None:
    rng = random.Random(0)
    for _ in range(150):
        chains = _random_chains(rng, rng.randint(1, 5))
        countable = [rng.randint(max(0, len(c) - 1), len(c)) for c in chains]
        capacity = rng.randint(0, 4)
        got = sum(_hits(chains, countable, capacity))
        assert got == _best_by_enumeration(chains, countable, capacity), (chains, countable, capacity)


def test_pooled_cache_grows_with_capacity_up_to_the_oracle_in_any_order() -> None:
    """Hits never fall as K grows; with K at least every distinct block, they are the oracle's
    capped seen run (min(h(i), c(i))) for whichever order the requests are served in."""
    rng = random.Random(5)
    for _ in range(40):
        chains = _random_chains(rng, 12, depth=4)
        reqs = [Request(i, 0.0, 16 * len(c) + rng.choice([0, 5]), 2, c, 16) for i, c in enumerate(chains)]
        countable = [min(len(c), (r.prompt_len - 1) // 16) for c, r in zip(chains, reqs, strict=True)]
        order = list(range(len(chains)))
        rng.shuffle(order)
        arrivals = [0.0] * len(chains)
        for rank, i in enumerate(order):
            arrivals[i] = float(rank)
        shuffled = [replace(r, arrival=arrivals[i]) for i, r in enumerate(reqs)]
        oracle = [(r.prompt_len - m) // 16 for r, m in zip(shuffled, oracle_misses(shuffled), strict=True)]
        totals = [sum(_hits(chains, countable, k, order)) for k in range(0, 30, 3)]
        assert totals == sorted(totals)
        distinct = len({b for c in chains for b in c})
        assert _hits(chains, countable, distinct, order) == oracle


def test_pooled_capacity_blocks_adds_the_largest_prompts_beside_the_pools() -> None:
    eng = Engine(1000.0, 0.001, 4096, 8, 100.0, (), kv_capacity_tokens=160)  # C = 10 blocks of 16
    # N = 2: 2 · 10 + the two largest of min(blocks, 10): 10 (a 14-block prompt, capped) and 6
    assert pooled_capacity_blocks([3, 14, 6, 1], 16, eng, 2) == 20 + 10 + 6
    assert pooled_capacity_blocks([3], 16, replace(eng, kv_capacity_tokens=0), 2) == 0


def test_kv_terms_by_hand() -> None:
    """One instance of C = 2 blocks of 16 tokens, so K = 2 + 2 (the largest prompt, capped at C).
    Requests A..E in arrival order hold (1, 2), (3, 4), (5, 6), (1, 2), (3, 4), 40 tokens each
    (2 countable blocks). The oracle: D and E hit 2 blocks each, 4 of 10 countable. With K = 4 the
    pooled cache keeps 1, 2, 3, 4 through C's read (C's blocks are never read again): also 4, so
    the ceiling is the oracle's 128 / 200. With C = 1 block (K = 1 + 1): after B the cache holds
    2 of {1, 2, 3, 4}; D hits 2 and then E misses, or keep (3, 4) for E: at most 2 blocks."""
    reqs = [
        Request(i, float(i), 40, 2, c, 16) for i, c in enumerate([(1, 2), (3, 4), (5, 6), (1, 2), (3, 4)])
    ]
    roomy = Engine(1000.0, 0.001, 4096, 8, 100.0, (), kv_capacity_tokens=32)
    b = workload_bound(reqs, roomy)
    assert b.kv_capacity_blocks == 4 and b.kv_hit_tokens == 4 * 16
    assert b.kv_hit_rate_ceiling == pytest.approx(b.oracle_hit_rate) == pytest.approx(64 / 200)
    tight = replace(roomy, kv_capacity_tokens=16)
    t = workload_bound(reqs, tight)
    assert t.kv_capacity_blocks == 2 and t.kv_hit_tokens == 2 * 16
    assert t.kv_hit_rate_ceiling == pytest.approx(32 / 200) == hit_rate_ceiling(reqs, 2)
    assert hit_rate_ceiling(reqs) == pytest.approx(64 / 200)
    # one of D, E loses its 2 hit blocks: the floor's mean rises by (f(40) − f(8)) / 5 at least
    assert t.kv_floor_mean_ms >= b.ttft_floor_mean_ms
    assert t.ttft_mean_bound_ms >= t.ttft_mean_any_order_ms == b.ttft_mean_any_order_ms


def _tiny_engine(sigma: tuple[float, ...]) -> Engine:
    budget = len(sigma)
    rate = max(c / sigma[c - 1] for c in range(1, budget + 1))
    return Engine(rate, sigma[0], budget, 8, math.inf, sigma)


def test_floor_under_a_hit_budget_is_below_every_allocation_and_tight_without_one() -> None:
    """The dual never exceeds the least Σ f over every allocation of the hit budget (enumerated),
    is exact when the budget does not bind, and is never below the unbudgeted floors."""
    rng = random.Random(2)
    for _ in range(60):
        sigma = tuple(np.cumsum([rng.uniform(0.1, 2.0) for _ in range(rng.randint(1, 4))]))
        eng = _tiny_engine(sigma)
        bs = rng.randint(1, 3)
        n = rng.randint(1, 4)
        most = np.array([rng.randint(0, 3) for _ in range(n)])
        prompts = np.array([bs * int(x) + rng.randint(1, 2 * bs + 1) for x in most])
        budget = rng.randint(0, int(most.sum()))
        exact = min(
            float(ttft_floors_s(prompts - bs * np.array(x), eng).sum())
            for x in itertools.product(*(range(int(m) + 1) for m in most))
            if sum(x) <= budget
        )
        got = floor_sum_with_hit_budget_s(prompts, most, bs, budget, eng)
        assert got <= exact * (1 + 1e-9) + 1e-12
        assert got >= float(ttft_floors_s(prompts - bs * most, eng).sum()) * (1 - 1e-9)
        unbound = floor_sum_with_hit_budget_s(prompts, most, bs, int(most.sum()), eng)
        assert unbound == pytest.approx(float(ttft_floors_s(prompts - bs * most, eng).sum()))


def test_floor_under_a_hit_budget_by_hand() -> None:
    """σ = 1 s for any step (budget 4 tokens): f(m) = ceil(m / 4) s. Two requests of 9 tokens with
    2 hit blocks of 4 each possible (f(1) = 1 s), and a budget of 2 blocks: giving both blocks to
    one request (1 + 3 = 4 s) or one to each (2 + 2 = 4 s): 4 s; the dual reaches it."""
    eng = _tiny_engine((1.0, 1.0, 1.0, 1.0))
    got = floor_sum_with_hit_budget_s(np.array([9, 9]), np.array([2, 2]), 4, 2, eng)
    assert got == pytest.approx(4.0, rel=1e-6)


# capacity-tight clusters: 2 instances whose pools hold far less than the workload reuses
TIGHT = (
    RunSpec(workload="multiturn", duration=20.0, instances=2, seed=0, kv_tokens=30_000),
    RunSpec(workload="coder", duration=20.0, instances=2, seed=0, kv_tokens=12_000),
)


@pytest.mark.parametrize("spec", TIGHT, ids=lambda s: f"{s.workload}-{s.kv_tokens}")
def test_no_policy_beats_the_kv_capacity_bound(spec: RunSpec) -> None:
    """Every registered policy (and two with the router-side queue) on a cluster whose pools bind:
    its KV hit rate is at most the KV hit-rate ceiling, below the infinite-cache oracle's, and its
    mean TTFT at least the bound."""
    b = bound_summary(lambda r: replace(spec, rate_scale=r), [1.0], None, 1.0)["rates"][0]
    assert b["kv_hit_rate_ceiling"] < b["oracle_kv_hit_rate"] - 0.02  # the pools bind here
    arms = [*policy_names(), "lmetric +queue", "dynamo-lmetric +queue"]
    with SpecRunner(1) as runner:
        runs = runner.run([arm_spec(spec, a) for a in arms])
    for arm, out in zip(arms, runs, strict=True):
        assert out["unfinished"] == 0, arm
        assert out["kv_hit_rate"] <= b["kv_hit_rate_ceiling"] + 1e-9, arm
        assert out["ttft_ms"]["mean"] >= b["ttft_mean_ms"], arm
        assert out["ttft_ms"]["p99"] >= b["ttft_floor_p99_ms"], arm


def test_a_router_that_reorders_can_beat_the_pooled_cache_of_arrival_order() -> None:
    """Why the KV-capacity terms assume admission in arrival order (docs/results/bound.md): three
    prefixes x, y, z arriving x, y, z, x, y, z. In that order a cache of K = 2 blocks (one instance
    of one block, plus its largest prompt) gives at most 2 hits; admitted as x, x, y, y, z, z, one
    block gives 3."""
    chains = [(1,), (2,), (3,), (1,), (2,), (3,)]
    assert sum(_hits(chains, [1] * 6, 2)) == 2
    assert sum(_hits(chains, [1] * 6, 1, order=[0, 3, 1, 4, 2, 5])) == 3


def test_meets_counts_the_work_the_hit_budget_leaves() -> None:
    """100 requests of 1,000 prompt tokens at t = 1 s, 1 output token, one instance at 1,000
    tokens/s and a TTFT objective of 100 ms: 99 must be prefilled by 1.1 s. The any-order work w
    (here 10 tokens each: the oracle caches the rest) fits (990 ≤ 1,100); with KV capacity only
    50,000 hit tokens in all, the 99 smallest prompts less those hits leave 49,000 tokens, which do
    not; with 98,000 hit tokens, 1,000 ≤ 1,100 do."""
    eng = Engine(1000.0, 0.001, 4096, 8, 100.0, (), kv_capacity_tokens=16_000)
    n = 100

    def bound(hit_tokens: int) -> WorkloadBound:
        return WorkloadBound(
            n,
            1.0,
            0.99,
            10.0,
            10.0,
            0.0,
            np.full(n, 1.0),
            np.full(n, 10, dtype=np.int64),
            np.ones(n, dtype=np.int64),
            kv_capacity_blocks=1000,
            kv_hit_tokens=hit_tokens,
            prompts=np.full(n, 1000, dtype=np.int64),
        )

    assert bound(50_000).meets(eng, 1, 100.0, 10.0, kv=False)
    assert not bound(50_000).meets(eng, 1, 100.0, 10.0)
    assert bound(98_000).meets(eng, 1, 100.0, 10.0)
