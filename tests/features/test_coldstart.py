"""Cold start: warming window, BS cap (admit and score modes), (P-token + 10) × (BS + 1), preloads."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.errors import UserError
from kvroute.features.coldstart import ColdStartConfig, FrequentPrefixes, WarmupTracker, common_prefix_blocks
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.views import RequestView

from ._factories import insts, req


def at(request: RequestView, now: float) -> RequestView:
    """``request`` routed at ``now`` (seconds): the time Guarded reads."""
    return dataclasses.replace(request, now=now)


def guarded(**cs: object) -> Guarded:
    return Guarded(make_policy("lmetric"), FeatureConfig(cold_start=ColdStartConfig(**cs)))  # type: ignore[arg-type]


def test_warming_window() -> None:
    t = WarmupTracker(300.0)
    t.reset(2, 10.0)
    assert t.warming(2, 10.0) and t.warming(2, 309.9)
    assert not t.warming(2, 310.0) and not t.warming(1, 20.0)
    assert not t.any_warming()  # the expired entry was dropped


def test_admit_cap_keeps_a_warming_instance_at_or_above_half_the_warm_mean_out() -> None:
    g = guarded()
    g.instance_reset(0, 0.0)
    # warm instances at BS 8 and 12: mean 10, cap 5. Instance 0 is idle-ish at BS 5 = cap.
    views = insts(5, 8, 12)
    # nothing cached: lmetric alone would pick instance 0 (lowest BS)
    assert make_policy("lmetric").choose(req(1000, [0, 0, 0]), views).choice == 0
    d = g.choose(at(req(1000, [0, 0, 0]), 1.0), views)
    assert d.choice == 1 and d.scores[0] == float("inf")
    assert g.counts["warming_capped"] == 1
    # just below the cap it is eligible again
    d = g.choose(at(req(1000, [0, 0, 0]), 1.0), insts(4, 8, 12))
    assert d.choice == 0
    # after the window it is a normal instance
    d = g.choose(at(req(1000, [0, 0, 0]), 301.0), views)
    assert d.choice == 0


def test_idle_cluster_lets_a_warming_instance_take_one_request() -> None:
    g = guarded()
    g.instance_reset(1, 0.0)
    d = g.choose(at(req(1000, [0, 0]), 1.0), insts(3, 0))  # warm mean 3 → cap max(1, 1.5): BS 0 < 1.5
    assert d.choice == 1
    d = g.choose(at(req(1000, [0, 0]), 1.0), insts(0, 0))  # warm mean 0 → cap 1: still eligible at BS 0
    assert d.choice == 0  # (equal scores apart from the +10 on the warming one)


def test_score_is_p_token_plus_ten_times_bs_plus_one_on_warming_instances() -> None:
    g = guarded(cap_mode="none")
    g.instance_reset(0, 0.0)
    d = g.choose(at(req(1000, [0, 0]), 5.0), insts(1, 1))
    assert d.scores == ((1000 + 10) * 2, 1000 * 2)
    assert d.choice == 1  # the +10 breaks the tie against the warming instance


def test_score_cap_mode_caps_the_bs_the_score_sees() -> None:
    g = guarded(cap_mode="score")
    g.instance_reset(0, 0.0)
    d = g.choose(at(req(1000, [0, 0, 0]), 1.0), insts(9, 8, 12))  # cap = int(0.5 × 10) = 5
    assert d.scores[0] == (1000 + 10) * (5 + 1)
    assert d.choice == 0


def test_frequent_prefixes_keep_the_common_prefix_and_rank_by_count() -> None:
    f = FrequentPrefixes(window_s=60.0, block_size=2)
    f.observe(11, [1, 2, 3, 4], 0.0, tokens=list(range(8)), model="m")
    f.observe(11, [1, 2, 3, 9, 10], 1.0)
    f.observe(22, [5, 6], 2.0)
    top = f.top(2, 3.0)
    assert [p.key for p in top] == [11, 22]
    assert top[0].chain == (1, 2, 3) and top[0].tokens == tuple(range(6)) and top[0].model == "m"
    assert top[0].count == 2
    assert [p.key for p in f.top(5, 61.5)] == [22]  # class 11's requests left the window


def test_common_prefix_blocks() -> None:
    assert common_prefix_blocks([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_blocks([1, 2], [1, 2, 3]) == 2
    assert common_prefix_blocks([], [1]) == 0


def test_instance_reset_returns_classes_seen_twice_most_frequent_first() -> None:
    g = guarded(preload_prefixes=2)
    chain_a = list(range(100, 120))  # 20 blocks of 16 tokens ≥ the 8-block class
    chain_b = list(range(200, 220))
    for t in range(3):
        g.note([*chain_a, 1000 + t], 16, float(t))
    for t in range(2):
        g.note([*chain_b, 2000 + t], 16, float(t))
    g.note(list(range(300, 320)), 16, 3.0)  # seen once: not preloaded
    pre = g.instance_reset(5, 4.0)
    assert [p.chain for p in pre] == [tuple(chain_a), tuple(chain_b)]
    assert g.counts["preloads"] == 2 and g.warmup is not None and g.warmup.warming(5, 4.0)


def test_bad_cold_start_config() -> None:
    with pytest.raises(UserError):
        guarded(cap_mode="bogus")
    with pytest.raises(UserError):
        guarded(bs_cap_fraction=0.0)
