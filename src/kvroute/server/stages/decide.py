"""The decide stage: a prepared request → a frozen :class:`Plan`, through the routing core.

This stage gathers what :class:`~kvroute.routing.core.RoutingCore` needs (the candidates' instance
views, the request's class and quota key) and turns its :class:`~kvroute.routing.core.Decision`
into the plan the later stages follow. It decides nothing itself. It reads the router's state and
mutates only the core's feature state (and the shadow policies'). With the router-side queue on, a
request waits between this stage and the reserve stage (:mod:`.wait`), routed again by it from the
views of the moment it goes out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from kvroute.features.classes import CLASS_HEADER, resolve_class
from kvroute.routing.core import Decision, RouteRequest
from kvroute.routing.shadow import ShadowPick
from kvroute.server.stages.prepare import Prepared
from kvroute.server.state.backends import ACTIVE
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import ApiError, ParsedRequest
from kvroute.views import InstanceView

__all__ = ["Plan", "QuotaExceeded", "candidate_views", "decide", "plan_of", "route_request"]


class QuotaExceeded(ApiError):
    """429: the request's user / API key is over its token quota; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int, decision: Decision | None = None) -> None:
        super().__init__(429, message, etype="rate_limit_exceeded")
        self.retry_after = retry_after
        self.decision = decision  # the core's refusal (reason "quota"), for the decision log


@dataclass(frozen=True, slots=True)
class Plan:
    """A routing decision: ``order`` lists backend indices, best first (the retry order);
    ``new_prefill[i]`` is the uncached prompt tokens if sent to backend ``i`` (tokens); ``chain`` the
    prompt's block hashes; ``cached_blocks[i]`` the predicted cached prefix on backend ``i`` (blocks);
    ``shadow``: the shadow policies' choices for the same request (``config.shadow``)."""

    order: tuple[int, ...]
    chain: tuple[int, ...]
    prompt_tokens: int
    new_prefill: dict[int, int]
    cached_blocks: dict[int, int]
    decision: Decision
    shadow: tuple[ShadowPick, ...] = ()


def decide(
    state: RouterState,
    req: ParsedRequest,
    prep: Prepared,
    headers: Mapping[str, str] | None = None,
    only: Collection[int] | None = None,
) -> Plan:
    """Route ``req`` (tokens and chain in ``prep``; ``headers``: the client's, for the class header
    and the API key) through the routing core. Candidates: the healthy active backends of
    ``req.model``'s pool (``only``: of these backend indices, e.g. a gateway's subset hint). Raises
    ApiError(503) when no backend is healthy, 400 for an unknown request class, QuotaExceeded (429)
    over quota, 404 for a model no backend serves."""
    now = state.clock()
    views = candidate_views(state, req.model, now, only)
    rr = route_request(state, req, headers or {}, prep)
    return plan_of(state, rr, prep, views, state.routing.route(rr, views, now), now)


def candidate_views(
    state: RouterState, model: str | None, now: float, only: Collection[int] | None = None
) -> list[InstanceView]:
    """The instance views of ``model``'s candidates (the healthy active backends of its pool, among
    the backend indices ``only`` when given) at ``now``; ApiError(503) when no backend is healthy,
    404 for a model no backend serves."""
    candidates = [
        b for b in state.backends if b.healthy and b.state == ACTIVE and (only is None or b.index in only)
    ]
    if not candidates:
        raise ApiError(503, "no healthy backend", etype="service_unavailable")
    if state.pools.known and model is not None:
        candidates = state.pools.select(model, state.live_backends(), candidates)
    stale = state.config.scrape_stale_s
    limits = state.config.engine_limits
    views = [b.view(now, stale, state.config.block_size) for b in candidates]
    if limits != (0, 0):
        tokens, seqs = limits
        views = [dataclasses.replace(v, max_batched_tokens=tokens, max_num_seqs=seqs) for v in views]
    tags = state.tags
    if tags:
        views = [dataclasses.replace(v, tags=tags[v.index]) if v.index in tags else v for v in views]
    return views


def plan_of(
    state: RouterState,
    rr: RouteRequest,
    prep: Prepared,
    views: Sequence[InstanceView],
    decision: Decision,
    now: float,
) -> Plan:
    """The plan of ``decision`` (made among ``views`` at ``now``); QuotaExceeded for a refusal."""
    if state.guard is not None:
        state.drain_log()
    if decision.instance is None:  # refused by the token quota
        wait = decision.retry_after_s
        who = "this API key" if rr.quota_key is not None and rr.quota_key != rr.user else "this user"
        raise QuotaExceeded(
            f"token quota exceeded for {who}; retry in {wait:.1f} s", max(1, math.ceil(wait)), decision
        )
    shadows = state.shadows
    picks = shadows.observe(rr, views, now, decision) if shadows is not None else ()
    bs = state.config.block_size
    return Plan(
        order=decision.order,
        chain=prep.chain,
        prompt_tokens=rr.prompt_tokens,
        new_prefill={
            i: rr.prompt_tokens - c for i, c in zip(decision.instances, decision.cached_tokens, strict=True)
        },
        cached_blocks={i: c // bs for i, c in zip(decision.instances, decision.cached_tokens, strict=True)},
        decision=decision,
        shadow=picks,
    )


def route_request(
    state: RouterState, req: ParsedRequest, headers: Mapping[str, str], prep: Prepared
) -> RouteRequest:
    """The core's view of ``req``: request class from the header (400 for an unknown one) and the
    quota key (API key or user, as the quota feature says)."""
    guard = state.guard
    req_class = "default"
    quota_key = None
    if guard is not None:
        feats = guard.features
        if feats.quota is not None:
            auth = headers.get("Authorization") or headers.get("authorization") or ""
            api_key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            quota_key = (api_key or req.user) if feats.quota.key == "api_key" else (req.user or api_key)
        if feats.classes is not None:
            try:
                req_class = resolve_class(headers.get(CLASS_HEADER), req.user, req.model, feats.classes)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
    return RouteRequest(
        chain=prep.chain,
        prompt_tokens=prep.prompt_tokens,
        max_tokens=req.max_tokens,
        user=req.user,
        req_class=req_class,
        quota_key=quota_key,
        model=req.model,
        # salted or adapter chains cannot be preloaded as plain prompts
        token_ids=prep.ids if prep.key is None else None,
    )
