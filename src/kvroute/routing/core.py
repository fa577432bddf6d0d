"""The routing step: a request, the instance views, the KV view and the time → a :class:`Decision`.

This is the only place where kvroute decides where a request goes. The live router (its decide
stage, :mod:`kvroute.server.stages.decide`), the simulator (:mod:`kvroute.sim.cluster`), ``validate``
(:mod:`kvroute.sim.validate`) and adapters build a :class:`RoutingCore` and call :meth:`RoutingCore.route`;
they gather the views and carry the decision out, nothing more.

One decision, in order:

1. **Quota** (feature ``quota``): a request over its token bucket is refused
   (``Decision.instance is None``, ``reason == "quota"``, ``retry_after_s`` > 0).
2. **Prefix class** (features ``hotspot`` / ``cold_start``): the request's first blocks are counted.
3. **KV match**: one walk of the request's block chain over the KV view (:class:`KVView`) gives the
   cached prefix on every candidate, capped at ``(prompt_tokens − 1) // block_size`` blocks: the engine
   always computes at least one prompt token (vLLM does the same), so P-token is never below 1 and
   fully cached candidates are still ordered by their load. An engine whose block size is not the
   router's (learned per backend, :meth:`KVView.cached_tokens`) hits whole engine blocks only: its
   cached prefix is cut down to them, as vLLM counts ``cached_tokens``.
4. **Policy** (any registry policy, wrapped by :class:`~kvroute.routing.guarded.Guarded` when features
   are on): the choice, every candidate's score, and the reason.

Units: tokens and blocks as named; times in seconds on the driver's clock (never read here).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvroute.features.settings import FeatureConfig
from kvroute.policies.base import Policy, Tracking
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.routing.kvview import KVView
from kvroute.views import Choice, Hold, InstanceView, RequestView

__all__ = ["REASONS", "Candidate", "Decision", "RouteRequest", "RoutingCore", "build_policy", "with_features"]

REASONS = ("policy", "hotspot", "cold_start_cap", "limits", "quota", "queue_ttl")
"""Why the chosen instance won: the policy's score, hot-spot mitigation, the BS cap of warming
instances or a limit (P-token cap, spot exclusion) narrowing the candidates; or why none did: a quota
refusal, or a wait in the router-side queue past its TTL (:mod:`kvroute.routing.queue`)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the core needs of a request.

    - ``chain``: block hashes of the prompt's full blocks (the KV view's hashes; may cover only a known
      leading part of the prompt when ``prompt_tokens`` is an estimate).
    - ``prompt_tokens``: prompt length, tokens. ``max_tokens``: expected output tokens (0: unknown).
    - ``user``, ``req_class``: who sent it and its latency class; ``quota_key``: whose token bucket
      pays for it (``None``: the shared anonymous bucket).
    - ``model``, ``token_ids``: carried into cold-start preloads (``token_ids`` only when the chain
      can be rebuilt from them, i.e. no cache salt).
    """

    chain: tuple[int, ...]
    prompt_tokens: int
    max_tokens: int = 0
    user: str | None = None
    req_class: str = "default"
    quota_key: str | None = None
    model: str | None = None
    token_ids: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class Candidate:
    """One candidate's terms in a decision (tokens; ``bs`` in requests; ``score`` in the policy's units)."""

    instance: int
    cached_tokens: int
    p_token: int
    queued_prefill_tokens: int
    bs: int
    score: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The core's answer for one request.

    - ``instance``: the chosen ``InstanceView.index`` (``None``: refused, see ``reason``).
    - ``instances``, ``cached_tokens``, ``queued_prefill``, ``bs``, ``scores``: one entry per candidate,
      in the order the views were given (columns; :attr:`candidates` turns them into rows).
    - ``reason``: one of :data:`REASONS`; ``policy``: the (feature-wrapped) policy's name;
      ``lower_is_better``: the direction of ``scores``.
    - ``prompt_tokens``; ``retry_after_s``: with ``reason == "quota"``, seconds until it would pass.
    - ``choice``: the policy's raw :class:`~kvroute.views.Choice` (its ``detail`` names its own terms).
    - ``queued_s``: seconds the request waited in the router-side queue before this decision went
      out (0: it never waited); with ``reason == "queue_ttl"`` the wait that expired.
    - ``view``: the request view the policy chose with (``None`` when refused); the driver gives it
      back through :meth:`RoutingCore.dispatched`.
    """

    instance: int | None
    instances: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    queued_prefill: tuple[int, ...]
    bs: tuple[int, ...]
    scores: tuple[float, ...]
    reason: str
    policy: str
    prompt_tokens: int
    lower_is_better: bool = True
    retry_after_s: float = 0.0
    choice: Choice | None = None
    queued_s: float = 0.0
    view: RequestView | None = field(default=None, compare=False, repr=False)

    @property
    def order(self) -> tuple[int, ...]:
        """Instance indices best first: the chosen one, then the others by score (stable on ties); the
        retry order. Empty when refused."""
        if self.instance is None:
            return ()
        sign = 1.0 if self.lower_is_better else -1.0
        scores, indices = self.scores, self.instances
        first = indices.index(self.instance)
        rest = sorted((p for p in range(len(indices)) if p != first), key=lambda p: sign * scores[p])
        return (self.instance, *(indices[p] for p in rest))

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        """Every candidate's terms as rows (built on demand: the request path reads the columns)."""
        prompt = self.prompt_tokens
        return tuple(
            Candidate(i, c, prompt - c + q, q, b, s)
            for i, c, q, b, s in zip(
                self.instances, self.cached_tokens, self.queued_prefill, self.bs, self.scores, strict=True
            )
        )

    def cached_on(self, instance: int) -> int:
        """Predicted cached prompt tokens on ``instance`` (0 if it was not a candidate)."""
        try:
            return self.cached_tokens[self.instances.index(instance)]
        except ValueError:
            return 0

    def new_prefill(self, instance: int) -> int:
        """Prompt tokens ``instance`` would still compute (``prompt_tokens`` − cached)."""
        return self.prompt_tokens - self.cached_on(instance)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able explanation: winner, reason and every candidate's terms."""
        return {
            "instance": self.instance,
            "reason": self.reason,
            "policy": self.policy,
            "prompt_tokens": self.prompt_tokens,
            "order": list(self.order),
            **({"queued_s": round(self.queued_s, 6)} if self.queued_s else {}),
            "candidates": [
                {
                    "instance": c.instance,
                    "cached_tokens": c.cached_tokens,
                    "p_token": c.p_token,
                    "queued_prefill_tokens": c.queued_prefill_tokens,
                    "bs": c.bs,
                    "score": c.score,
                }
                for c in self.candidates
            ],
        }


def with_features(policy: Policy, features: FeatureConfig | None) -> Policy:
    """``policy`` wrapped with ``features`` when any is on, else ``policy`` itself (UserError for a
    bad setting or combination)."""
    return Guarded(policy, features) if features is not None and features.any else policy


def build_policy(name: str, features: FeatureConfig | None, rng: random.Random | None = None) -> Policy:
    """The registry policy ``name`` wrapped with ``features`` (UserError for a bad name or setting).
    Every driver builds its policy here."""
    return with_features(make_policy(name, rng), features)


class RoutingCore:
    """The one decision path (module docstring). Owns the KV view; holds the policy (and through it
    the features' state). Mutated by :meth:`route` (features' state, the policy's own state) and by the
    KV view's feeds; single-threaded (one owner per core)."""

    def __init__(self, policy: Policy, kv: KVView) -> None:
        self.policy = policy
        self.guard = policy if isinstance(policy, Guarded) else None
        inner = self.guard.inner if self.guard is not None else policy
        self._tracking: Tracking | None = inner if isinstance(inner, Tracking) else None
        self.kv = kv
        self.block_size = kv.block_size

    @property
    def name(self) -> str:
        return self.policy.name

    def route(
        self,
        req: RouteRequest,
        views: Sequence[InstanceView],
        now: float,
        charge: bool = True,
        gated: bool = False,
    ) -> Decision:
        """Decide where ``req`` goes among ``views`` (non-empty; their ``index`` is the KV view's
        backend id) at ``now`` (seconds). Mutates the features' and policy's state, not the KV view
        (the driver records where the request went with :meth:`KVView.on_routed`). ``charge``
        False: the request's quota was charged by an earlier call (the router-side queue routes a
        waiting request again; :mod:`kvroute.routing.queue`). ``gated``: routed behind the router-side
        queue (``RequestView.gated``; the queue's route callback in every driver says so)."""
        guard = self.guard
        bs = self.block_size
        prompt = req.prompt_tokens
        key = 0
        if guard is not None:
            wait = guard.quota_wait(req.quota_key, prompt + req.max_tokens, now) if charge else 0.0
            if wait:
                return self._refused(req, views, wait)
            key = guard.note(req.chain, bs, now, req.token_ids, req.model)
        kv = self.kv
        matched = kv.match(req.chain, now)
        if kv.engine_blocks:
            cached = tuple([kv.cached_tokens(v.index, matched[v.index], prompt) for v in views])
        else:  # every engine's block size is the router's (the common case: no per-backend lookup)
            cap = (prompt - 1) // bs if prompt > 0 else 0
            cached = tuple([(m if m < cap else cap) * bs for m in (matched[v.index] for v in views)])
        rv = RequestView(
            prompt_tokens=prompt,
            cached_tokens=cached,
            num_blocks=len(req.chain),
            block_size=bs,
            max_tokens=req.max_tokens,
            user=req.user,
            req_class=req.req_class,
            prefix_key=key,
            now=now,
            chain=req.chain,
            gated=gated,
        )
        choice = self.policy.choose(rv, views)
        indices = tuple([v.index for v in views])
        return Decision(
            instance=indices[choice.choice],
            instances=indices,
            cached_tokens=cached,
            queued_prefill=tuple([v.queued_prefill_tokens for v in views]),
            bs=tuple([v.running + v.waiting for v in views]),
            scores=choice.scores,
            reason=choice.reason,
            policy=choice.policy,
            prompt_tokens=prompt,
            lower_is_better=choice.lower_is_better,
            choice=choice,
            view=rv,
        )

    def dispatched(self, decision: Decision, instance: int, now: float) -> Hold | None:
        """The request of ``decision`` was sent to ``instance`` (an ``InstanceView.index``; a retry
        may send it elsewhere than ``decision.instance``) at ``now`` (seconds): a policy that keeps its
        own bookkeeping (:class:`~kvroute.policies.base.Tracking`, the peers' LMetric variants) books
        it and returns the :class:`~kvroute.views.Hold` the driver ends; ``None`` for every other
        policy (nothing to call). Every driver calls it when it sends a request."""
        target = self._tracking
        view = decision.view
        if target is None or view is None or instance not in decision.instances:
            return None
        return target.dispatched(view, decision.instances.index(instance), instance, now)

    def expired(
        self, req: RouteRequest, views: Sequence[InstanceView], waited_s: float, retry_s: float
    ) -> Decision:
        """The decision record of ``req`` dropped from the router-side queue after ``waited_s``
        seconds (reason ``queue_ttl``; ``retry_after_s`` = ``retry_s``)."""
        return replace(self._refused(req, views, retry_s), reason="queue_ttl", queued_s=waited_s)

    def _refused(self, req: RouteRequest, views: Sequence[InstanceView], wait: float) -> Decision:
        n = len(views)
        return Decision(
            instance=None,
            instances=tuple(v.index for v in views),
            cached_tokens=(0,) * n,
            queued_prefill=tuple(v.queued_prefill_tokens for v in views),
            bs=tuple(v.running + v.waiting for v in views),
            scores=(0.0,) * n,
            reason="quota",
            policy=self.policy.name,
            prompt_tokens=req.prompt_tokens,
            retry_after_s=wait,
        )
