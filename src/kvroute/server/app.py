"""The router server: aiohttp app wiring, lifecycle, /v1/models, /health, /metrics.

:class:`RouterServer` is what ``kvroute serve``/``kvroute up`` and the tests run: ``await start()``
binds the port (0 → a free one) and starts the background loops; ``await stop()`` undoes all of it;
``await shutdown()`` drains first (what SIGTERM does, see :meth:`RouterServer.shutdown`).

Backends that come and go: :meth:`RouterServer.reconcile` (a desired list, see
:mod:`kvroute.server.sync.fleet`), :meth:`RouterServer.apply_config` (a SIGHUP reload), the admin API
(:mod:`kvroute.server.sync.admin`, only with ``config.admin_token``) and discovery
(:mod:`kvroute.server.sync.discovery`, ``config.discover``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvroute.policies.registry import make_policy
from kvroute.prepare.events import EventSubscriber
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.server.config import RELOADABLE, BackendSpec, RouterConfig
from kvroute.server.observe.dashboard import add_dashboard_routes
from kvroute.server.observe.debug import add_debug_routes
from kvroute.server.observe.exporter import RouterCollector, StrayCollector, render_metrics
from kvroute.server.observe.feature_metrics import FeatureCollector
from kvroute.server.observe.observer import Observer
from kvroute.server.observe.recording import TrafficRecording
from kvroute.server.pipeline import Proxy
from kvroute.server.state.backends import ACTIVE
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.state.router import RouterState
from kvroute.server.sync.admin import add_admin_routes, apply_journal_line
from kvroute.server.sync.discovery import Discovery, ParseBackends, Resolver
from kvroute.server.sync.fleet import STATIC, Changes, Fleet
from kvroute.server.sync.journal import AdminJournal
from kvroute.server.sync.monitor import Monitor
from kvroute.server.sync.peers import PeerCollector, PeerLink, PeerSettings
from kvroute.server.sync.scrape import Scraper, ScraperCollector, ScrapeSchedule
from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.http import error_response, expect_continue_within
from kvroute.server.wire.httperrors import RateLimitedLog, json_errors
from kvroute.server.wire.limits import ClientLimits, LimitedRunner
from kvroute.server.wire.pruning import pruner
from kvroute.server.wire.transport import Transport, UpstreamError
from kvroute.server.wire.validate import ApiError
from kvroute.tokenizer import Tokenizer, load_tokenizer

__all__ = ["RouterServer"]

log = logging.getLogger("kvroute.server")

_ABORT_WAIT_S = 5.0
"""Seconds a shutdown waits for the requests it ended to write their last bytes."""


SYNC_WAIT_S = 1.5
"""At start, how long (seconds) the router waits for its engines' KV event replays (asked for on
subscribe) before it returns from :meth:`RouterServer.start`; an engine that does not answer by then
is routed approximately until its replay or its events arrive."""


def client_limits(cfg: RouterConfig) -> ClientLimits:
    """The limits on the router's client connections, from its config."""
    return ClientLimits(
        cfg.max_connections,
        cfg.header_timeout_s,
        cfg.body_timeout_s,
        cfg.keepalive_timeout_s,
        cfg.write_timeout_s,
        cfg.retry_after_s,
    )


class RouterServer:
    """One router: config → app, loops, subscribers. ``transport``/``tokenizer`` may be injected
    (tests); by default :class:`~kvroute.server.wire.h1.H1Transport` and the configured tokenizer are used.
    ``resolve`` (DNS lookups) and ``parse_backends`` (a watched file's reader) go to discovery.
    ``table``: the in-flight load table (a worker's view of the machine's shared one, see
    :mod:`kvroute.server.workers`); by default one of this process alone. ``peer_replica``,
    ``peer_worker``, ``peer_receive``: a ``--workers`` worker publishes its reservations under the
    machine's replica id and leaves receiving the other replicas' to its supervisor;
    ``admin_journal``: the file through which the workers share admin changes."""

    def __init__(
        self,
        config: RouterConfig,
        transport: Transport | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
        resolve: Resolver | None = None,
        parse_backends: ParseBackends | None = None,
        table: LoadTable | None = None,
        reuse_port: bool = False,
        peer_replica: str | None = None,
        peer_worker: int = 0,
        peer_receive: bool = True,
        admin_journal: str | None = None,
        tracer_provider: Any = None,
    ) -> None:
        config.validate()
        self.config = config
        self.transport: Transport = transport or H1Transport(
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.upstream_timeout_s,
            keepalive_s=config.upstream_keepalive_s,
            clock=clock,
        )
        tok = tokenizer or load_tokenizer(config.tokenizer, chat_template=config.chat_template)
        self.state = RouterState(
            config,
            RequestTokenizer(tok, config.tokenizer_cache_entries, config.tokenizer_cache_tokens),
            make_policy(config.policy),
            clock,
            table,
        )
        self.reuse_port = (
            reuse_port  # SO_REUSEPORT: the workers of `kvroute serve --workers N` share the port
        )
        self.registry = CollectorRegistry(auto_describe=True)
        # decisions, latency histograms, access log, traces (tracer_provider: tests; else --otel's)
        self.observer = Observer(self.state, self.registry, tracer_provider)
        recording = TrafficRecording(config.record, config.block_size) if config.record else None
        self.proxy = Proxy(self.state, self.transport, self.observer, recording)
        self.monitor = Monitor(self.state, self.transport)
        self.scraper = Scraper(
            self.state,
            self.monitor,
            ScrapeSchedule.of(self.config.scrape_interval_s, self.config.scrape_idle_interval_s),
        )
        self.background = background
        self.subscribers: list[EventSubscriber] = []  # live KV event subscribers (the fleet's)
        # a removed backend's pooled connections are closed (the default transport keeps a pool per URL)
        self.fleet = Fleet(self.state, self.monitor, self.subscribers, pruner(self.transport))
        self.discovery = Discovery(config, self.fleet, resolve, parse_backends)
        self._tasks: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self.draining = False  # shutting down: /health answers 503
        self.registry.register(RouterCollector(self.state, self.subscribers, self.proxy))
        self.registry.register(StrayCollector(self.transport))
        self.registry.register(ScraperCollector(self.scraper))
        self._features: FeatureCollector | None = None
        self._register_features()
        self._preloading: asyncio.Task[None] | None = None
        self.peers = self._make_peers(peer_replica, peer_worker, peer_receive)
        # --workers: admin changes made on a sibling worker (kvroute.server.sync.journal), replayed here
        self.journal = AdminJournal(admin_journal) if admin_journal is not None else None
        self.url = ""
        self.bad_requests = RateLimitedLog()  # one line a second per kind of bad request (wire.httperrors)

    def _register_features(self) -> None:
        """(Re-)register the production features' collector for the current guard, if any."""
        if self._features is not None:
            self.registry.unregister(self._features)
            self._features = None
        core = self.state
        if core.guard is not None:  # production features: alarms, score histogram, warming
            labels = lambda: [(b.index, b.url) for b in core.live_backends()]  # noqa: E731
            self._features = FeatureCollector(core.guard, labels, core.clock)
            self.registry.register(self._features)

    def _make_peers(self, replica: str | None, worker: int, receive: bool) -> PeerLink | None:
        """Router replicas (``peer_bind``/``peers``): this one's publisher and, with ``receive``, its
        receiver (a ``--workers`` worker publishes under the machine's ``replica`` id as ``worker``;
        its supervisor receives)."""
        cfg = self.config
        if cfg.peer_bind is None and not cfg.peers:
            return None
        bind = cfg.peer_bind if receive else None
        settings = PeerSettings(bind, cfg.peers, cfg.peer_expiry_s, cfg.peer_refresh_s)
        link = PeerLink(settings, self.state.table, self.state.clock, replica, worker)
        self.registry.register(
            PeerCollector(link, lambda: [(b.url, b.slot) for b in self.state.live_backends()])
        )
        return link

    def make_app(self) -> web.Application:
        # The body limit is enforced by the proxy (OpenAI-style 413), so aiohttp's own is lifted.
        expect_ok = expect_continue_within(self.config.max_body_bytes)
        app = web.Application(
            client_max_size=self.config.max_body_bytes + 1, middlewares=[json_errors(self.bad_requests)]
        )
        app.router.add_post("/v1/completions", self.proxy.completions, expect_handler=expect_ok)
        app.router.add_post("/v1/chat/completions", self.proxy.chat_completions, expect_handler=expect_ok)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/livez", self.livez)
        app.router.add_get("/metrics", self.metrics)
        if self.config.admin_token is not None:
            add_admin_routes(app, self.fleet, self.config.admin_token, self.journal)
            add_debug_routes(app, self.state, self.observer.log, self.config.admin_token)
            add_dashboard_routes(app, self.observer, self.config.admin_token)
        return app

    async def start(self) -> str:
        """Bind and start; returns the base URL (``http://host:port``)."""
        runner = LimitedRunner(
            self.make_app(),
            client_limits(self.config),
            self.bad_requests,
            access_log=None,
            handler_cancellation=True,
        )
        await runner.setup()
        site = web.TCPSite(
            runner, self.config.host, self.config.port, backlog=1024, reuse_port=self.reuse_port or None
        )
        await site.start()
        self._runner = runner
        self._site = site
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.config.host}:{port}"
        if self.background:
            self._start_background()
            await self.fleet.wait_synced(SYNC_WAIT_S)
        return self.url

    def _start_background(self) -> None:
        self.fleet.start()
        if self.journal is not None:
            self.journal.catch_up(self._replay)  # a (re)started worker holds its siblings' changes
            self._tasks.append(asyncio.create_task(self.journal.follow(self._replay)))
        if self.peers is not None:
            self._tasks.extend(self.peers.start())
        self._tasks.append(asyncio.create_task(self.monitor.health_loop()))
        self._tasks.append(asyncio.create_task(self.scraper.run()))
        self._tasks.append(asyncio.create_task(self.monitor.models_loop()))
        self._tasks.append(asyncio.create_task(self.fleet.reap_loop()))
        self._tasks.extend(asyncio.create_task(w) for w in self.discovery.watchers())
        self._ensure_preloading()

    def _replay(self, line: dict[str, Any]) -> None:
        apply_journal_line(self.fleet, line)

    def _ensure_preloading(self) -> None:
        """Run the cold-start preload loop while the features warm backends up (started once)."""
        guard = self.state.guard
        if self.background and self._preloading is None and guard is not None and guard.warmup is not None:
            self._preloading = asyncio.create_task(self.monitor.preload_loop())
            self._tasks.append(self._preloading)

    # ---- membership and reload -----------------------------------------------------------------

    def reconcile(self, specs: Sequence[BackendSpec]) -> Changes:
        """Make the backends match ``specs`` (see :meth:`Fleet.reconcile`); the sources (static,
        admin, discovery) are not changed: a later change of a source reconciles their union again."""
        return self.fleet.reconcile(specs)

    def apply_config(self, new: RouterConfig) -> str:
        """Apply a reloaded config (SIGHUP): its backends replace the static ones (reconciled with the
        admin and discovered ones), and a new policy or features take over the next decision (the
        KV view and the requests in flight are kept). Other fields need a restart: they are kept and
        named in the summary. Returns a one-line summary of what changed. Raises UserError (nothing
        changed) for a bad policy or feature combination."""
        old = self.config
        new.validate()
        policy_changed = (new.policy, new.features) != (old.policy, old.features)
        if policy_changed:
            policy = make_policy(new.policy)
            self.state.set_policy(new.policy, policy, new.features)  # may raise UserError first
            self._register_features()
            self._ensure_preloading()
        changes = self.fleet.set_source(STATIC, new.backends) or Changes()
        restart = [
            f.name
            for f in dataclasses.fields(RouterConfig)
            if f.name not in RELOADABLE and getattr(new, f.name) != getattr(old, f.name)
        ]
        self.config = old.reloaded(new)
        parts = [f"backends: {changes.describe()}"]
        if policy_changed:
            parts.append(f"policy: {self.state.routing.name}")
        else:
            parts.append("policy and features unchanged")
        if restart:
            parts.append(f"not applied until a restart: {', '.join(restart)}")
        return "; ".join(parts)

    async def shutdown(self, hurry: asyncio.Event | None = None) -> int:
        """Drain, then :meth:`stop`; returns how many requests the drain had to end.

        1. ``/health`` answers 503 (``"status": "draining"``) at once;
        2. new requests are still served for ``config.drain_grace_s`` seconds, so that a load balancer
           polling ``/health`` stops sending first; then they are refused with a 503 JSON error (with
           Retry-After, on connections already open) and the listening socket is closed (new
           connections are refused);
        3. requests in flight are awaited for up to ``config.drain_timeout_s`` seconds; those still
           running are then ended: a started stream with an SSE error event (``data: {"error": ...}``,
           ``data: [DONE]``), a request with nothing sent yet with a 503 JSON error;
        4. the background loops stop and the port is released.

        ``hurry``: when set (a second SIGTERM), the grace and the wait end at once."""
        cfg = self.config
        hurry = hurry or asyncio.Event()
        self.draining = True
        log.warning(
            "shutting down: /health answers 503; new requests refused in %.3g s; "
            "%d in flight, awaited up to %.3g s more",
            cfg.drain_grace_s,
            self.proxy.inflight,
            cfg.drain_timeout_s,
        )
        ended = 0
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hurry.wait(), cfg.drain_grace_s)
            self.proxy.refusing = True
            if self._site is not None:
                await self._site.stop()  # closes the listening socket, not the open connections
                self._site = None
            if not await self.proxy.wait_idle(cfg.drain_timeout_s, hurry):
                ended = self.proxy.abort_inflight()
                log.warning("shutting down: ending %d requests still in flight", ended)
                await self.proxy.wait_idle(_ABORT_WAIT_S)
        finally:
            await self.stop()
        return ended

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._preloading = None
        await self.fleet.stop()
        if self.peers is not None:
            self.peers.close()
        await self.transport.close()
        self.proxy.close()
        self.observer.close()
        if self.proxy.recording is not None:
            self.proxy.recording.close()

    @property
    def client_connections(self) -> int:
        """Client connections open now (0 before start and after stop)."""
        server = self._runner.server if self._runner is not None else None
        return len(server.connections) if server is not None else 0

    # ---- small endpoints -----------------------------------------------------------------------

    async def livez(self, request: web.Request) -> web.Response:
        """Liveness: 200 whenever this process's event loop answers, whatever the engines' health and
        during a drain too (``/health`` is readiness: 503 without a healthy engine)."""
        return web.Response(body=b'{"status": "alive"}', content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        """200 ``ok`` while an active backend is healthy; 503 ``unavailable`` when none is, or
        ``draining`` once a shutdown began. ``backends`` counts the active ones."""
        healthy = sum(b.routable for b in self.state.backends)
        ready = healthy and not self.draining
        body = {
            "status": "draining" if self.draining else "ok" if healthy else "unavailable",
            "healthy_backends": healthy,
            "backends": sum(b.state == ACTIVE for b in self.state.backends),
            "policy": self.state.policy.name,
        }
        return web.Response(
            status=200 if ready else 503, body=orjson.dumps(body), content_type="application/json"
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render_metrics(self.registry), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        """Union (by id, first backend wins) of the active healthy backends' /v1/models."""
        backends = [b for b in self.state.backends if b.routable]
        if not backends:
            return error_response(
                ApiError(503, "no healthy backend", etype="service_unavailable"), self.config.retry_after_s
            )
        results = await asyncio.gather(*(self._models_of(b.url) for b in backends))
        seen: dict[str, object] = {}
        for data in results:
            for m in data:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    seen.setdefault(m["id"], m)
        body = {"object": "list", "data": list(seen.values())}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _models_of(self, url: str) -> list[object]:
        timeout = self.config.health_timeout_s
        try:
            resp = await self.transport.send(url, "GET", "/v1/models", timeout_s=timeout)
            try:
                async with asyncio.timeout(timeout):
                    raw = await resp.read()
                resp.release()
            finally:
                resp.abort()
            data = orjson.loads(raw).get("data") if resp.status == 200 else None
        except (UpstreamError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return []
        return data if isinstance(data, list) else []
