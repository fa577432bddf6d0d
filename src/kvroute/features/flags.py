"""Command-line flags of the features for `kvroute sim` (and anything built on its arguments), and
their translation to :class:`~kvroute.sim.runner.RunSpec` fields and a
:class:`~kvroute.routing.guarded.FeatureConfig`. Every flag defaults to off."""

from __future__ import annotations

import argparse
from typing import Any

from kvroute.errors import UserError

__all__ = [
    "add_feature_arguments",
    "feature_command_flags",
    "feature_spec_fields",
    "features_from_spec",
    "parse_class_weight",
    "parse_quota",
    "parse_scale_out",
]


def parse_scale_out(text: str) -> tuple[float, int]:
    """``T:N`` → (seconds, instances); UserError when malformed."""
    t, sep, n = text.partition(":")
    try:
        when, count = float(t), int(n)
    except ValueError:
        raise UserError(f"--scale-out {text!r}: expected T:N, e.g. 300:4") from None
    if not sep or not when >= 0 or count < 1:
        raise UserError(f"--scale-out {text!r}: T must be >= 0 seconds and N >= 1 instances")
    return when, count


def parse_quota(text: str) -> tuple[float, float]:
    """``RATE:BURST`` (tokens/s, tokens) → floats; UserError when malformed."""
    r, sep, b = text.partition(":")
    try:
        rate, burst = float(r), float(b)
    except ValueError:
        raise UserError(f"--quota {text!r}: expected TOKENS_PER_S:BURST, e.g. 2000:20000") from None
    if not sep or not rate > 0 or not burst > 0:
        raise UserError(f"--quota {text!r}: rate and burst must be > 0")
    return rate, burst


def parse_class_weight(text: str) -> tuple[str, float]:
    """``CLASS=W`` → (class, BS exponent)."""
    c, sep, w = text.partition("=")
    try:
        weight = float(w)
    except ValueError:
        raise UserError(f"--class-weight {text!r}: expected CLASS=WEIGHT, e.g. ttft=0.5") from None
    if not sep or not c or not weight >= 0:
        raise UserError(f"--class-weight {text!r}: a class name and a weight >= 0")
    return c, weight


def add_feature_arguments(p: argparse.ArgumentParser) -> None:
    """The feature flags (see docs/results/features.md)."""
    g = p.add_argument_group("production features (all off by default)")
    g.add_argument("--hotspot-mitigation", action="store_true", help="KV hot-spot detection and mitigation")
    g.add_argument("--hotspot-class-tokens", type=int, default=128, help="prefix-class length, tokens (128)")
    g.add_argument("--hotspot-window", type=float, default=60.0, help="hot-spot window, seconds (60)")
    g.add_argument(
        "--cold-start", action="store_true", help="warming instances: BS cap, +10 P-token, preload"
    )
    g.add_argument(
        "--cold-start-cap",
        default="admit",
        choices=("admit", "score", "none"),
        help="BS cap of warming instances: admit (not chosen above it), score (BS in the score capped), none",
    )
    g.add_argument("--cold-start-window", type=float, default=300.0, help="warming window, seconds (300)")
    g.add_argument(
        "--scale-out", action="append", default=[], metavar="T:N", help="N instances join at T seconds"
    )
    g.add_argument("--score-monitor", action="store_true", help="P-token×BS histogram, rolling p95 alert")
    g.add_argument(
        "--load-adaptive",
        type=float,
        nargs="?",
        const=0.5,
        default=None,
        metavar="W",
        help="above --load-threshold use score P×(BS+1)^W (W default 0.5)",
    )
    g.add_argument("--load-threshold", type=float, default=0.7, help="cluster load threshold (0.7)")
    g.add_argument("--classes", action="store_true", help="per-class BS weights (ttft 0.5, tpot 2)")
    g.add_argument(
        "--class-weight", action="append", default=[], metavar="CLASS=W", help="BS exponent of a class"
    )
    g.add_argument("--by-class", action="store_true", help="report latencies per request class")
    g.add_argument("--p-token-cap", type=int, default=None, help="avoid instances with P-token above this")
    g.add_argument("--spot-instances", type=int, default=0, help="tag the last N initial instances spot")
    g.add_argument(
        "--spot-max-tokens", type=int, default=None, help="keep requests longer than this off spot instances"
    )
    g.add_argument("--quota", default=None, metavar="RATE:BURST", help="per-user token bucket")


def feature_spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """RunSpec fields from the parsed flags (absent flags → defaults, so other commands may share it)."""
    quota = getattr(args, "quota", None)
    return {
        "hotspot_mitigation": getattr(args, "hotspot_mitigation", False),
        "hotspot_class_tokens": getattr(args, "hotspot_class_tokens", 128),
        "hotspot_window": getattr(args, "hotspot_window", 60.0),
        "cold_start": getattr(args, "cold_start", False),
        "cold_start_window": getattr(args, "cold_start_window", 300.0),
        "cold_start_cap": getattr(args, "cold_start_cap", "admit"),
        "scale_out": tuple(parse_scale_out(s) for s in getattr(args, "scale_out", [])),
        "score_monitor": getattr(args, "score_monitor", False),
        "load_adaptive": getattr(args, "load_adaptive", None),
        "load_threshold": getattr(args, "load_threshold", 0.7),
        "classes": getattr(args, "classes", False),
        "class_weights": tuple(parse_class_weight(s) for s in getattr(args, "class_weight", [])),
        "by_class": getattr(args, "by_class", False),
        "p_token_cap": getattr(args, "p_token_cap", None),
        "spot_instances": getattr(args, "spot_instances", 0),
        "spot_max_tokens": getattr(args, "spot_max_tokens", None),
        "quota": parse_quota(quota) if quota else None,
    }


def features_from_spec(spec: Any) -> Any:
    """The :class:`~kvroute.routing.guarded.FeatureConfig` a RunSpec asks for (all off → ``any`` is
    False)."""
    from kvroute.features.classes import ClassConfig
    from kvroute.features.coldstart import ColdStartConfig
    from kvroute.features.hotspot import HotspotConfig
    from kvroute.features.limits import LimitsConfig, QuotaConfig
    from kvroute.features.loadadapt import LoadAdaptiveConfig
    from kvroute.features.monitor import ScoreMonitorConfig
    from kvroute.features.settings import FeatureConfig

    classes = None
    if spec.classes or spec.class_weights:
        weights = dict(ClassConfig().weights)
        weights.update(dict(spec.class_weights))
        classes = ClassConfig(weights=tuple(weights.items()))
    limits = LimitsConfig(p_token_cap=spec.p_token_cap, spot_max_tokens=spec.spot_max_tokens)
    return FeatureConfig(
        hotspot=HotspotConfig(window_s=spec.hotspot_window, class_tokens=spec.hotspot_class_tokens)
        if spec.hotspot_mitigation
        else None,
        cold_start=ColdStartConfig(window_s=spec.cold_start_window, cap_mode=spec.cold_start_cap)
        if spec.cold_start
        else None,
        monitor=ScoreMonitorConfig() if spec.score_monitor else None,
        load_adaptive=LoadAdaptiveConfig(
            threshold=spec.load_threshold, bs_weight=spec.load_adaptive, seq_capacity=spec.max_num_seqs
        )
        if spec.load_adaptive is not None
        else None,
        classes=classes,
        limits=limits if limits.active else None,
        quota=QuotaConfig(*spec.quota) if spec.quota else None,
    ).check()


def feature_command_flags(spec: Any) -> list[str]:
    """The `kvroute sim` flags that reproduce a RunSpec's feature fields (defaults omitted)."""
    parts: list[str] = []
    if spec.hotspot_mitigation:
        parts.append("--hotspot-mitigation")
        if spec.hotspot_class_tokens != 128:
            parts.append(f"--hotspot-class-tokens {spec.hotspot_class_tokens}")
        if spec.hotspot_window != 60.0:
            parts.append(f"--hotspot-window {spec.hotspot_window:g}")
    if spec.cold_start:
        parts.append("--cold-start")
        if spec.cold_start_window != 300.0:
            parts.append(f"--cold-start-window {spec.cold_start_window:g}")
        if spec.cold_start_cap != "admit":
            parts.append(f"--cold-start-cap {spec.cold_start_cap}")
    parts += [f"--scale-out {t:g}:{n}" for t, n in spec.scale_out]
    if spec.score_monitor:
        parts.append("--score-monitor")
    if spec.load_adaptive is not None:
        parts.append(f"--load-adaptive {spec.load_adaptive:g}")
        if spec.load_threshold != 0.7:
            parts.append(f"--load-threshold {spec.load_threshold:g}")
    if spec.classes:
        parts.append("--classes")
    parts += [f"--class-weight {c}={w:g}" for c, w in spec.class_weights]
    if spec.by_class:
        parts.append("--by-class")
    if spec.p_token_cap is not None:
        parts.append(f"--p-token-cap {spec.p_token_cap}")
    if spec.spot_instances:
        parts.append(f"--spot-instances {spec.spot_instances}")
    if spec.spot_max_tokens is not None:
        parts.append(f"--spot-max-tokens {spec.spot_max_tokens}")
    if spec.quota:
        parts.append(f"--quota {spec.quota[0]:g}:{spec.quota[1]:g}")
    return parts
