"""The routing core: request → token blocks → KV match → instance views → policy → ordered backends.

Membership (backends that come and go) changes here and only here: :meth:`RouterState.add_backend`,
:meth:`RouterState.drain_backend`, :meth:`RouterState.remove_backend`, :meth:`RouterState.update_backend`;
the policy and features are swapped with :meth:`RouterState.set_policy`. A backend's index (its KV view
bit, ``InstanceView.index``) is never reused in a process: a removed backend stays in ``backends``
with ``state == "removed"``. The server side (event subscribers, health checks, reconciling a desired
list) is :mod:`kvroute.server.sync.fleet`.

No sockets here: backends are reached through the :class:`~kvroute.server.wire.transport.Transport` given
to the proxy, and the clock is injected (``clock()`` returns monotonic seconds), so this runs the same
under tests and in production.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.blocks import extra_key, hash_blocks
from kvroute.chat_template import ChatTemplateError
from kvroute.features.classes import CLASS_HEADER, resolve_class
from kvroute.features.coldstart import Prefix
from kvroute.features.settings import FeatureConfig
from kvroute.policies.base import Policy
from kvroute.routing.core import Decision, RouteRequest, RoutingCore, with_features
from kvroute.routing.kvview import KVView
from kvroute.routing.shadow import ShadowPick, Shadows
from kvroute.server.state.backends import ACTIVE, DRAINING, REMOVED, BackendState
from kvroute.prepare.chainmemo import ChainMemo, Piece
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.state.pools import ModelPools
from kvroute.prepare.tokenize import Pending, RequestTokenizer
from kvroute.server.wire.validate import ApiError, ParsedRequest

__all__ = ["Plan", "QuotaExceeded", "RouterState", "RouterCounters"]

log = logging.getLogger("kvroute.server")


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


class RouterCounters:
    """Plain integer counters exported on the router's /metrics (cheaper than label lookups per request)."""

    __slots__ = (
        "cancelled",
        "client_errors",
        "drained",
        "ok",
        "rejected",
        "retries",
        "unavailable",
        "upstream_errors",
    )

    def __init__(self) -> None:
        self.ok = 0
        self.client_errors = 0  # 4xx from us (validation) or passed through from a backend
        self.upstream_errors = 0  # failures after the first byte, or non-retryable backend errors
        self.retries = 0
        self.cancelled = 0  # client went away
        self.rejected = 0  # validation errors (subset of client_errors)
        self.unavailable = 0  # 503: no backend could take it, or the router is shutting down
        self.drained = 0  # in flight when the shutdown's drain timed out: ended by the router


class RouterState:
    """Owns the backends' state, the KV view, the tokenizer and the policy. Not thread-safe: use from
    one event loop."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: RequestTokenizer,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
        table: LoadTable | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.policy = policy
        self.clock = clock
        # In-flight load: this process's table unless given one shared by the machine's workers.
        self.table = table if table is not None else LoadTable.local()
        self.backends = [BackendState(i, b.url, self.table) for i, b in enumerate(config.backends)]
        self.specs = list(config.backends)  # specs[i]: what backend i was added with (or updated to)
        self.kv = KVView(
            num_backends=len(self.backends),
            block_size=config.block_size,
            capacity_blocks=config.approx_capacity_blocks or 16384,
            ttl_s=config.approx_ttl_s,
            recovery_s=config.kv_recovery_s,
            exact_backends=frozenset(i for i, b in enumerate(config.backends) if b.kv_events),
        )
        # The routing core decides (kvroute.routing); this class gathers the views and the request.
        self.routing = RoutingCore(with_features(policy, config.features), self.kv)
        self.counters = RouterCounters()
        self.chains = ChainMemo(config.block_size, config.tokenizer_cache_entries)
        self.guard = self.routing.guard  # production features' state, when any is on
        # shadow policies over the same KV view (read-only there), each with its own state
        self.shadows = Shadows(config.shadow, self.kv) if config.shadow else None
        self._tags = {i: frozenset(b.tags) for i, b in enumerate(config.backends) if b.tags}
        self.pools = ModelPools()  # what each backend serves: a request's model picks its pool
        for i, b in enumerate(config.backends):
            self.pools.declare(i, b.models, b.lora_adapters)
        self.preloads: list[tuple[int, Prefix]] = []  # cold-start preloads for the monitor to send
        self._watch_cleared()

    def _watch_cleared(self) -> None:
        warm = self.guard is not None and self.guard.warmup is not None
        self.kv.on_cleared = self.backend_reset if warm else None

    # ---- membership -----------------------------------------------------------------------------

    def find(self, url: str) -> BackendState | None:
        """The backend with ``url`` that is not removed (at most one), or None."""
        for b in self.backends:
            if b.url == url and b.state != REMOVED:
                return b
        return None

    def add_backend(self, spec: BackendSpec, healthy: bool = False) -> BackendState:
        """A backend joins: a new index (never a reused one), an empty KV view (exact when
        ``spec.kv_events``), ``state == "active"``. ``healthy=False`` (the default at runtime): it
        takes no traffic until a health check admits it, and that admission starts its cold start
        (:meth:`backend_reset`, via the monitor); ``healthy=True``: admitted now, cold start now.
        Raises ValueError when a backend with that URL is already listed (active or draining)."""
        if self.find(spec.url) is not None:
            raise ValueError(f"backend {spec.url} is already listed")
        index = self.kv.add_backend(exact=spec.kv_events is not None)
        if index != len(self.backends):  # pragma: no cover - both grow together, only here
            raise RuntimeError(f"KV view index {index} != backend count {len(self.backends)}")
        state = BackendState(index, spec.url, self.table, healthy=healthy)
        self.backends.append(state)
        self.specs.append(spec)
        self._set_tags(index, spec)
        self.pools.declare(index, spec.models, spec.lora_adapters)
        if healthy:
            self.backend_reset(index)
        return state

    def update_backend(self, index: int, spec: BackendSpec) -> None:
        """Backend ``index`` is now described by ``spec`` (same URL): its tags, and its KV view mode
        when ``kv_events`` appeared or went (see :meth:`KVView.set_exact`). The event subscriber is the
        caller's (:mod:`kvroute.server.sync.fleet`)."""
        old = self.specs[index]
        if spec.url != old.url:
            raise ValueError(f"backend {index} is {old.url}, not {spec.url}")
        self.specs[index] = spec
        self._set_tags(index, spec)
        if (old.models, old.lora_adapters) != (spec.models, spec.lora_adapters):
            self.pools.declare(index, spec.models, spec.lora_adapters)
        self.kv.set_exact(index, spec.kv_events is not None, self.clock())

    def _set_tags(self, index: int, spec: BackendSpec) -> None:
        if spec.tags:
            self._tags[index] = frozenset(spec.tags)
        else:
            self._tags.pop(index, None)

    def drain_backend(self, index: int) -> None:
        """Backend ``index`` takes no new requests from now on (its requests in flight go on);
        :meth:`remove_backend` once it is idle (``BackendState.idle``). A removed one stays removed."""
        b = self.backends[index]
        if b.state == ACTIVE:
            b.state = DRAINING

    def reactivate_backend(self, index: int) -> bool:
        """A draining backend is wanted again: active again (its KV view was kept). True if it was
        draining."""
        b = self.backends[index]
        if b.state != DRAINING:
            return False
        b.state = ACTIVE
        return True

    def remove_backend(self, index: int) -> None:
        """Backend ``index`` is gone: ``state == "removed"``, its exact and approximate KV view
        entries are dropped; its index is never reused. Call it once the backend is idle (leases
        still out would otherwise count on its LoadTable slot, which a re-added URL reuses)."""
        b = self.backends[index]
        b.state = REMOVED
        b.healthy = False
        b.scraped = None
        self._tags.pop(index, None)
        self.pools.forget(index)
        self.kv.remove_backend(index)

    def live_backends(self) -> list[BackendState]:
        """Backends not removed (active and draining), by index."""
        return [b for b in self.backends if b.state != REMOVED]

    def set_policy(self, name: str, policy: Policy, features: FeatureConfig | None) -> None:
        """Route with ``policy`` (the registry's ``name``) wrapped with ``features`` from now on (SIGHUP reload). The KV view,
        the backends and their in-flight counters stay; the features' state (warm-ups, hot-spot
        alarms, quotas) starts afresh. Mutates ``policy``, ``routing``, ``guard``, ``config``."""
        routing = RoutingCore(with_features(policy, features), self.kv)  # UserError: nothing changed
        self.policy = policy
        self.routing = routing
        self.guard = self.routing.guard
        self.config = dataclasses.replace(self.config, policy=name, features=features)
        self._watch_cleared()

    @property
    def defer_tokenize(self) -> bool:
        """Route before tokenizing new text (``config.tokenize == "defer"``, features off)."""
        return self.config.tokenize == "defer" and self.guard is None

    def split(self, req: ParsedRequest) -> Pending:
        """The prompt split at its first uncached piece (400 for content the tokenizer rejects)."""
        try:
            if req.chat:
                assert req.messages is not None
                return self.tokenizer.split_chat(req.messages, options=req.chat_options)
            assert req.prompt is not None
            return self.tokenizer.split_prompt(req.prompt)
        except ChatTemplateError as exc:  # the template's own message (raise_exception)
            raise ApiError(400, exc.message, "messages") from None
        except (TypeError, ValueError, KeyError) as exc:
            raise ApiError(400, f"cannot tokenize the request: {exc}") from None

    def extra_key(self, req: ParsedRequest) -> str | bytes | None:
        """The extra key of ``req``'s blocks: its LoRA adapter (when its model is one) and its
        ``cache_salt`` (:func:`kvroute.blocks.extra_key`)."""
        adapter = req.model if self.pools.is_adapter(req.model) else None
        return extra_key(adapter, req.cache_salt)

    def tokens(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids (400 for content the tokenizer rejects)."""
        return self.tokenizer.finish(self.split(req))

    def hashed(
        self, pieces: Sequence[Piece], suffix: Sequence[int], salt: str | bytes | None
    ) -> tuple[list[int], tuple[int, ...]]:
        """The prompt's token ids and block chain from its pieces (see :mod:`.chainmemo`); 400 for
        token ids outside [0, 2**32)."""
        ids: list[int] = []
        for _, part in pieces:
            ids.extend(part)
        ids.extend(suffix)
        try:
            return ids, tuple(self.chains.chain(pieces, suffix, salt))
        except ValueError as exc:
            raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None

    def plan(
        self,
        req: ParsedRequest,
        ids: Sequence[int] | None = None,
        headers: Mapping[str, str] | None = None,
        tail_tokens: int = 0,
        hashes: Sequence[int] | None = None,
    ) -> Plan:
        """Route ``req`` through the routing core (``ids``: its token ids when already computed, e.g.
        on a worker thread, or only their known leading part, followed by about ``tail_tokens`` more:
        then the chain covers the known part and the prompt length is estimated; ``headers``: the
        client's, for the class header and the API key). Raises ApiError(503) when no backend is
        healthy, 400 for untokenizable input or an unknown request class, QuotaExceeded (429) over
        quota, 404 for a model no backend serves. ``hashes``: the block hashes of ``ids`` when already
        computed (:meth:`hashed`). Candidates: the healthy active backends of ``req.model``'s pool."""
        candidates = [b for b in self.backends if b.healthy and b.state == ACTIVE]
        if not candidates:
            raise ApiError(503, "no healthy backend", etype="service_unavailable")
        if self.pools.known and req.model is not None:
            candidates = self.pools.select(req.model, self.live_backends(), candidates)
        if ids is None:
            ids = self.tokens(req)
        if hashes is not None:
            chain = tuple(hashes)
        else:
            try:
                chain = tuple(hash_blocks(ids, self.config.block_size, extra_key=self.extra_key(req)))
            except ValueError as exc:
                raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None
        now = self.clock()
        stale = self.config.scrape_stale_s
        views = [b.view(now, stale) for b in candidates]
        if self._tags:
            tags = self._tags
            views = [dataclasses.replace(v, tags=tags[v.index]) if v.index in tags else v for v in views]
        rr = self._request(req, headers or {}, ids, chain, len(ids) + tail_tokens)
        decision = self.routing.route(rr, views, now)
        if self.guard is not None:
            self.drain_log()
        if decision.instance is None:  # refused by the token quota
            wait = decision.retry_after_s
            who = "this API key" if rr.quota_key is not None and rr.quota_key != req.user else "this user"
            raise QuotaExceeded(
                f"token quota exceeded for {who}; retry in {wait:.1f} s", max(1, math.ceil(wait)), decision
            )
        shadows = self.shadows
        picks = shadows.observe(rr, views, now, decision) if shadows is not None else ()
        bs = self.config.block_size
        return Plan(
            order=decision.order,
            chain=chain,
            prompt_tokens=rr.prompt_tokens,
            new_prefill={
                i: rr.prompt_tokens - c
                for i, c in zip(decision.instances, decision.cached_tokens, strict=True)
            },
            cached_blocks={
                i: c // bs for i, c in zip(decision.instances, decision.cached_tokens, strict=True)
            },
            decision=decision,
            shadow=picks,
        )

    def _request(
        self,
        req: ParsedRequest,
        headers: Mapping[str, str],
        ids: Sequence[int],
        chain: tuple[int, ...],
        prompt_tokens: int,
    ) -> RouteRequest:
        """The core's view of ``req``: request class from the header (400 for an unknown one) and the
        quota key (API key or user, as the quota feature says)."""
        guard = self.guard
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
            chain=chain,
            prompt_tokens=prompt_tokens,
            max_tokens=req.max_tokens,
            user=req.user,
            req_class=req_class,
            quota_key=quota_key,
            model=req.model,
            # salted or adapter chains cannot be preloaded as plain prompts
            token_ids=ids if self.extra_key(req) is None else None,
        )

    def backend_reset(self, index: int) -> None:
        """Backend ``index`` restarted, was re-admitted or cleared its cache: with cold start on it
        warms up, and the frequent prefixes are queued in ``preloads``."""
        if self.guard is None:
            return
        self.preloads.extend((index, p) for p in self.guard.instance_reset(index, self.clock()))
        self.drain_log()

    def take_preloads(self) -> list[tuple[int, Prefix]]:
        out, self.preloads = self.preloads, []
        return out

    def drain_log(self) -> None:
        """Write what the features noticed (alarms, alerts, warm-ups) to the log."""
        guard = self.guard
        if guard is not None:
            while guard.log:
                log.warning("%s", guard.log.popleft())
