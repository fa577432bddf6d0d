"""The router's state: its backends and their membership, the KV view, the routing core and the
request preparation's caches (tokenizer, chain memo), and the plain request counters.

Membership (backends that come and go) changes here and only here: :meth:`RouterState.add_backend`,
:meth:`RouterState.drain_backend`, :meth:`RouterState.remove_backend`,
:meth:`RouterState.update_backend`; the policy and features are swapped with
:meth:`RouterState.set_policy`. A backend's index (its KV view bit, ``InstanceView.index``) is never
reused in a process: a removed backend stays in ``backends`` with ``state == "removed"``. The server
side (event subscribers, health checks, reconciling a desired list) is :mod:`kvroute.server.sync.fleet`;
the request's stages that read this state are :mod:`kvroute.server.stages`.

Not the routing core (:class:`~kvroute.routing.core.RoutingCore`, which decides): this holds it.
No sockets here, and the clock is injected (``clock()`` returns monotonic seconds), so this runs the
same under tests and in production.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from kvroute.features.coldstart import Prefix
from kvroute.features.settings import FeatureConfig
from kvroute.policies.base import Policy
from kvroute.prepare.chainmemo import ChainMemo
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.core import RoutingCore, with_features
from kvroute.routing.kvview import KVView
from kvroute.routing.shadow import Shadows
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.state.backends import ACTIVE, DRAINING, REMOVED, BackendState
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.state.pools import ModelPools

__all__ = ["RouterCounters", "RouterState"]

log = logging.getLogger("kvroute.server")


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
        self.kv.on_engine_block_size = self._engine_block_size
        # The routing core decides (kvroute.routing); this class gathers the views and the request.
        self.routing = RoutingCore(with_features(policy, config.features), self.kv)
        self.counters = RouterCounters()
        self.chains = ChainMemo(
            config.block_size, config.tokenizer_cache_entries, config.tokenizer_cache_tokens
        )
        self.guard = self.routing.guard  # production features' state, when any is on
        # shadow policies over the same KV view (read-only there), each with its own state
        self.shadows = Shadows(config.shadow, self.kv) if config.shadow else None
        self.tags = {i: frozenset(b.tags) for i, b in enumerate(config.backends) if b.tags}
        self.pools = ModelPools()  # what each backend serves: a request's model picks its pool
        for i, b in enumerate(config.backends):
            self.pools.declare(i, b.models, b.lora_adapters)
        self.preloads: list[tuple[int, Prefix]] = []  # cold-start preloads for the monitor to send
        self._watch_cleared()

    def _engine_block_size(self, backend: int, tokens: int) -> None:
        """The KV view learned ``backend``'s engine block size: one log line when it is not the
        router's own (predicted hits then count whole engine blocks)."""
        if tokens != self.config.block_size and backend < len(self.backends):
            log.warning(
                "backend %s caches in blocks of %d tokens, the router's --block-size is %d: "
                "predicted cached tokens count whole engine blocks (set --block-size %d to match)",
                self.backends[backend].url,
                tokens,
                self.config.block_size,
                tokens,
            )

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
            self.tags[index] = frozenset(spec.tags)
        else:
            self.tags.pop(index, None)

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
        self.tags.pop(index, None)
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
