"""The peers' LMetric variants, each score computed by hand on small clusters."""

from __future__ import annotations

import random

import pytest

from kvroute.policies import make_policy
from kvroute.policies.aibrix_lmetric import AibrixLMetric, aibrix_hit_tokens
from kvroute.policies.dynamo import DynamoKv
from kvroute.policies.dynamo_lmetric import DynamoLMetric
from kvroute.policies.llm_d_lmetric import LlmDLMetric
from kvroute.policies.registry import PEER_LMETRICS
from kvroute.policies.smetric import SMetricConfig, VllmRouterSMetric
from kvroute.views import InstanceView, RequestView


def _req(prompt: int, chain: tuple[int, ...], n: int, bsz: int = 4, now: float = 0.0) -> RequestView:
    return RequestView(
        prompt_tokens=prompt,
        cached_tokens=(0,) * n,
        num_blocks=len(chain),
        block_size=bsz,
        now=now,
        chain=chain,
    )


def _idle(n: int) -> list[InstanceView]:
    return [InstanceView(index=i) for i in range(n)]


# ---- aibrix-lmetric ------------------------------------------------------------------------------


def test_aibrix_hit_tokens_uses_integer_percent() -> None:
    assert aibrix_hit_tokens(10, 1, 3) == 3  # 1·100 // 3 = 33 %, 10·33 // 100 = 3
    assert aibrix_hit_tokens(18, 2, 4) == 9  # 50 %
    assert aibrix_hit_tokens(12, 0, 3) == 0
    assert aibrix_hit_tokens(12, 3, 0) == 0


def test_aibrix_lmetric_scores_by_hand() -> None:
    pol = AibrixLMetric(random.Random(7))
    # empty table, no pending: both pods (0 + 12) × (0 + 1) = 12, a tie broken by the seeded RNG
    first = _req(12, (1, 2, 3), 2)
    c = pol.choose(first, _idle(2))
    assert c.scores == (12.0, 12.0)
    assert c.choice == random.Random(7).randrange(2)
    hold = pol.dispatched(first, 0, 0, 0.0)
    assert pol.pending(0) == (12, 1)
    # blocks 1, 2 on pod 0 of a 4-block prompt of 18 tokens: 50 % → hit 9, new 9
    # pod 0: (12 + 9) × (1 + 1) = 42; pod 1: (0 + 18) × 1 = 18
    second = _req(18, (1, 2, 9, 10), 2, now=1.0)
    c = pol.choose(second, _idle(2))
    assert c.scores == (42.0, 18.0) and c.choice == 1
    assert c.detail["new_tokens"] == (9.0, 18.0)
    hold.first_token(2.0)  # nothing is released at the first token
    assert pol.pending(0) == (12, 1)
    hold.finished(3.0)
    hold.finished(3.0)  # idempotent
    assert pol.pending(0) == (0, 0)
    c = pol.choose(_req(18, (1, 2, 9, 10), 2, now=4.0), _idle(2))
    assert c.scores == (9.0, 18.0) and c.choice == 0


def test_aibrix_lmetric_reads_its_own_table_not_the_kv_view() -> None:
    pol = AibrixLMetric(random.Random(0))
    req = RequestView(prompt_tokens=12, cached_tokens=(12, 0), num_blocks=3, block_size=4, chain=(1, 2, 3))
    assert pol.choose(req, _idle(2)).scores == (12.0, 12.0)  # the engine view's 12 cached tokens unused


def test_aibrix_lmetric_table_forgets_after_its_ttl() -> None:
    pol = AibrixLMetric(random.Random(0), table_ttl_s=100.0)
    req = _req(12, (1, 2, 3), 2)
    pol.dispatched(req, 0, 0, 0.0).finished(1.0)
    assert pol.choose(_req(12, (1, 2, 3), 2, now=50.0), _idle(2)).scores[0] == 0.0  # hit 12 → new 0
    assert pol.choose(_req(12, (1, 2, 3), 2, now=200.0), _idle(2)).scores[0] == 12.0


# ---- llm-d-lmetric -------------------------------------------------------------------------------


def test_llm_d_lmetric_scores_by_hand_and_ignores_queued_prefill() -> None:
    # prompt 100 tokens, 16-token blocks: 6 full blocks; cached 2, 4, 0 blocks
    req = RequestView(prompt_tokens=100, cached_tokens=(32, 64, 0), num_blocks=6, block_size=16)
    insts = [
        InstanceView(index=0, running=2, waiting=1, queued_prefill_tokens=1000),
        InstanceView(index=1, running=3, waiting=2),
        InstanceView(index=2),
    ]
    c = LlmDLMetric().choose(req, insts)
    # (6−2)·16·(3+1) = 256, (6−4)·16·(5+1) = 192, 6·16·1 = 96
    assert c.scores == (256.0, 192.0, 96.0) and c.choice == 2
    # a fully matched prompt costs 0 whatever waits in the engine's queue
    req = RequestView(prompt_tokens=100, cached_tokens=(96, 0), num_blocks=6, block_size=16)
    insts = [InstanceView(index=0, queued_prefill_tokens=5000), InstanceView(index=1)]
    c = LlmDLMetric().choose(req, insts)
    assert c.scores == (0.0, 96.0) and c.choice == 0


# ---- dynamo-lmetric ------------------------------------------------------------------------------


def test_dynamo_lmetric_scores_by_hand_and_differs_from_the_additive_cost() -> None:
    # prompt 16 tokens (1 incoming block), nothing cached
    req = RequestView(prompt_tokens=16, cached_tokens=(0, 0), num_blocks=1, block_size=16)
    insts = [
        InstanceView(index=0, queued_prefill_tokens=144, decode_blocks=0),  # prefill 10, decode 1
        InstanceView(index=1, queued_prefill_tokens=48, decode_blocks=5),  # prefill 4, decode 6
    ]
    c = DynamoLMetric().choose(req, insts)
    assert c.scores == (10.0 * 2.0, 4.0 * 7.0) and c.choice == 0  # 20 vs 28
    assert DynamoKv().choose(req, insts).choice == 1  # additive: 11 vs 10
    # the overlap credit: 32 of 64 tokens cached, 16 queued → (16 + 64 − 32) / 16 = 3 blocks
    req = RequestView(prompt_tokens=64, cached_tokens=(32,), num_blocks=4, block_size=16)
    c = DynamoLMetric().choose(req, [InstanceView(index=0, queued_prefill_tokens=16, decode_blocks=10)])
    assert c.scores == (3.0 * (10 + 4 + 1),)


# ---- vllm-router-smetric -------------------------------------------------------------------------

FIXED = SMetricConfig(prefill_rate=100.0, ttft_slo_base_s=1.0, ttft_slo_per_token_s=0.0)


def test_smetric_cost_model() -> None:
    pol = VllmRouterSMetric(SMetricConfig(c_lin=1.0, c_att=0.01))
    # n = 60 new of L = 100: ceil(60 + 0.01 · 60 · (100 − 30)) = ceil(102.0) = 102
    assert pol.cost(100, 40) == 102
    assert VllmRouterSMetric().cost(100, 40) == 60  # defaults: new tokens alone


def test_smetric_round_robin_among_idle_workers() -> None:
    pol = VllmRouterSMetric(FIXED)
    assert pol.choose(_req(8, (1, 2), 2), _idle(2)).choice == 0  # scores 0, 0: the rotation's start
    assert pol.choose(_req(8, (3, 4), 2), _idle(2)).choice == 1


def test_smetric_affinity_yields_to_a_feasible_worker_but_survives_when_none_meet_ttft() -> None:
    pol = VllmRouterSMetric(FIXED)
    pol.dispatched(_req(32, (1, 2), 2, bsz=16), 0, 0, 0.0)  # pending on worker 0: 32
    pol.dispatched(_req(80, (50,), 2, bsz=16), 0, 0, 0.0)  # + 80 = 112
    busy0 = [InstanceView(index=0, running=2), InstanceView(index=1)]
    follow = _req(48, (1, 2, 3), 2, bsz=16)
    c = pol.choose(follow, busy0)
    # hits 32, 0; costs 16, 48; queued 128, 48 → 1.28 s > 1 s (fails), 0.48 s (meets): no stickiness
    assert c.detail["hit"] == (32.0, 0.0) and c.detail["queued"] == (128.0, 48.0)
    assert c.detail["meets"] == (0.0, 1.0) and c.detail["stick"] == (0.0,)
    assert c.scores == (128.0 * 2, 0.0) and c.choice == 1
    pol.dispatched(_req(200, (60,), 2, bsz=16), 1, 1, 0.0)  # worker 1 now 2.48 s away too
    c = pol.choose(follow, busy0)
    assert c.detail["meets"] == (0.0, 0.0) and c.detail["stick"] == (1.0,)
    assert c.choice == 0  # no worker meets the SLO: the session stays where its cache is


def test_smetric_pending_leaves_at_first_token_and_the_rate_is_learned() -> None:
    pol = VllmRouterSMetric()  # prefill rate learned
    for k in range(1, 9):
        hold = pol.dispatched(_req(100, (), 1), 0, 0, 0.0)
        assert pol.rate(0) is None  # fewer than 8 samples so far
        hold.first_token(1.0 / k)  # 100 tokens in 1/k s: 100·k tokens/s
        hold.finished(2.0)
    # 8 samples 100..800: the 0.9 quantile is sorted[round(7 · 0.9)] = sorted[6] = 700
    assert pol.rate(0) == pytest.approx(700.0)
    held = pol.dispatched(_req(100, (), 1), 0, 0, 0.0)
    held.finished(5.0)  # ended without a first token: released, no sample
    assert pol.choose(_req(100, (), 1), _idle(1)).detail["queued"] == (100.0,)


@pytest.mark.parametrize("name", PEER_LMETRICS)
def test_peer_variants_are_registered(name: str) -> None:
    assert make_policy(name).name == name
