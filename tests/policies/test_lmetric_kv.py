"""lmetric-kv: P-token × (BS + 1) × C / (C − D), checked on hand-computed views."""

from __future__ import annotations

import pytest

from kvroute.policies.lmetric_kv import LMetricKV, kv_pressure
from kvroute.policies.registry import make_policy
from kvroute.views import InstanceView, RequestView


def test_score_is_lmetric_times_the_inverse_free_kv_fraction() -> None:
    views = [
        InstanceView(index=0, running=2, kv_capacity_blocks=1000, decode_blocks=750),  # 4× pressure
        InstanceView(index=1, running=4, queued_prefill_tokens=200, kv_capacity_blocks=1000, decode_blocks=0),
        InstanceView(index=2, running=1, kv_capacity_blocks=1000, decode_blocks=500),  # 2×
    ]
    r = RequestView(prompt_tokens=1000, cached_tokens=(600, 0, 0))
    d = LMetricKV().choose(r, views)
    # P-token: 400, 1200, 1000; BS + 1: 3, 5, 2; factor 4, 1, 2
    assert d.scores == (400 * 3 * 4.0, 1200 * 5 * 1.0, 1000 * 2 * 2.0)
    assert d.choice == 2 and d.policy == "lmetric-kv"  # 4,000 < 4,800 < 6,000
    assert make_policy("lmetric").choose(r, views).choice == 0  # the paper's score: 1,200 < 2,000 < 6,000


def test_a_nearly_full_pool_loses_to_an_empty_one_that_plain_lmetric_would_not_pick() -> None:
    views = [
        InstanceView(index=0, running=3, kv_capacity_blocks=100, decode_blocks=95),
        InstanceView(index=1, running=5, kv_capacity_blocks=100, decode_blocks=10),
    ]
    r = RequestView(prompt_tokens=2000, cached_tokens=(0, 0))
    assert make_policy("lmetric").choose(r, views).choice == 0  # 2000×4 < 2000×6
    d = make_policy("lmetric-kv").choose(r, views)
    assert d.choice == 1  # 2000×4×20 = 160,000 > 2000×6×(100/90) ≈ 13,333
    assert d.scores[1] == pytest.approx(2000 * 6 * 100 / 90)


def test_kv_pressure_edges() -> None:
    assert kv_pressure(InstanceView(index=0)) == 1.0  # capacity unknown: plain lmetric
    assert kv_pressure(InstanceView(index=0, kv_capacity_blocks=10, decode_blocks=0)) == 1.0
    assert kv_pressure(InstanceView(index=0, kv_capacity_blocks=10, decode_blocks=10)) == 10.0  # 1 block free
    assert (
        kv_pressure(InstanceView(index=0, kv_capacity_blocks=10, decode_blocks=25)) == 10.0
    )  # overcommitted


def test_without_capacity_it_chooses_like_lmetric() -> None:
    views = [
        InstanceView(index=i, running=b, queued_prefill_tokens=q)
        for i, (b, q) in enumerate([(3, 0), (1, 900), (0, 50)])
    ]
    r = RequestView(prompt_tokens=500, cached_tokens=(400, 0, 0))
    a, b = make_policy("lmetric").choose(r, views), make_policy("lmetric-kv").choose(r, views)
    assert a.choice == b.choice and tuple(map(float, a.scores)) == b.scores


def test_ties_go_to_lower_bs_then_index() -> None:
    views = [InstanceView(index=0, running=1), InstanceView(index=1, running=0, queued_prefill_tokens=100)]
    r = RequestView(prompt_tokens=100, cached_tokens=(0, 0))  # 100×2 == 200×1
    assert LMetricKV().choose(r, views).choice == 1


def test_guarded_own_score_keeps_the_kv_factor() -> None:
    """With request classes on, the feature wrapper computes the score itself; for lmetric-kv it must
    still multiply by C / (C − D)."""
    from kvroute.features.classes import ClassConfig
    from kvroute.features.settings import FeatureConfig
    from kvroute.routing.guarded import Guarded

    views = [
        InstanceView(index=0, running=3, kv_capacity_blocks=100, decode_blocks=95),
        InstanceView(index=1, running=5, kv_capacity_blocks=100, decode_blocks=10),
    ]
    r = RequestView(prompt_tokens=2000, cached_tokens=(0, 0))
    g = Guarded(make_policy("lmetric-kv"), FeatureConfig(classes=ClassConfig()))
    d = g.choose(r, views)
    assert d.choice == 1 and d.scores == pytest.approx((2000 * 4 * 20.0, 2000 * 6 * 100 / 90))
    plain = Guarded(make_policy("lmetric"), FeatureConfig(classes=ClassConfig()))
    assert plain.choose(r, views).choice == 0
