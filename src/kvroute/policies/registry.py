"""Registry of routing policies: name → factory, and parsing of parameterised names.

A name is ``base`` or ``base:param`` (e.g. ``linear:0.55``, ``lmetric:0.5``). Each factory takes the
parameter string (``None`` when absent) and a ``random.Random`` and returns a fresh policy; it raises
:class:`~kvroute.errors.UserError` for a bad parameter. Policies without a parameter reject one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from types import MappingProxyType

from kvroute.errors import UserError
from kvroute.policies.base import Policy
from kvroute.policies.lmetric import LMetric
from kvroute.policies.simple import LeastRequests, PowerOfTwo, RandomChoice, RoundRobin

__all__ = ["DEFAULT_SEED", "POLICIES", "PolicyFactory", "make_policy", "policy_names"]

PolicyFactory = Callable[[str | None, random.Random], Policy]

DEFAULT_SEED = 0
"""Seed of the RNG given to a policy when ``make_policy`` gets no ``rng`` (runs stay reproducible)."""


def _float_param(base: str, param: str, lo: float, hi: float) -> float:
    try:
        value = float(param)
    except ValueError:
        raise UserError(f"policy {base!r}: parameter {param!r} is not a number") from None
    if not (math.isfinite(value) and lo <= value <= hi):
        raise UserError(f"policy {base!r}: parameter {param} must be in [{lo}, {hi}]")
    return value


def _no_param(base: str, param: str | None) -> None:
    if param is not None:
        raise UserError(f"policy {base!r} takes no parameter (got {base}:{param})")


def _lmetric(param: str | None, rng: random.Random) -> Policy:
    if param is None:
        return LMetric()
    return LMetric(bs_weight=_float_param("lmetric", param, 0.0, 16.0), name=f"lmetric:{param}")


def _simple(cls: Callable[[], Policy], base: str) -> PolicyFactory:
    def factory(param: str | None, rng: random.Random) -> Policy:
        _no_param(base, param)
        return cls()

    return factory


def _seeded(cls: Callable[[random.Random], Policy], base: str) -> PolicyFactory:
    def factory(param: str | None, rng: random.Random) -> Policy:
        _no_param(base, param)
        return cls(rng)

    return factory


POLICIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        "lmetric": _lmetric,
        "round-robin": _simple(RoundRobin, "round-robin"),
        "random": _seeded(RandomChoice, "random"),
        "p2c": _seeded(PowerOfTwo, "p2c"),
        "least-requests": _simple(LeastRequests, "least-requests"),
    }
)
"""Policy name → factory (read-only). ``lmetric:<w>`` sets the BS exponent w in [0, 16]."""


def policy_names() -> list[str]:
    """Registered base names, in registry order (parameterised forms such as ``linear:0.7`` also parse)."""
    return list(POLICIES)


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    """Build a fresh policy from ``name`` (``base`` or ``base:param``).

    ``rng`` feeds the randomised policies; ``None`` means ``random.Random(DEFAULT_SEED)``.
    Raises :class:`UserError` naming the valid policies for an unknown name, or for a bad parameter.
    """
    base, sep, param = name.strip().partition(":")
    factory = POLICIES.get(base)
    if factory is None:
        raise UserError(f"unknown policy {name!r}; valid policies: {', '.join(POLICIES)}")
    if sep and not param:
        raise UserError(f"policy {name!r}: empty parameter after ':'")
    return factory(param if sep else None, rng if rng is not None else random.Random(DEFAULT_SEED))
