"""The router's `features` config section and flags, the Prometheus collector, the alert rules file."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from kvroute.commands.settings import add_feature_arguments, features_from_args, features_from_mapping
from kvroute.errors import UserError
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.server.observe.feature_metrics import FeatureCollector
from kvroute.views import RequestView

from ._factories import insts, req


def at(request: RequestView, now: float) -> RequestView:
    """``request`` routed at ``now`` (seconds): the time Guarded reads."""
    return dataclasses.replace(request, now=now)


ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "kvroute-alerts.yml"


def test_features_section_parses_every_feature() -> None:
    f = features_from_mapping(
        {
            "hotspot": {"window_s": 30, "top_k": 3, "mitigate": False},
            "cold_start": True,
            "monitor": {"persist": 10},
            "load_adaptive": {"threshold": 0.8, "bs_weight": 0.25},
            "classes": {"weights": {"batch": 3}, "users": {"nightly": "batch"}, "models": {"m": "ttft"}},
            "limits": {"p_token_cap": 8192, "spot_max_tokens": 4096},
            "quota": {"tokens_per_s": 100, "burst": 1000, "key": "api_key"},
        }
    )
    assert (
        f.hotspot is not None
        and f.hotspot.window_s == 30.0
        and f.hotspot.top_k == 3
        and not f.hotspot.mitigate
    )
    assert f.cold_start is not None and f.cold_start.window_s == 300.0
    assert f.monitor is not None and f.monitor.persist == 10
    assert f.load_adaptive is not None and f.load_adaptive.bs_weight == 0.25
    assert f.classes is not None and f.classes.weight_map == {"ttft": 0.5, "tpot": 2.0, "batch": 3.0}
    assert f.classes.users == (("nightly", "batch"),)
    assert f.limits is not None and f.limits.p_token_cap == 8192
    assert f.quota is not None and f.quota.key == "api_key" and f.quota.tokens_per_s == 100.0
    assert (
        features_from_mapping(None) == FeatureConfig() and not features_from_mapping({"hotspot": False}).any
    )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"turbo": True}, "unknown feature 'turbo'"),
        ({"hotspot": {"windw_s": 1}}, "unknown key 'windw_s'"),
        ({"hotspot": {"window_s": "60"}}, "window_s must be a float"),
        ({"hotspot": 5}, "must be true or a mapping"),
        ({"limits": {"p_token_cap": "big"}}, "must be a number"),
        ({"quota": {"tokens_per_s": 1}}, "quota"),
        ({"quota": {"tokens_per_s": 1, "burst": 5, "key": "ip"}}, "key must be one of"),
        ({"classes": {"users": {"u": "nope"}}}, "has no weight"),
        ({"cold_start": {"cap_mode": "x"}}, "cap mode"),
        ([1], "must be a mapping"),
    ],
)
def test_bad_features_section_names_the_key(data: object, message: str) -> None:
    with pytest.raises(UserError, match=re.escape(message)):
        features_from_mapping(data, "router.yaml")


def test_flags_replace_the_features_they_name() -> None:
    p = argparse.ArgumentParser()
    add_feature_arguments(p)
    base = FeatureConfig(hotspot=HotspotConfig(window_s=10.0), monitor=ScoreMonitorConfig(persist=3))
    args = p.parse_args(
        ["--hotspot-mitigation", "--quota", "50:500", "--p-token-cap", "100", "--load-adaptive"]
    )
    f = features_from_args(args, base)
    assert f.hotspot == HotspotConfig()  # replaced with the defaults
    assert f.monitor == ScoreMonitorConfig(persist=3)  # untouched
    assert f.quota is not None and (f.quota.tokens_per_s, f.quota.burst) == (50.0, 500.0)
    assert f.limits is not None and f.limits.p_token_cap == 100
    assert f.load_adaptive is not None and f.load_adaptive.bs_weight == 0.5
    assert features_from_args(p.parse_args([])) == FeatureConfig()


def test_collector_exports_alarms_mitigations_and_the_score_histogram() -> None:
    feats = FeatureConfig(
        hotspot=HotspotConfig(min_window_requests=1, rank_interval_s=0.0, streak_factor=0.0),
        monitor=ScoreMonitorConfig(),
    )
    g = Guarded(make_policy("lmetric"), feats)
    views = insts(1, 0, 0)  # the holder is busier than the others: a replica may go to one of them
    for t in range(3):  # class cached on instance 0 only: alarm, then mitigation
        g.choose(at(req(2000, [1024, 0, 0], prefix_key=77), float(t)), views)
    reg = CollectorRegistry()
    reg.register(FeatureCollector(g, [(0, "http://a"), (1, "http://b"), (2, "http://c")], lambda: 3.0))
    text = generate_latest(reg).decode()
    assert "kvroute_hotspot_alarms_total 1.0" in text
    # t=0 arms (streak 1 > 0), t=1 is the replica, t=2 goes back to the holder and arms again
    assert "kvroute_hotspot_mitigations_total 2.0" in text
    assert "kvroute_hotspot_mitigated_requests_total 1.0" in text
    assert "kvroute_decision_score_count 3.0" in text
    assert 'kvroute_decision_score_bucket{le="+Inf"} 3.0' in text
    assert 'kvroute_feature_decisions_total{kind="mitigated"}' in text


def test_alert_rules_reference_exported_metrics() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert exprs and all(isinstance(e, str) for e in exprs)
    feats = FeatureConfig(
        hotspot=HotspotConfig(),
        monitor=ScoreMonitorConfig(),
        quota=features_from_mapping({"quota": {"tokens_per_s": 1, "burst": 1}}).quota,
    )
    reg = CollectorRegistry()
    reg.register(FeatureCollector(Guarded(make_policy("lmetric"), feats), [], lambda: 0.0))
    names = set(re.findall(r"^(kvroute_\w+?)(?:\{| )", generate_latest(reg).decode(), re.M))
    used = {n for e in exprs for n in re.findall(r"kvroute_\w+", e)}
    assert used <= names, used - names
