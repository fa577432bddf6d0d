"""A plain mapping (the router YAML's ``features`` section, Ray Serve's ``request_router_kwargs``)
→ :class:`~kvroute.features.settings.FeatureConfig`, type-checked against each feature's settings
class. Pure: it takes an already parsed mapping (no YAML, no argparse); the command-line flags and the
YAML files are read in :mod:`kvroute.commands.settings`, which uses these functions."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.features.limits import QuotaConfig
from kvroute.features.settings import FeatureConfig

__all__ = ["FEATURES", "build", "default_of", "features_from_mapping", "field_of", "typed"]


def _feature_classes() -> dict[str, type]:
    """FeatureConfig field → the feature's settings class (from the ``X | None`` annotations)."""
    hints = typing.get_type_hints(FeatureConfig)
    out = {}
    for f in dataclasses.fields(FeatureConfig):
        (cls,) = (a for a in typing.get_args(hints[f.name]) if a is not type(None))
        out[f.name] = cls
    return out


FEATURES: dict[str, type] = _feature_classes()
"""FeatureConfig field name → settings class, derived from :class:`FeatureConfig` itself."""


def field_of(cls: type, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def default_of(cls: type, name: str) -> Any:
    return field_of(cls, name).default


def typed(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Keyword arguments for ``cls`` from ``data``, type-checked against the fields' defaults."""
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
    return kwargs


def build(cls: type, data: Mapping[str, Any], where: str) -> Any:
    try:
        return cls(**typed(cls, data, where))
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
    unknown = set(value) - {f.name for f in dataclasses.fields(ClassConfig)}
    if unknown:
        raise UserError(f"{where}: unknown keys {sorted(unknown)}")
    weights = dict(ClassConfig().weights)
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
        cls = FEATURES.get(key)
        if cls is None:
            raise UserError(f"{where}: unknown feature {key!r}; known: {', '.join(FEATURES)}")
        if cls is ClassConfig:
            kwargs[key] = _classes(value, sub)
        elif cls is QuotaConfig:  # no defaults for the rate and the burst
            if not isinstance(value, Mapping):
                raise UserError(f"{sub} needs tokens_per_s and burst")
            kwargs[key] = build(cls, value, sub)
        elif value is True:
            kwargs[key] = cls()
        elif isinstance(value, Mapping):
            kwargs[key] = build(cls, value, sub)
        else:
            raise UserError(f"{sub} must be true or a mapping")
    return FeatureConfig(**kwargs).check()
