from __future__ import annotations

import random

import pytest

from kvroute.policies.aibrix import AibrixPrefixCache
from kvroute.policies.bailian import Bailian
from kvroute.policies.dynamo import DynamoKv
from kvroute.policies.linear import LinearCombo
from kvroute.policies.llm_d import LlmD
from kvroute.policies.sglang import SglangCacheAware
from kvroute.policies.vllm import VllmBalancer
from kvroute.views import InstanceView

from ._factories import make_instances, make_request


def inst(i: int, **kw: object) -> InstanceView:
    return InstanceView(index=i, **kw)  # type: ignore[arg-type]


# ---------------------------------------------------------------- vllm
# (loads (running, waiting), kv_usage, variant, choice, scores)
VLLM_CASES = [
    # v1: 4w + r = [4*2+1, 4*0+6, 4*1+3] = [9, 6, 7] -> 1
    ([(1, 2), (6, 0), (3, 1)], (0.0, 0.0, 0.0), "v1", 1, (9.0, 6.0, 7.0)),
    # v1 tie: [4, 4] -> lower index 0
    ([(4, 0), (0, 1)], (0.0, 0.0), "v1", 0, (4.0, 4.0)),
    # new: (r+w) + 6*w*max(0, kv-0.5): [3 + 6*2*0.4, 6 + 0, 4 + 6*1*0] = [7.8, 6, 4] -> 2
    ([(1, 2), (6, 0), (3, 1)], (0.9, 0.9, 0.2), "new", 2, (7.8, 6.0, 4.0)),
]


@pytest.mark.parametrize(("loads", "kv", "variant", "choice", "scores"), VLLM_CASES)
def test_vllm(loads, kv, variant, choice, scores) -> None:
    insts = [
        inst(i, running=r, waiting=w, kv_usage=u) for i, ((r, w), u) in enumerate(zip(loads, kv, strict=True))
    ]
    d = VllmBalancer(variant).choose(make_request(10, (0,) * len(insts)), insts)
    assert d.choice == choice
    assert d.scores == pytest.approx(scores)
    assert d.lower_is_better


# ---------------------------------------------------------------- llm-d
def test_llm_d_weighted_scorers() -> None:
    # request: 64 tokens = 4 blocks of 16; cached [64, 32, 0] -> prefix [1, 0.5, 0]
    # waiting [4, 0, 2] -> queue (4-q)/4 = [0, 1, 0.5]; kv [0.5, 0.9, 0.0] -> [0.5, 0.1, 1.0]
    # total = 3p + 2q + 2k = [3+0+1, 1.5+2+0.2, 0+1+2] = [4.0, 3.7, 3.0] -> 0
    insts = [
        inst(0, waiting=4, kv_usage=0.5),
        inst(1, waiting=0, kv_usage=0.9),
        inst(2, waiting=2, kv_usage=0.0),
    ]
    d = LlmD().choose(make_request(64, (64, 32, 0)), insts)
    assert d.choice == 0
    assert d.scores == pytest.approx((4.0, 3.7, 3.0))
    assert d.detail["prefix"] == pytest.approx((1.0, 0.5, 0.0))
    assert d.detail["queue"] == pytest.approx((0.0, 1.0, 0.5))
    assert not d.lower_is_better


def test_llm_d_equal_queues_score_one_and_tie_to_lower_index() -> None:
    # all waiting equal -> queue 1; no cache, equal kv -> totals equal 0 + 2 + 2 = 4 -> index 0
    insts = [inst(0, waiting=3), inst(1, waiting=3)]
    d = LlmD().choose(make_request(64, (0, 0)), insts)
    assert d.scores == (4.0, 4.0)
    assert d.choice == 0


def test_llm_d_short_prompt_has_no_prefix_score() -> None:
    d = LlmD().choose(make_request(8, (0, 0)), [inst(0), inst(1, kv_usage=0.5)])
    assert d.detail["prefix"] == (0.0, 0.0)
    assert d.choice == 0


# ---------------------------------------------------------------- sglang
SGLANG_CASES = [
    # balanced, best match 800/1000 = 0.8 > 0.3 -> 1 (despite higher load)
    (1000, (0, 800, 0), [(5, 0), (9, 0), (1, 0)], 1, False),
    # imbalanced: loads [100, 30, 2]: 98 > 64 and 100 > 3 -> least loaded 2
    (1000, (0, 800, 0), [(100, 0), (30, 0), (2, 0)], 2, False),
    # spread 98 > 64 but 100 > 1.5*60? loads [100, 60, 2] min=2 -> imbalanced -> 2
    (1000, (1000, 0, 0), [(100, 0), (60, 0), (2, 0)], 2, False),
    # gap > 64 but not relative: loads [200, 150, 150]: 50 < 64 -> balanced -> best match 0
    (1000, (1000, 0, 0), [(200, 0), (150, 0), (150, 0)], 0, False),
    # best match 0.2 <= 0.3 -> least loaded (load = running + waiting: [3, 2+2, 1+0]) -> 2
    (1000, (200, 0, 0), [(3, 0), (2, 2), (1, 0)], 2, False),
    # match tie 0.5 on 0 and 1 -> least loaded of them -> 1
    (100, (50, 50, 0), [(4, 0), (2, 0), (0, 0)], 1, False),
]


@pytest.mark.parametrize(("prompt", "cached", "loads", "choice", "_"), SGLANG_CASES)
def test_sglang(prompt, cached, loads, choice, _) -> None:
    d = SglangCacheAware().choose(make_request(prompt, cached), make_instances(*loads))
    assert d.choice == choice


def test_sglang_reports_mode() -> None:
    d = SglangCacheAware().choose(make_request(100, (0, 0)), make_instances((100, 0), (0, 0)))
    assert d.detail["imbalanced"] == (1.0,)
    assert d.scores == (100.0, 0.0)
    assert d.lower_is_better
    d = SglangCacheAware().choose(make_request(100, (64, 0)), make_instances((1, 0), (0, 0)))
    assert d.detail["imbalanced"] == (0.0,)
    assert d.scores == (0.64, 0.0)
    assert not d.lower_is_better


# ---------------------------------------------------------------- dynamo
def test_dynamo_cost() -> None:
    # block 16, prompt 160 tokens (10 blocks, incoming decode = 10)
    # i0: queued 0, cached 128 -> prefill (0+160-128)/16 = 2;   decode 30+10 = 40 -> 42
    # i1: queued 320, cached 0 -> prefill (320+160)/16 = 30;    decode 0+10 = 10 -> 40
    # i2: queued 32, cached 160 -> prefill 32/16 = 2;          decode 25+10 = 35 -> 37 -> choice 2
    insts = [
        inst(0, decode_blocks=30),
        inst(1, queued_prefill_tokens=320),
        inst(2, queued_prefill_tokens=32, decode_blocks=25),
    ]
    d = DynamoKv().choose(make_request(160, (128, 0, 160)), insts)
    assert d.scores == pytest.approx((42.0, 40.0, 37.0))
    assert d.choice == 2
    assert d.detail["prefill_blocks"] == pytest.approx((2.0, 30.0, 2.0))
    # prefill_load_scale 3: [46, 100, 41] -> still 2; scale 0 -> decode only [40, 10, 35] -> 1
    assert DynamoKv(3.0).choose(make_request(160, (128, 0, 160)), insts).scores == pytest.approx(
        (46, 100, 41)
    )
    assert DynamoKv(0.0).choose(make_request(160, (128, 0, 160)), insts).choice == 1


def test_dynamo_partial_block_prompt_rounds_incoming_up_and_ties_to_index() -> None:
    # prompt 20 tokens -> incoming ceil(20/16) = 2; prefill 20/16 = 1.25 on both -> tie -> 0
    d = DynamoKv().choose(make_request(20, (0, 0)), [inst(0), inst(1)])
    assert d.scores == (3.25, 3.25)
    assert d.choice == 0


# ---------------------------------------------------------------- linear
LINEAR_CASES = [
    # P = [1000, 200, 1000], BS = [0, 4, 1] -> nP = [1, 0, 1], nBS = [0, 1, 0.25]
    # λ=0.7: [0.7, 0.3, 0.775] -> 1 ; λ=0.2: [0.2, 0.8, 0.4] -> 0
    # λ=1: [1, 0, 1] -> 1 ; λ=0: [0, 1, .25] -> 0
    (0.7, 1, (0.7, 0.3, 0.775)),
    (0.2, 0, (0.2, 0.8, 0.4)),
    (1.0, 1, (1.0, 0.0, 1.0)),
    (0.0, 0, (0.0, 1.0, 0.25)),
]


@pytest.mark.parametrize(("lam", "choice", "scores"), LINEAR_CASES)
def test_linear(lam, choice, scores) -> None:
    d = LinearCombo(lam).choose(make_request(1000, (0, 800, 0)), make_instances((0, 0), (3, 1), (1, 0)))
    assert d.choice == choice
    assert d.scores == pytest.approx(scores)
    assert d.detail["p_token"] == (1000.0, 200.0, 1000.0)


def test_linear_all_equal_normalises_to_zero_and_ties_by_bs_then_index() -> None:
    d = LinearCombo(0.5).choose(make_request(10, (0, 0, 0)), make_instances((1, 0), (1, 0), (1, 0)))
    assert d.scores == (0.0, 0.0, 0.0)
    assert d.choice == 0


def test_linear_rejects_bad_lambda() -> None:
    with pytest.raises(ValueError):
        LinearCombo(1.5)


# ---------------------------------------------------------------- bailian
class FixedRandom(random.Random):
    """``random()`` returns the given values in turn."""

    def __init__(self, *values: float) -> None:
        super().__init__(0)
        self._values = list(values)

    def random(self) -> float:
        return self._values.pop(0)


def test_bailian_scores_max_normalisation() -> None:
    # prompt 100, cached [80, 0, 40] -> hit [0.8, 0, 0.4]
    # bs [4, 0, 2] (max 4) -> 1 - bs/4 = [0, 1, 0.5]
    # tokens = queued + decode_blocks*16: [0+10*16, 100+0, 0+0] = [160, 100, 0] -> 1 - t/160 = [0, 0.375, 1]
    # score = .7h + .15b + .15t = [0.56, 0.20625, 0.28 + 0.075 + 0.15 = 0.505]
    insts = [
        inst(0, running=4, decode_blocks=10),
        inst(1, queued_prefill_tokens=100),
        inst(2, running=1, waiting=1),
    ]
    req = make_request(100, (80, 0, 40))
    d = Bailian(FixedRandom(0.0)).choose(req, insts)
    assert d.scores == pytest.approx((0.56, 0.20625, 0.505))
    assert not d.lower_is_better
    total = 0.56 + 0.20625 + 0.505
    # sampling walks the cumulative scores: r = u * total
    assert d.choice == 0  # u = 0 -> first
    assert Bailian(FixedRandom(0.5)).choose(req, insts).choice == 1  # r = 0.636 in [0.56, 0.766)
    assert Bailian(FixedRandom(0.99)).choose(req, insts).choice == 2
    assert Bailian(FixedRandom(0.56 / total - 1e-9)).choose(req, insts).choice == 0


def test_bailian_minmax_normalisation() -> None:
    # hit [0.8, 0, 0.4] -> [1, 0, 0.5]; bs [4, 0, 2] -> (4-b)/4 = [0, 1, .5]; tokens all 0 -> [0, 0, 0]
    # score = [0.7, 0.15, 0.35 + 0.075 = 0.425]
    insts = [inst(0, running=4), inst(1), inst(2, running=2)]
    d = Bailian(FixedRandom(0.0), normalise="minmax").choose(make_request(100, (80, 0, 40)), insts)
    assert d.scores == pytest.approx((0.7, 0.15, 0.425))


def test_bailian_all_zero_scores_fall_back_to_uniform() -> None:
    # no hits, equal nonzero load and tokens -> every score 0
    insts = [inst(i, running=2, queued_prefill_tokens=5) for i in range(4)]
    seen = {Bailian(random.Random(s)).choose(make_request(10, (0,) * 4), insts).choice for s in range(40)}
    assert seen == {0, 1, 2, 3}


def test_bailian_same_seed_same_sequence() -> None:
    insts = make_instances((1, 0), (0, 0), (2, 1))
    req = make_request(100, (50, 0, 100))
    a, b = Bailian(random.Random(7)), Bailian(random.Random(7))
    seq_a = [a.choose(req, insts).choice for _ in range(50)]
    assert seq_a == [b.choose(req, insts).choice for _ in range(50)]
    assert len(set(seq_a)) > 1  # it really samples


# ---------------------------------------------------------------- aibrix
AIBRIX_CASES = [
    # imbalanced: loads [10, 1, 5] spread 9 > 8 -> least loaded 1 (even though 0 has the cache)
    ((100, 0, 0), [(10, 0), (1, 0), (5, 0)], 1),
    # balanced: loads [3, 1, 2], mean 2, sample sd 1 -> bound 3; matches [1.0, 0, 0.5] -> 0 (3 <= 3)
    ((100, 0, 50), [(3, 0), (1, 0), (2, 0)], 0),
    # balanced: loads [6, 0, 0]: mean 2, sd = sqrt((16+4+4)/2) = 3.46 -> bound 5.46;
    # 0 is over the bound -> 2 (match .5)
    ((100, 0, 50), [(6, 0), (0, 0), (0, 0)], 2),
    # no instance has a match -> least loaded (load = running + waiting: [2, 1+1, 1]) -> 2
    ((0, 0, 0), [(2, 0), (1, 1), (1, 0)], 2),
    # equal match on 0 and 1 -> lower load first -> 1
    ((50, 50, 0), [(2, 0), (1, 0), (0, 0)], 1),
    # only match over the bound -> fallback least loaded: loads [8, 0, 0] mean 2.67 sd 4.62 -> 7.29 < 8 -> 1
    ((50, 0, 0), [(8, 0), (0, 0), (0, 0)], 1),
]


@pytest.mark.parametrize(("cached", "loads", "choice"), AIBRIX_CASES)
def test_aibrix(cached, loads, choice) -> None:
    d = AibrixPrefixCache().choose(make_request(100, cached), make_instances(*loads))
    assert d.choice == choice
    assert d.scores == tuple(c / 100 for c in cached)


def test_aibrix_imbalanced_tie_prefers_match() -> None:
    # loads [9, 0, 0] -> imbalanced; least loaded tie between 1 and 2 -> higher match -> 2
    d = AibrixPrefixCache().choose(make_request(100, (100, 0, 30)), make_instances((9, 0), (0, 0), (0, 0)))
    assert d.choice == 2
    assert d.detail["imbalanced"] == (1.0,)
