"""lmetric-time: (T_wait + T_own) × (BS + 1) × K in cost-model seconds, checked by hand.

The cost model here is a small linear one written for the test (the policy takes any pure cost
model), so every figure below can be computed on paper:
step = 10 ms + 10 µs per token computed (chunk tokens + decode tokens) + ``ATT`` s per token of decode
context + 1 ns per (chunk token × token of history).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace as dataclass_replace

import pytest

from kvroute.errors import UserError
from kvroute.policies.lmetric_time import LMetricTime, kv_demand_factor
from kvroute.policies.registry import DEFAULT_POLICY, make_policy
from kvroute.views import InstanceView, RequestView


class LinearCost:
    """The hand-computable cost model of the module docstring; ``att``: seconds per context token."""

    name = "linear-test"

    def __init__(self, att: float = 1e-7) -> None:
        self.att = att

    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        tokens = sum(n for n, _ in prefill) + num_decode
        return 0.010 + 1e-5 * tokens + self.att * decode_kv_tokens + 1e-9 * sum(n * h for n, h in prefill)


def test_each_prefill_token_is_priced_at_a_full_chunk_times_bs_plus_one_times_kv_demand() -> None:
    views = [
        InstanceView(index=0, running=2, decode_blocks=100, kv_capacity_blocks=1000, max_batched_tokens=4096),
        InstanceView(index=1, running=0, kv_capacity_blocks=1000, max_batched_tokens=4096),
    ]
    r = RequestView(prompt_tokens=1000, cached_tokens=(0, 800), block_size=16)
    d = LMetricTime(LinearCost()).choose(r, views)
    # instance 0: chunk = 4094, p = 1000, h̄ = 500, ctx = 1600 tokens:
    #   step = 0.010 + 1e-5·(4094 + 2) + 1e-7·1600 + 1e-9·4094·500 = 0.053167, × 1000 / 4094
    #   × (BS + 1 = 3) × K = 1000 / 900
    # instance 1: chunk = 4096, p = 200, h̄ = 900: step = 0.010 + 0.04096 + 1e-9·4096·900 = 0.0546464,
    #   × 200 / 4096, × 1 × 1
    s0 = (0.010 + 1e-5 * 4096 + 1e-7 * 1600 + 1e-9 * 4094 * 500) * 1000 / 4094 * 3 * 1000 / 900
    s1 = (0.010 + 1e-5 * 4096 + 1e-9 * 4096 * 900) * 200 / 4096
    assert d.scores == pytest.approx((s0, s1))
    assert s0 == pytest.approx(0.053167 * 1000 / 4094 * 3 / 0.9, rel=1e-4)
    assert d.choice == 1 and d.policy == "lmetric-time"


def test_the_queue_is_priced_without_history_and_the_request_with_its_own() -> None:
    v = InstanceView(index=0, queued_prefill_tokens=1500, max_batched_tokens=1000)
    r = RequestView(prompt_tokens=3000, cached_tokens=(0,), block_size=16)
    t_wait, t_own = LMetricTime(LinearCost()).times(r, v, 0)
    # chunk = 1000; queue: 1.5 chunks of (0.010 + 0.010) s; own: 3 chunks of 0.010 + 0.010 + 1e-9·1000·1500
    assert t_wait == pytest.approx(1.5 * 0.020)
    assert t_own == pytest.approx(3 * 0.0215)


def test_context_weighted_decode_flips_the_choice_lmetric_makes() -> None:
    # instance 0: 4 sequences holding 80k tokens of context; instance 1: 6 short ones
    views = [
        InstanceView(index=0, running=4, decode_blocks=5000, max_batched_tokens=4096),
        InstanceView(index=1, running=6, decode_blocks=100, max_batched_tokens=4096),
    ]
    r = RequestView(prompt_tokens=2000, cached_tokens=(0, 0), block_size=16)
    assert make_policy("lmetric").choose(r, views).choice == 0  # 2000 × 5 < 2000 × 7
    d = LMetricTime(LinearCost(att=5e-7), kv="off").choose(r, views)
    # 0: chunk 4092: (0.010 + 0.04096 + 5e-7·80000 + 1e-9·4092·1000) × 2000/4092 × 5
    # 1: chunk 4090: (0.010 + 0.04096 + 5e-7·1600 + 1e-9·4090·1000) × 2000/4090 × 7
    s0 = (0.010 + 0.04096 + 0.04 + 4092e-6) * 2000 / 4092 * 5
    s1 = (0.010 + 0.04096 + 0.0008 + 4090e-6) * 2000 / 4090 * 7
    assert d.scores == pytest.approx((s0, s1))
    assert s0 > s1 and d.choice == 1


def _queued_view() -> InstanceView:
    """Instance 1 of the KV-demand tests: 100 of 500 blocks held and 6,400 tokens (400 blocks) queued."""
    return InstanceView(
        index=1,
        running=1,
        decode_blocks=100,
        queued_prefill_tokens=6400,
        kv_capacity_blocks=500,
        max_batched_tokens=4096,
    )


def test_queued_prefill_counts_as_kv_demand() -> None:
    views = [
        InstanceView(index=0, running=1, decode_blocks=100, kv_capacity_blocks=500, max_batched_tokens=4096),
        # the same held blocks, plus 6,400 queued tokens = 400 blocks more: 500 / (500 − 500) → overcommitted
        _queued_view(),
    ]
    r = RequestView(prompt_tokens=100, cached_tokens=(0, 0), block_size=16)
    policy = LMetricTime(LinearCost())
    assert policy.factor(r, views[0]) == pytest.approx(500 / 400)
    assert policy.factor(r, views[1]) == pytest.approx(500 * 2.0)  # U = C: free 0 → C × 2
    assert LMetricTime(LinearCost(), kv="held").factor(r, views[1]) == pytest.approx(500 / 400)
    assert LMetricTime(LinearCost(), kv="off").factor(r, views[1]) == 1.0
    assert policy.choose(r, views).choice == 0


def test_behind_the_router_queue_kv_demand_is_the_blocks_held() -> None:
    """A gated instance (the router-side queue sends it only what its next step starts) owes its pool
    no queued prefill beyond that: K counts its held blocks only, while T_wait still prices the queue."""
    queued = _queued_view()
    r = RequestView(prompt_tokens=100, cached_tokens=(0,), block_size=16)
    behind = dataclass_replace(r, gated=True)
    policy = LMetricTime(LinearCost())
    assert policy.factor(r, queued) == pytest.approx(500 * 2.0)  # 100 held + 400 queued blocks = C
    assert policy.factor(behind, queued) == pytest.approx(500 / 400)  # 100 held blocks only
    assert policy.times(behind, queued, 0) == policy.times(r, queued, 0)  # the queue's time is the same
    # an instance whose chunk budget is unknown is never held back: its queue counts behind the queue too
    unknown = dataclass_replace(queued, max_batched_tokens=0)
    assert policy.factor(behind, unknown) == pytest.approx(500 * 2.0)
    # the ablation "queued" counts the queue behind the router-side queue as well
    assert make_policy("lmetric-time:queued").factor(behind, queued) == pytest.approx(500 * 2.0)
    # "own" still adds the request's own blocks behind the queue: 100 held + 100 / 16 = 6.25 blocks
    assert LMetricTime(LinearCost(), kv="own").factor(behind, queued, 0) == pytest.approx(
        500 / (500 - 106.25)
    )


def test_own_modes_count_the_blocks_the_request_would_add_where_its_prefix_is_not_cached() -> None:
    # both pools hold 100 of 500 blocks; the request's 3,200-token prompt (200 blocks) is cached on 0
    # up to 3,040 tokens (190 blocks), so it adds 10 blocks there and 200 on 1
    views = [
        InstanceView(index=i, running=1, decode_blocks=100, kv_capacity_blocks=500, max_batched_tokens=4096)
        for i in range(2)
    ]
    r = RequestView(prompt_tokens=3200, cached_tokens=(3040, 0), block_size=16)
    own = LMetricTime(LinearCost(), kv="heldown")
    assert own.factor(r, views[0], 3040) == pytest.approx(500 / (500 - 110))
    assert own.factor(r, views[1], 0) == pytest.approx(500 / (500 - 300))
    # "own" adds the queue's blocks as "demand" does: 1,600 queued tokens = 100 blocks
    q = InstanceView(
        index=1, running=1, decode_blocks=100, queued_prefill_tokens=1600, kv_capacity_blocks=500
    )
    assert LMetricTime(LinearCost(), kv="own").factor(r, q, 0) == pytest.approx(500 / (500 - 400))
    assert own.factor(r, q, 0) == pytest.approx(500 / (500 - 300))  # heldown leaves the queue out
    assert make_policy("lmetric-time:heldown").choose(r, views).choice == 0


def test_kv_demand_factor_edges() -> None:
    assert kv_demand_factor(0, 123.0) == 1.0  # capacity unknown
    assert kv_demand_factor(100, 0.0) == 1.0
    assert kv_demand_factor(100, 50.0) == 2.0
    assert kv_demand_factor(100, 99.0) == 100.0  # one block free
    assert kv_demand_factor(100, 100.0) == 200.0  # continuous growth past capacity
    assert kv_demand_factor(100, 120.0) == 2200.0
    factors = [kv_demand_factor(100, u) for u in (0, 50, 90, 98.5, 99, 99.5, 100, 150)]
    assert factors == sorted(factors)  # monotone in demand


def test_ties_go_to_lower_bs_then_index() -> None:
    views = [InstanceView(index=3), InstanceView(index=1)]
    r = RequestView(prompt_tokens=64, cached_tokens=(0, 0), block_size=16)
    assert LMetricTime(LinearCost()).choose(r, views).choice == 1


def test_registry_entry_and_the_default() -> None:
    assert DEFAULT_POLICY == "lmetric-time"
    p = make_policy("lmetric-time")
    assert p.name == "lmetric-time"
    assert make_policy("lmetric-time:held").name == "lmetric-time:held"
    with pytest.raises(UserError, match="must be one of"):
        make_policy("lmetric-time:lots")
    # the registry's policy uses the default profile's cost model: a long shared context is cheaper
    # to prefill where it is cached
    views = [InstanceView(index=0, max_batched_tokens=4096), InstanceView(index=1, max_batched_tokens=4096)]
    r = RequestView(prompt_tokens=20_000, cached_tokens=(0, 19_968), block_size=16)
    assert p.choose(r, views).choice == 1


def test_request_classes_reweight_bs_in_the_time_score() -> None:
    from kvroute.features.classes import ClassConfig
    from kvroute.features.settings import FeatureConfig
    from kvroute.routing.guarded import Guarded

    views = [
        InstanceView(index=0, running=3, max_batched_tokens=4096),
        InstanceView(index=1, running=0, max_batched_tokens=4096),
    ]
    r = RequestView(prompt_tokens=1000, cached_tokens=(960, 0), block_size=16, req_class="ttft")
    g = Guarded(LMetricTime(LinearCost(), kv="off"), FeatureConfig(classes=ClassConfig()))
    d = g.choose(r, views)
    # 0: chunk 4093, p = 40, h̄ = 980: (0.010 + 0.04096 + 1e-9·4093·980) × 40/4093, × 4 ** 0.5 (ttft)
    # 1: chunk 4096, p = 1000, h̄ = 500: (0.010 + 0.04096 + 1e-9·4096·500) × 1000/4096, × 1
    t0 = (0.010 + 0.04096 + 4093 * 980e-9) * 40 / 4093
    t1 = (0.010 + 0.04096 + 4096 * 500e-9) * 1000 / 4096
    assert d.scores == pytest.approx((t0 * 2.0, t1))
    assert d.choice == 0 and g.counts["class:ttft"] == 1
    # the tpot class (w = 2) weighs the 3 running sequences harder: (3 + 1) ** 2 = 16
    tpot = g.choose(dataclass_replace(r, req_class="tpot"), views)
    assert tpot.scores == pytest.approx((t0 * 16.0, t1)) and tpot.choice == 0
    # the load-term ablations have no BS + 1 to reweight: refused, not silently scored as the default
    for load in ("step", "stepq"):
        with pytest.raises(UserError, match="does not combine"):
            Guarded(
                LMetricTime(LinearCost(), name=f"lmetric-time:{load}", load=load),
                FeatureConfig(classes=ClassConfig()),
            )
    assert Guarded(LMetricTime(LinearCost(), itl=True), FeatureConfig(classes=ClassConfig())).choose(r, views)


def test_step_mode_multiplies_by_the_decode_step_of_the_batch_joined() -> None:
    # a long prompt: instance 0 holds few sequences with long contexts and a long queue (the api
    # workload's long-prompt instance), instance 1 many short decodes and a short queue
    views = [
        InstanceView(
            index=0, running=3, queued_prefill_tokens=8000, decode_blocks=3000, max_batched_tokens=4096
        ),
        InstanceView(
            index=1, running=40, queued_prefill_tokens=500, decode_blocks=500, max_batched_tokens=4096
        ),
    ]
    r = RequestView(prompt_tokens=8000, cached_tokens=(0, 0), block_size=16)
    cost = LinearCost()
    # T_wait + T_own (K off), by hand:
    # 0: chunk 4093, ctx 48,000: queue step = 0.010 + 1e-5·4096 + 1e-7·48000 = 0.05576, × 8000/4093;
    #    own step adds 1e-9·4093·4000 = 0.016372: 0.072132, × 8000/4093
    # 1: chunk 4056, ctx 8,000: queue step = 0.010 + 0.04096 + 0.0008 = 0.05176, × 500/4056;
    #    own step adds 1e-9·4056·4000 = 0.016224: 0.067984, × 8000/4056
    t0 = (0.05576 + 0.072132) * 8000 / 4093
    t1 = 0.05176 * 500 / 4056 + 0.067984 * 8000 / 4056
    # BS + 1: 4 against 41, so the policy sends it behind the long queue
    bs = LMetricTime(cost, kv="off").choose(r, views)
    assert bs.scores == pytest.approx((t0 * 4, t1 * 41))
    assert bs.choice == 0
    # D = one decode step with running + 1 sequences and ctx + 8,000 tokens of context:
    # 0: 0.010 + 1e-5·4 + 1e-7·56000 = 0.01564; 1: 0.010 + 1e-5·41 + 1e-7·16000 = 0.01201
    step = LMetricTime(cost, kv="off", load="step").choose(r, views)
    assert step.detail["decode_step_s"] == pytest.approx((0.01564, 0.01201))
    assert step.scores == pytest.approx((t0 * 0.01564, t1 * 0.01201))
    assert step.choice == 1 and step.detail["bs"] == (3.0, 40.0)


def test_blocks_modes_multiply_by_the_load_in_kv_blocks_for_the_requests_they_name() -> None:
    """``blocks``: M = decode_blocks + ⌈prompt / block⌉ + 1 (Dynamo's decode term) for every request;
    ``blocks-cold`` only where no instance caches any of the prompt, ``blocks-flat`` only where every
    instance caches the same prefix; BS + 1 otherwise."""
    views = [
        InstanceView(
            index=0, running=3, queued_prefill_tokens=8000, decode_blocks=3000, max_batched_tokens=4096
        ),
        InstanceView(
            index=1, running=40, queued_prefill_tokens=500, decode_blocks=500, max_batched_tokens=4096
        ),
    ]
    cost = LinearCost()

    def scores(load: str, cached: tuple[int, int]) -> tuple[float, ...]:
        r = RequestView(prompt_tokens=8000, cached_tokens=cached, block_size=16)
        return LMetricTime(cost, kv="off", load=load).choose(r, views).scores

    cold = RequestView(prompt_tokens=8000, cached_tokens=(0, 0), block_size=16)
    bs = LMetricTime(cost, kv="off").choose(cold, views)
    assert bs.choice == 0  # BS + 1: 4 against 41 (test_step_mode_multiplies_by_the_decode_step_…)
    t0, t1 = bs.scores[0] / 4, bs.scores[1] / 41
    # 8,000 / 16 = 500 blocks of its own: 3,000 + 500 + 1 against 500 + 500 + 1
    blocks = LMetricTime(cost, kv="off", load="blocks").choose(cold, views)
    assert blocks.scores == pytest.approx((t0 * 3501, t1 * 1001)) and blocks.choice == 1
    assert blocks.detail["multiplier"] == (3501.0, 1001.0)
    for load in ("blocks-cold", "blocks-flat"):  # nothing cached anywhere: both count blocks
        assert scores(load, (0, 0)) == blocks.scores
    # a prefix cached on one instance only: neither counts blocks
    assert scores("blocks-cold", (0, 1600)) == scores("bs", (0, 1600))
    assert scores("blocks-flat", (0, 1600)) == scores("bs", (0, 1600))
    # the same prefix cached everywhere: "flat" counts blocks, "cold" does not
    assert scores("blocks-cold", (1600, 1600)) == scores("bs", (1600, 1600))
    assert scores("blocks-flat", (1600, 1600)) == scores("blocks", (1600, 1600))
    assert scores("blocks", (1600, 1600)) != scores("bs", (1600, 1600))
    for load in ("blocks", "blocks-cold", "blocks-flat"):
        p = make_policy(f"lmetric-time:{load}")
        assert p.name == f"lmetric-time:{load}" and p.load == load and p.kv == "demand"


def test_step_mode_keeps_k_and_is_registered_beside_the_kv_ablations() -> None:
    views = [
        InstanceView(index=0, running=1, decode_blocks=100, kv_capacity_blocks=500, max_batched_tokens=4096),
        InstanceView(index=1, running=1, decode_blocks=400, kv_capacity_blocks=500, max_batched_tokens=4096),
    ]
    r = RequestView(prompt_tokens=100, cached_tokens=(0, 0), block_size=16)
    d = LMetricTime(LinearCost(), load="step").choose(r, views)
    # the same T on both but for the context term; K = 500/400 against 500/100
    assert d.detail["kv_factor"] == pytest.approx((1.25, 5.0)) and d.choice == 0
    p = make_policy("lmetric-time:step")
    assert p.name == "lmetric-time:step" and p.load == "step" and p.kv == "demand"
    assert make_policy("lmetric-time").load == "bs"
    with pytest.raises(UserError, match="step"):
        make_policy("lmetric-time:bs")
    with pytest.raises(ValueError, match="load must be"):
        LMetricTime(LinearCost(), load="tokens")


def test_stepq_mode_adds_one_chunk_of_the_queue_to_the_decode_step() -> None:
    # the same decode batch on both; instance 1 has 6,000 tokens queued, instance 2 has 300
    views = [
        InstanceView(index=0, running=10, decode_blocks=100, max_batched_tokens=4096),
        InstanceView(
            index=1, running=10, decode_blocks=100, queued_prefill_tokens=6000, max_batched_tokens=4096
        ),
        InstanceView(
            index=2, running=10, decode_blocks=100, queued_prefill_tokens=300, max_batched_tokens=4096
        ),
    ]
    r = RequestView(prompt_tokens=200, cached_tokens=(0, 0, 0), block_size=16)
    # D = 0.010 + 1e-5·(chunk part + 11) + 1e-7·(1,600 + 200): the queue's chunk is capped at
    # 4096 − 10 = 4086 tokens (no history)
    d = LMetricTime(LinearCost(), kv="off", load="stepq").choose(r, views)
    assert d.detail["decode_step_s"] == pytest.approx(
        (0.010 + 11e-5 + 18e-5, 0.010 + 4097e-5 + 18e-5, 0.010 + 311e-5 + 18e-5)
    )
    # without the queue's chunk ("step") the three D are equal
    s = LMetricTime(LinearCost(), kv="off", load="step").choose(r, views)
    assert len(set(s.detail["decode_step_s"])) == 1
    assert d.choice == 0 and make_policy("lmetric-time:stepq").load == "stepq"


def test_itl_counts_one_decode_step_so_a_cached_prompt_stops_piling_onto_a_large_batch() -> None:
    # instance 0 caches 5,600 of the 6,000-token prompt but decodes 40 sequences over 192k tokens;
    # instance 1 caches nothing and decodes 10 sequences over 64k tokens (K = 1: capacity unknown)
    views = [
        InstanceView(index=0, running=40, decode_blocks=12_000, max_batched_tokens=4096),
        InstanceView(index=1, running=10, decode_blocks=4_000, max_batched_tokens=4096),
    ]
    r = RequestView(prompt_tokens=6000, cached_tokens=(5600, 0), block_size=16)
    # 0: chunk 4056, p = 400, h̄ = 5800: (0.010 + 1e-5·4096 + 1e-7·192000 + 1e-9·4056·5800) × 400/4056
    # 1: chunk 4086, p = 6000, h̄ = 3000: (0.010 + 1e-5·4096 + 1e-7·64000 + 1e-9·4086·3000) × 6000/4086
    own0 = (0.010 + 0.04096 + 0.0192 + 4056 * 5800e-9) * 400 / 4056
    own1 = (0.010 + 0.04096 + 0.0064 + 4086 * 3000e-9) * 6000 / 4086
    d = LMetricTime(LinearCost()).choose(r, views)
    assert d.scores == pytest.approx((own0 * 41, own1 * 11))
    assert d.choice == 0  # the plain score: 0.379 against 1.125
    # itl: one decode step of running + 1 sequences over their context plus the whole prompt
    # 0: 0.010 + 1e-5·41 + 1e-7·(192000 + 6000) = 0.03021; 1: 0.010 + 1e-5·11 + 1e-7·70000 = 0.01711
    itl = LMetricTime(LinearCost(), name="lmetric-time:itl", itl=True)
    assert itl.itl_time(r, views[0]) == pytest.approx(0.03021)
    assert itl.itl_time(r, views[1]) == pytest.approx(0.01711)
    d2 = itl.choose(r, views)
    assert d2.scores == pytest.approx(((own0 + 0.03021) * 41, (own1 + 0.01711) * 11))
    assert d2.choice == 1  # 1.617 against 1.313
    assert d2.detail["t_own_s"] == pytest.approx((own0 + 0.03021, own1 + 0.01711))


def test_itl_is_registered_beside_the_kv_modes_with_the_default_k() -> None:
    p = make_policy("lmetric-time:itl")
    assert isinstance(p, LMetricTime) and p.name == "lmetric-time:itl" and p.itl and p.kv == "demand"
    assert not make_policy("lmetric-time").itl
    # on one idle instance the term is one single-sequence step over the prompt: T_own grows by it
    v = [InstanceView(index=0, max_batched_tokens=4096)]
    r = RequestView(prompt_tokens=1000, cached_tokens=(0,), block_size=16)
    base = make_policy("lmetric-time").choose(r, v).detail["t_own_s"][0]
    with_itl = p.choose(r, v).detail["t_own_s"][0]
    from kvroute.engine.cost import get_profile

    assert with_itl - base == pytest.approx(get_profile().cost.step_time((), 1, 1000))
