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
from kvroute.policies.aibrix import AibrixPrefixCache
from kvroute.policies.aibrix_lmetric import AibrixLMetric
from kvroute.policies.bailian import BAILIAN_NORMALISATIONS, Bailian
from kvroute.policies.base import Policy
from kvroute.policies.dynamo import DynamoKv
from kvroute.policies.dynamo_lmetric import DynamoLMetric
from kvroute.policies.linear import DEFAULT_LAMBDA, LinearCombo
from kvroute.policies.llm_d import LlmD
from kvroute.policies.llm_d_lmetric import LlmDLMetric
from kvroute.policies.lmetric import LMetric
from kvroute.policies.lmetric_kv import LMetricKV
from kvroute.policies.lmetric_time import KV_MODES, LOAD_MODES, LMetricTime
from kvroute.policies.sglang import SglangCacheAware
from kvroute.policies.simple import LeastRequests, PowerOfTwo, RandomChoice, RoundRobin
from kvroute.policies.smetric import VllmRouterSMetric
from kvroute.policies.vllm import VLLM_VARIANTS, VllmBalancer

__all__ = [
    "DEFAULT_POLICY",
    "DEFAULT_ROUTER_QUEUE",
    "DEFAULT_SEED",
    "PEER_LMETRICS",
    "POLICIES",
    "PolicyFactory",
    "make_policy",
    "policy_names",
]

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


def _lmetric_time(param: str | None, rng: random.Random) -> Policy:
    from kvroute.engine.cost import get_profile

    name = "lmetric-time" if param is None else f"lmetric-time:{param}"
    if param in LOAD_MODES[1:]:  # a multiplier other than BS + 1 (LOAD_MODES[0], the policy's)
        return LMetricTime(get_profile().cost, name=name, load=param)
    if param == "itl":  # the default's K, and one decode step in the request's own time
        return LMetricTime(get_profile().cost, name=name, itl=True)
    kv = _choice_param("lmetric-time", param, (*KV_MODES, *LOAD_MODES[1:], "itl"))
    return LMetricTime(get_profile().cost, name=name, kv=kv)


def _linear(param: str | None, rng: random.Random) -> Policy:
    if param is None:  # the paper's best λ for chat workloads; ≈ 0.55 for API workloads
        return LinearCombo(DEFAULT_LAMBDA, name="linear")
    return LinearCombo(_float_param("linear", param, 0.0, 1.0), name=f"linear:{param}")


def _choice_param(base: str, param: str | None, allowed: tuple[str, ...]) -> str:
    value = allowed[0] if param is None else param
    if value not in allowed:
        raise UserError(f"policy {base!r}: parameter {param!r} must be one of {', '.join(allowed)}")
    return value


def _vllm(param: str | None, rng: random.Random) -> Policy:
    return VllmBalancer(variant=_choice_param("vllm", param, VLLM_VARIANTS))


def _bailian(param: str | None, rng: random.Random) -> Policy:
    return Bailian(rng, normalise=_choice_param("bailian", param, BAILIAN_NORMALISATIONS))


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
        "lmetric-kv": _simple(LMetricKV, "lmetric-kv"),
        "lmetric-time": _lmetric_time,
        "vllm": _vllm,
        "llm-d": _simple(LlmD, "llm-d"),
        "sglang": _simple(SglangCacheAware, "sglang"),
        "dynamo": _simple(DynamoKv, "dynamo"),
        "linear": _linear,
        "bailian": _bailian,
        "aibrix": _simple(AibrixPrefixCache, "aibrix"),
        "aibrix-lmetric": _seeded(AibrixLMetric, "aibrix-lmetric"),
        "llm-d-lmetric": _simple(LlmDLMetric, "llm-d-lmetric"),
        "dynamo-lmetric": _simple(DynamoLMetric, "dynamo-lmetric"),
        "vllm-router-smetric": _simple(VllmRouterSMetric, "vllm-router-smetric"),
        "round-robin": _simple(RoundRobin, "round-robin"),
        "random": _seeded(RandomChoice, "random"),
        "p2c": _seeded(PowerOfTwo, "p2c"),
        "least-requests": _simple(LeastRequests, "least-requests"),
    }
)
"""Policy name → factory (read-only).

Parameterised forms: ``lmetric:<w>`` (BS exponent w in [0, 16]), ``linear:<λ>`` (λ in [0, 1]; plain
``linear`` is λ = 0.7), ``vllm:new`` (recent vLLM's KV-pressure-aware score; ``vllm`` = ``vllm:v1``),
``bailian:minmax`` (blitz-router's min-max normalisation; ``bailian`` = ``bailian:max``).

The peers' own LMetric variants, ported from their sources (each module's docstring cites them):
``aibrix-lmetric`` (AIBrix ``l-metric-local``), ``llm-d-lmetric`` (llm-d's ``lmetric-scorer``, PR
#2351), ``dynamo-lmetric`` (Dynamo's ``--router-selection-policy lmetric``, PR #11028) and
``vllm-router-smetric`` (vllm-project/router's ``smetric``).
"""

DEFAULT_POLICY = "lmetric-time"
"""The policy every driver uses when none is named (``sim``, ``compare``, ``serve``, ``up``, the Ray
router, the main job): the one place that names it."""

DEFAULT_ROUTER_QUEUE = True
"""Whether the default runs behind the router-side queue (:mod:`kvroute.routing.queue`, its
``QueueConfig()`` defaults: TTL 30 s, no tick): ``kvroute sim``, ``serve``, ``up`` (and its config
file) and the Ray Serve router turn the queue on unless told not to (``--no-router-queue``,
``router_queue: false``). ``kvroute compare`` keeps each arm's queue explicit (an arm without the
`` +queue`` suffix runs without it); the default's arm there is
:data:`kvroute.sim.compare.DEFAULT_ARM`. The queue only holds a request back where the engines' limits
are known; without them it never does (see :func:`kvroute.routing.queue.saturated`)."""

PEER_LMETRICS = ("aibrix-lmetric", "llm-d-lmetric", "dynamo-lmetric", "vllm-router-smetric")
"""The peers' LMetric variants, in the order the comparisons list them."""


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
