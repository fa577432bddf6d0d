"""lmetric-time's decisions equal the formula's, bit for bit, on random views and requests.

The reference below is the policy as first written: one scalar ``step_time`` call per step, K per
instance, the score (T_wait + T_own) × (BS + 1) × K and its ties. The policy under test prices every
instance's steps in one vectorised call from 8 instances on (``VECTOR_MIN_INSTANCES``); both must
give the same scores, terms and choice, with each policy's own registry cost model."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.engine.cost import get_profile
from kvroute.engine.types import CostModel
from kvroute.policies.lmetric_time import DEFAULT_CHUNK, VECTOR_MIN_INSTANCES, LMetricTime
from kvroute.policies.registry import make_policy
from kvroute.views import Choice, InstanceView, RequestView

COST = get_profile().cost


def reference_choose(cost: CostModel, request: RequestView, views: list[InstanceView], kv: str) -> Choice:
    """The slow formula (see the policy's module docstring), one instance and one step at a time."""
    step = cost.step_time
    times, bs, ks = [], [], []
    for cached, v in zip(request.cached_tokens, views, strict=True):
        nd = v.running
        chunk = max((v.max_batched_tokens or DEFAULT_CHUNK) - nd, 1)
        ctx = v.decode_blocks * request.block_size
        q = v.queued_prefill_tokens
        p = max(request.prompt_tokens - cached, 1)
        t_wait = q / chunk * step(((chunk, 0),), nd, ctx) if q else 0.0
        times.append((t_wait, p / chunk * step(((chunk, cached + p // 2),), nd, ctx)))
        bs.append(v.running + v.waiting)
        demand = float(v.decode_blocks)
        if kv in ("demand", "own"):
            demand += q / max(request.block_size, 1)
        if kv in ("own", "heldown"):  # the request's own uncached blocks
            demand += max(request.prompt_tokens - cached, 0) / max(request.block_size, 1)
        cap = v.kv_capacity_blocks
        if kv == "off" or cap <= 0:
            ks.append(1.0)
        else:
            free = cap - demand
            ks.append(cap / free if free >= 1 else cap * (2.0 - free))
    scores = [(w + o) * (b + 1) * k for (w, o), b, k in zip(times, bs, ks, strict=True)]
    best = min(
        (i for i in range(len(scores)) if scores[i] == min(scores)), key=lambda i: (bs[i], views[i].index)
    )
    return Choice(
        choice=best,
        scores=tuple(scores),
        policy="lmetric-time" if kv == "demand" else f"lmetric-time:{kv}",
        detail={
            "t_wait_s": tuple(t[0] for t in times),
            "t_own_s": tuple(t[1] for t in times),
            "bs": tuple(map(float, bs)),
            "kv_factor": tuple(ks),
        },
    )


VIEW = st.builds(
    InstanceView,
    index=st.just(0),
    running=st.one_of(st.integers(0, 20), st.integers(0, 400)),  # past the grid's 256 decodes too
    waiting=st.integers(0, 5),
    queued_prefill_tokens=st.one_of(st.just(0), st.integers(0, 60_000)),
    kv_capacity_blocks=st.sampled_from([0, 500, 18_000]),
    decode_blocks=st.one_of(st.integers(0, 5_000), st.integers(0, 30_000)),
    max_batched_tokens=st.one_of(st.none(), st.sampled_from([512, 2048, 4096, 8192]), st.integers(1, 20_000)),
)


@st.composite
def decisions(draw: st.DrawFn) -> tuple[RequestView, list[InstanceView]]:
    views = draw(st.lists(VIEW, min_size=1, max_size=70))
    views = [dataclasses.replace(v, index=i) for i, v in enumerate(views)]
    prompt = draw(st.one_of(st.integers(1, 8_000), st.integers(1, 200_000)))
    block = draw(st.sampled_from([1, 16, 64]))
    cached = tuple(draw(st.integers(0, prompt)) // block * block for _ in views)
    return RequestView(prompt_tokens=prompt, cached_tokens=cached, block_size=block), views


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(decisions(), st.sampled_from(["demand", "held", "off", "own", "heldown"]))
def test_scores_terms_and_choice_equal_the_reference(
    case: tuple[RequestView, list[InstanceView]], kv: str
) -> None:
    request, views = case
    policy = make_policy("lmetric-time" if kv == "demand" else f"lmetric-time:{kv}")
    assert isinstance(policy, LMetricTime)
    assert policy.choose(request, views) == reference_choose(COST, request, views, kv)


def test_the_bench_inputs_take_the_vectorised_path_and_match() -> None:
    """The decision the bench times at 64 instances, through both paths of one policy."""
    import random

    from benchmarks.bench_decide import _inputs

    policy = make_policy("lmetric-time")
    assert isinstance(policy, LMetricTime) and policy._many is not None
    for n in (VECTOR_MIN_INSTANCES - 1, 64):
        for request, views in _inputs(n, random.Random(n))[:50]:
            assert policy.choose(request, views) == reference_choose(COST, request, views, "demand")
