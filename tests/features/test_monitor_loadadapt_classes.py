"""Score monitor (histogram, rolling p95, persistent alert), load-adaptive switch, request classes."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig, class_weight, resolve_class
from kvroute.features.loadadapt import LoadAdaptiveConfig, cluster_load, load_bs_weight
from kvroute.features.monitor import ScoreMonitor, ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.views import InstanceView, RequestView

from ._factories import insts, req


def at(request: RequestView, now: float) -> RequestView:
    """``request`` routed at ``now`` (seconds): the time Guarded reads."""
    return dataclasses.replace(request, now=now)


def test_histogram_buckets_are_cumulative_and_le_inclusive() -> None:
    m = ScoreMonitor(ScoreMonitorConfig(), buckets=(10.0, 100.0))
    for s in (5.0, 10.0, 50.0, 1000.0):
        m.observe(s, 0.0)
    assert m.cumulative() == [(10.0, 2), (100.0, 3), (float("inf"), 4)]
    assert m.count == 4 and m.sum == 1065.0 and m.max == 1000.0


def test_rolling_p95_alert_needs_persistent_excess() -> None:
    cfg = ScoreMonitorConfig(window=100, refresh_every=100, persist=5, min_decisions=100)
    m = ScoreMonitor(cfg)
    for i in range(100):
        assert not m.observe(float(i), 0.0)  # 0..99: p95 = 95
    assert m.threshold == 95.0
    for _ in range(4):
        assert not m.observe(500.0, 1.0)  # four above: not yet persistent
    assert not m.observe(10.0, 1.0)  # back below: streak reset
    starts = [m.observe(500.0, 2.0) for _ in range(7)]
    assert starts == [False] * 4 + [True, False, False]  # one alert per episode, at the 5th
    assert m.alerts == 1 and m.alerting
    m.observe(1.0, 3.0)
    assert not m.alerting


def test_no_alert_before_min_decisions() -> None:
    m = ScoreMonitor(ScoreMonitorConfig(window=10, refresh_every=10, persist=2, min_decisions=1000))
    for i in range(50):
        m.observe(float(i), 0.0)  # rising: always above the last threshold
    assert m.alerts == 0


def test_guarded_feeds_the_monitor_with_p_token_times_bs_plus_one() -> None:
    g = Guarded(make_policy("lmetric"), FeatureConfig(monitor=ScoreMonitorConfig()))
    views = [InstanceView(index=0, running=3, queued_prefill_tokens=100), InstanceView(index=1, running=9)]
    d = g.choose(at(req(1000, [800, 0]), 0.0), views)
    assert d.choice == 0
    assert g.monitor is not None and g.monitor.sum == (1000 - 800 + 100) * (3 + 1)


def test_cluster_load_is_max_of_kv_usage_and_batch_occupancy() -> None:
    views = [
        InstanceView(index=0, running=128, kv_usage=0.2),
        InstanceView(index=1, running=300, kv_usage=0.4),
    ]
    assert cluster_load(views, 256) == pytest.approx((0.5 + 1.0) / 2)
    assert cluster_load(insts(0, 0, kv=0.9), 256) == pytest.approx(0.9)
    assert cluster_load([], 256) == 0.0


def test_load_adaptive_switches_above_the_threshold_only() -> None:
    cfg = LoadAdaptiveConfig(threshold=0.7, bs_weight=0.5)
    assert load_bs_weight(0.7, cfg) == 1.0
    assert load_bs_weight(0.7001, cfg) == 0.5
    g = Guarded(make_policy("lmetric"), FeatureConfig(load_adaptive=cfg))
    # instance 0: 1000 uncached tokens at BS 1; instance 1: 3000 uncached at BS 0
    # w = 1: 1000·2 = 2000 < 3000·1 → 0. The cached instance wins either way; make BS matter:
    r = req(4000, [3000, 0])
    low = insts(8, 0, kv=0.7)  # load exactly 0.7: w = 1 → 1000·9 = 9000 > 4000 → instance 1
    assert g.choose(at(r, 0.0), low).choice == 1
    high = insts(8, 0, kv=0.75)  # w = 0.5 → 1000·3 = 3000 < 4000 → instance 0
    d = g.choose(at(r, 0.0), high)
    assert d.choice == 0 and d.detail["bs_weight"] == (0.5,)
    assert g.counts["load_reweighted"] == 1


def test_resolve_class_order_header_user_model() -> None:
    cfg = ClassConfig(users=(("batch-bot", "tpot"),), models=(("chat-model", "ttft"),))
    assert resolve_class("TPOT", "x", "chat-model", cfg) == "tpot"  # header wins, case-insensitive
    assert resolve_class(None, "batch-bot", "chat-model", cfg) == "tpot"  # then the user rule
    assert resolve_class(None, "someone", "chat-model", cfg) == "ttft"  # then the model rule
    assert resolve_class(None, None, None, cfg) == "default"
    with pytest.raises(ValueError, match="unknown request class"):
        resolve_class("urgent", None, None, cfg)
    assert class_weight("ttft", cfg.weight_map) == 0.5 and class_weight("other", cfg.weight_map) == 1.0


def test_class_weights_change_the_decision() -> None:
    g = Guarded(make_policy("lmetric"), FeatureConfig(classes=ClassConfig()))
    views = insts(3, 0)
    r = req(3000, [2000, 0])  # instance 0: 1000 × 4^w; instance 1: 3000 × 1
    assert g.choose(at(r, 0.0), views).choice == 1  # default w = 1: 4000 > 3000
    from dataclasses import replace

    assert g.choose(at(replace(r, req_class="ttft"), 0.0), views).choice == 0  # 1000·2 = 2000 < 3000
    assert g.choose(at(replace(r, req_class="tpot"), 0.0), views).choice == 1  # 1000·16 > 3000


def test_class_rules_must_name_weighted_classes_and_need_lmetric() -> None:
    with pytest.raises(UserError):
        ClassConfig(users=(("u", "urgent"),)).check()
    with pytest.raises(UserError, match="need policy lmetric"):
        Guarded(make_policy("vllm"), FeatureConfig(classes=ClassConfig()))
