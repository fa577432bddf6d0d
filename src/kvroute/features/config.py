"""The ``features`` section of the router's YAML config, and the router's feature flags.

YAML (every key optional; ``true`` turns a feature on with its defaults, a mapping sets fields)::

    features:
      hotspot: {window_s: 60, top_k: 5, class_tokens: 128, mitigate: true}
      cold_start: {window_s: 300, cap_mode: admit, preload_prefixes: 4}
      monitor: {window: 2000, quantile: 0.95, persist: 20}
      load_adaptive: {threshold: 0.7, bs_weight: 0.5, seq_capacity: 256}
      classes:
        weights: {ttft: 0.5, tpot: 2.0}
        users: {batch-bot: tpot}            # user field → class
        models: {my-chat-model: ttft}       # model → class
      limits: {p_token_cap: 16384, spot_max_tokens: 4096}   # spot: backends with tags: [spot]
      quota: {tokens_per_s: 2000, burst: 20000, key: user}  # key: user | api_key

Flags (``kvroute serve``/``kvroute up``) turn a feature on with defaults, replacing that feature's
section of the file: ``--hotspot-mitigation``, ``--cold-start``, ``--score-monitor``,
``--load-adaptive [W]``, ``--classes``, ``--p-token-cap N``, ``--spot-max-tokens N``,
``--quota RATE:BURST``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.flags import parse_quota
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.limits import LimitsConfig, QuotaConfig
from kvroute.features.loadadapt import LoadAdaptiveConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig

__all__ = ["add_router_feature_arguments", "features_from_mapping", "merge_feature_flags"]

_SIMPLE: dict[str, type] = {
    "hotspot": HotspotConfig,
    "cold_start": ColdStartConfig,
    "monitor": ScoreMonitorConfig,
    "load_adaptive": LoadAdaptiveConfig,
    "limits": LimitsConfig,
}


def _typed(cls: type, data: Mapping[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            raise UserError(f"{where}: unknown key {key!r}; known: {', '.join(fields)}")
        default = f.default
        if default is not None and default is not dataclasses.MISSING and value is not None:
            want = type(default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool) != isinstance(default, bool):
                raise UserError(f"{where}: {key} must be a {want.__name__}, got {value!r}")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise UserError(f"{where}: {key} must be a number, got {value!r}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise UserError(f"{where}: {exc}") from None


def _pairs(value: Any, where: str, convert: type) -> tuple[tuple[str, Any], ...]:
    if not isinstance(value, Mapping):
        raise UserError(f"{where} must be a mapping")
    out = []
    for k, v in value.items():
        if convert is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        if not isinstance(k, str) or not isinstance(v, convert) or isinstance(v, bool):
            raise UserError(f"{where}: {k!r}: {v!r} is not a {convert.__name__}")
        out.append((k, v))
    return tuple(out)


def _classes(value: Any, where: str) -> ClassConfig:
    if value is True:
        return ClassConfig()
    if not isinstance(value, Mapping):
        raise UserError(f"{where} must be true or a mapping")
    unknown = set(value) - {"weights", "users", "models"}
    if unknown:
        raise UserError(f"{where}: unknown keys {sorted(unknown)}")
    base = ClassConfig()
    weights = dict(base.weights)
    if "weights" in value:
        weights.update(_pairs(value["weights"], f"{where}.weights", float))
    return ClassConfig(
        weights=tuple(weights.items()),
        users=_pairs(value.get("users", {}), f"{where}.users", str),
        models=_pairs(value.get("models", {}), f"{where}.models", str),
    )


def features_from_mapping(data: Any, where: str = "config") -> FeatureConfig:
    """The ``features`` section → :class:`FeatureConfig`; raises :class:`UserError` naming the bad key."""
    where = f"{where}: features"
    if data is None:
        return FeatureConfig()
    if not isinstance(data, Mapping):
        raise UserError(f"{where} must be a mapping")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if value is False or value is None:
            continue
        sub = f"{where}.{key}"
        if key == "classes":
            kwargs[key] = _classes(value, sub)
        elif key == "quota":
            if not isinstance(value, Mapping):
                raise UserError(f"{sub} needs tokens_per_s and burst")
            kwargs[key] = _typed(QuotaConfig, value, sub)
        elif key in _SIMPLE:
            if value is True:
                kwargs[key] = _SIMPLE[key]()
            elif isinstance(value, Mapping):
                kwargs[key] = _typed(_SIMPLE[key], value, sub)
            else:
                raise UserError(f"{sub} must be true or a mapping")
        else:
            raise UserError(
                f"{where}: unknown feature {key!r}; known: {', '.join([*_SIMPLE, 'classes', 'quota'])}"
            )
    return FeatureConfig(**kwargs).check()


def add_router_feature_arguments(p: argparse.ArgumentParser) -> None:
    """Feature flags of `kvroute serve` and `kvroute up` (see the module docstring)."""
    g = p.add_argument_group("production features (off by default; also the config's 'features')")
    g.add_argument("--hotspot-mitigation", action="store_true", help="KV hot-spot detection and mitigation")
    g.add_argument("--cold-start", action="store_true", help="warming backends: BS cap, +10, preload")
    g.add_argument("--score-monitor", action="store_true", help="P-token×BS histogram and p95 alert")
    g.add_argument("--load-adaptive", type=float, nargs="?", const=0.5, default=None, metavar="W")
    g.add_argument("--classes", action="store_true", help="request classes (header x-kvroute-class)")
    g.add_argument("--p-token-cap", type=int, default=None, help="avoid backends with P-token above N")
    g.add_argument("--spot-max-tokens", type=int, default=None, help="keep longer requests off spot backends")
    g.add_argument(
        "--quota", default=None, metavar="RATE:BURST", help="per-user token bucket (tokens/s:tokens)"
    )


def merge_feature_flags(base: FeatureConfig | None, args: argparse.Namespace) -> FeatureConfig:
    """``base`` (from the config file) with every feature named by a flag set to the flag's value."""
    out = base or FeatureConfig()
    changes: dict[str, Any] = {}
    if getattr(args, "hotspot_mitigation", False):
        changes["hotspot"] = HotspotConfig()
    if getattr(args, "cold_start", False):
        changes["cold_start"] = ColdStartConfig()
    if getattr(args, "score_monitor", False):
        changes["monitor"] = ScoreMonitorConfig()
    w = getattr(args, "load_adaptive", None)
    if w is not None:
        changes["load_adaptive"] = LoadAdaptiveConfig(bs_weight=w)
    if getattr(args, "classes", False):
        changes["classes"] = ClassConfig()
    cap, spot = getattr(args, "p_token_cap", None), getattr(args, "spot_max_tokens", None)
    if cap is not None or spot is not None:
        limits = out.limits or LimitsConfig()
        if cap is not None:
            limits = dataclasses.replace(limits, p_token_cap=cap)
        if spot is not None:
            limits = dataclasses.replace(limits, spot_max_tokens=spot)
        changes["limits"] = limits
    quota = getattr(args, "quota", None)
    if quota:
        rate, burst = parse_quota(quota)
        changes["quota"] = QuotaConfig(rate, burst)
    return dataclasses.replace(out, **changes).check() if changes else out
