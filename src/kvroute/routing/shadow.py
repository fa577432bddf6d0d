"""Shadow policies: what other policies would have chosen for the same request from the same views.

A :class:`Shadows` holds one :class:`~kvroute.routing.core.RoutingCore` per shadow policy, each with
its own policy object (its own round-robin counter, its own RNG) over the **same** KV view object as
the real core; :meth:`RoutingCore.route` only reads the KV view, so shadows never change what the real
policy sees or decides. Shadows run without production features (no quota, no hot-spot state).

For every real decision, each shadow's choice is compared with the real one on the real decision's
own terms (the same candidates, cached tokens, queued prefill and BS):

- ``agree``: the shadow chose the same instance;
- ``score_diff``: the LMetric load term P-token × (BS + 1) of the shadow's choice minus that of the
  real choice (token·requests; positive: the shadow's choice is busier by LMetric's measure);
- ``cached_diff``: predicted cached prompt tokens on the shadow's choice minus on the real choice
  (tokens; positive: the shadow would have reused more cache).

:class:`ShadowTally` accumulates these per shadow; the live router exports them on /metrics and
``kvroute sim --shadow`` writes :meth:`Shadows.summary` into its JSON, so live and simulated traffic
can be compared. Pure: no clock, no I/O; mutated only by :meth:`Shadows.observe`.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.errors import UserError
from kvroute.routing.core import Decision, RouteRequest, RoutingCore, build_policy
from kvroute.routing.kvview import KVView
from kvroute.views import InstanceView

__all__ = ["ShadowPick", "ShadowTally", "Shadows", "load_term", "parse_shadow_names"]


def load_term(decision: Decision, instance: int) -> int:
    """P-token × (BS + 1) of candidate ``instance`` in ``decision`` (LMetric's score, token·requests):
    P-token = prompt − cached + queued prefill; BS = running + waiting."""
    p = decision.instances.index(instance)
    p_token = decision.prompt_tokens - decision.cached_tokens[p] + decision.queued_prefill[p]
    return p_token * (decision.bs[p] + 1)


def parse_shadow_names(text: str | Iterable[str]) -> tuple[str, ...]:
    """Shadow policy names from ``"vllm,llm-d"`` (or a list), deduplicated in order; UserError for an
    unknown name (the registry's message) or an empty list."""
    from kvroute.policies.registry import make_policy

    items = text.split(",") if isinstance(text, str) else list(text)
    names: list[str] = []
    for raw in items:
        name = str(raw).strip()
        if name and name not in names:
            make_policy(name)  # UserError naming the valid policies
            names.append(name)
    if not names:
        raise UserError("--shadow needs at least one policy name, e.g. --shadow vllm,round-robin")
    return tuple(names)


@dataclass(frozen=True, slots=True)
class ShadowPick:
    """One shadow's choice for one request: ``instance`` (the KV view's backend index), ``agree``,
    ``score_diff`` (token·requests) and ``cached_diff`` (tokens), as in the module docstring."""

    name: str
    instance: int
    agree: bool
    score_diff: int
    cached_diff: int


class ShadowTally:
    """Running totals of one shadow's picks: ``decisions``, ``agreements``, and the sums of
    ``score_diff`` and ``cached_diff``."""

    __slots__ = ("agreements", "cached_diff_sum", "decisions", "score_diff_sum")

    def __init__(self) -> None:
        self.decisions = 0
        self.agreements = 0
        self.score_diff_sum = 0
        self.cached_diff_sum = 0

    def add(self, pick: ShadowPick) -> None:
        self.decisions += 1
        self.agreements += pick.agree
        self.score_diff_sum += pick.score_diff
        self.cached_diff_sum += pick.cached_diff

    def summary(self) -> dict[str, Any]:
        """``{"decisions", "agreement", "mean_score_diff", "mean_cached_diff"}`` (agreement in [0, 1];
        0.0 everywhere before the first decision)."""
        n = self.decisions or 1
        return {
            "decisions": self.decisions,
            "agreement": self.agreements / n,
            "mean_score_diff": self.score_diff_sum / n,
            "mean_cached_diff": self.cached_diff_sum / n,
        }


class Shadows:
    """Shadow policies over a KV view (module docstring). ``names``: registry policy names; ``rng``
    seeds each shadow's own RNG (one ``random.Random`` per shadow, drawn from ``rng``)."""

    def __init__(self, names: Sequence[str], kv: KVView, rng: random.Random | None = None) -> None:
        rng = rng or random.Random()
        self.names = tuple(names)
        self.cores = tuple(
            RoutingCore(build_policy(n, None, random.Random(rng.getrandbits(64))), kv) for n in self.names
        )
        self.tallies = {n: ShadowTally() for n in self.names}

    def observe(
        self, req: RouteRequest, views: Sequence[InstanceView], now: float, real: Decision
    ) -> tuple[ShadowPick, ...]:
        """Each shadow's choice for ``req`` among ``views`` at ``now``, compared with ``real`` (the
        real core's decision for the same request and views; a refused one is skipped: ``()``). Behind
        the router-side queue ``views`` are the ones the real policy saw (the queue's claims in them)
        and each shadow routes behind the queue too (``RequestView.gated``, as ``real``'s).
        Mutates the shadows' own policies and the tallies, never the KV view."""
        chosen = real.instance
        if chosen is None:
            return ()
        base_score = load_term(real, chosen)
        base_cached = real.cached_on(chosen)
        gated = real.view is not None and real.view.gated  # behind the router-side queue, as the real one
        picks = []
        for name, core in zip(self.names, self.cores, strict=True):
            inst = core.route(req, views, now, gated=gated).instance
            assert inst is not None  # shadows have no quota
            pick = ShadowPick(
                name,
                inst,
                inst == chosen,
                load_term(real, inst) - base_score,
                real.cached_on(inst) - base_cached,
            )
            self.tallies[name].add(pick)
            picks.append(pick)
        return tuple(picks)

    def summary(self) -> dict[str, dict[str, Any]]:
        """``{name: ShadowTally.summary()}``: what ``kvroute sim --shadow`` writes under ``"shadow"``."""
        return {n: t.summary() for n, t in self.tallies.items()}
