"""Background loops: active health checks and metric scraping of every backend, TTL expiry.

- Health: ``GET /health`` of every active backend (not draining or removed) every
  ``health_interval_s`` (timeout ``health_timeout_s``); a 2xx is a pass. ``eject_after`` consecutive failures eject a backend; ``readmit_after`` consecutive passes
  re-admit it (a connection error on a proxied request ejects at once, see the proxy).
- Scrape: ``GET /metrics`` (restricted to the samples it reads, ``engines.SCRAPE_PATH``) of a
  backend, when :mod:`kvroute.server.sync.scrape` (one scraper per machine, adaptive interval) asks; parsed with
  :func:`~kvroute.server.state.backends.parse_vllm_metrics` into ``BackendState.scraped``. A failed scrape
  leaves the old value, which the load view ignores once older than ``scrape_stale_s``. The page is
  read with the backend's engine's names (``engine`` in its spec, else detected from the scrape; see
  :mod:`kvroute.server.sync.engines`).
- Models: ``GET /v1/models`` of every active backend when it is admitted and every
  ``models_interval_s``, into the model pools (:mod:`kvroute.server.state.pools`; skipped for backends whose
  config declares their models). A failed read keeps the last list.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from kvroute.features.coldstart import Prefix
from kvroute.server.state.backends import ACTIVE, BackendState, Lease
from kvroute.server.state.pools import parse_model_list
from kvroute.server.state.router import RouterState
from kvroute.server.sync.engines import SCRAPE_PATH, parse_metrics
from kvroute.server.wire.transport import Transport, UpstreamError

__all__ = ["Monitor"]

log = logging.getLogger("kvroute.server")


class Monitor:
    """Runs the loops for ``core``'s backends through ``transport``. Mutates backend health and
    scraped metrics only."""

    def __init__(self, core: RouterState, transport: Transport) -> None:
        self.state = core
        self.transport = transport
        self.scrapes = 0
        self.scrape_failures = 0
        self.preloads_sent = 0
        self.preload_failures = 0
        self.engines: dict[int, str] = {}  # backend index -> engine detected from its metrics
        self.model_reads = 0
        self.model_read_failures = 0

    def engine_of(self, index: int) -> str | None:
        """Backend ``index``'s engine kind: declared in its spec, else detected (None: not yet)."""
        return self.state.specs[index].engine or self.engines.get(index)

    async def check_health(self, backend: BackendState) -> bool:
        """One health check; updates the backend and returns whether it passed."""
        cfg = self.state.config
        ok = False
        try:
            resp = await self.transport.send(backend.url, "GET", "/health", timeout_s=cfg.health_timeout_s)
            try:
                async with asyncio.timeout(cfg.health_timeout_s):
                    await resp.read()
                ok = 200 <= resp.status < 300
                resp.release()
            finally:
                resp.abort()
        except (UpstreamError, TimeoutError):
            ok = False
        if backend.state != ACTIVE:
            return ok  # drained or removed while the check ran
        if ok:
            if backend.check_passed(cfg.readmit_after):
                log.warning("admitted backend %s", backend.url)
                self.state.backend_reset(backend.index)  # cold start: it restarted (or joined)
                await self.read_models(backend)  # it may serve other models than before
        elif backend.check_failed(cfg.eject_after):
            log.warning("ejected backend %s after %d failed health checks", backend.url, backend.failures)
        return ok

    async def scrape(self, backend: BackendState, path: str = SCRAPE_PATH) -> None:
        """One /metrics scrape of ``backend`` (``path``: the filtered page by default)."""
        cfg = self.state.config
        began = self.state.clock()  # the scrape's time (ScrapedMetrics.at): the leases before it settle
        try:
            resp = await self.transport.send(backend.url, "GET", path, timeout_s=cfg.health_timeout_s)
            try:
                async with asyncio.timeout(cfg.health_timeout_s):
                    text = await resp.read()
                ok = resp.status == 200
                resp.release()
            finally:
                resp.abort()
        except (UpstreamError, TimeoutError):
            self.scrape_failures += 1
            return
        self.scrapes += 1
        if ok:
            core = self.state
            engine = self.engine_of(backend.index)
            parsed, seen = parse_metrics(text, began, engine, core.config.block_size)
            if parsed is not None:
                backend.scraped = parsed
                backend.settle(parsed)
                if parsed.block_size:
                    core.kv.set_engine_block_size(backend.index, parsed.block_size)
                if engine is None and seen is not None:
                    self.engines[backend.index] = seen
                    log.info("backend %s: %s metrics", backend.url, seen)

    async def read_models(self, backend: BackendState) -> bool:
        """Read ``backend``'s ``/v1/models`` into the model pools (not when its config declares its
        models); True when the read succeeded."""
        core, cfg = self.state, self.state.config
        spec = core.specs[backend.index]
        if spec.models or spec.lora_adapters:
            return True
        try:
            resp = await self.transport.send(backend.url, "GET", "/v1/models", timeout_s=cfg.health_timeout_s)
            try:
                async with asyncio.timeout(cfg.health_timeout_s):
                    raw = await resp.read()
                ok = resp.status == 200
                resp.release()
            finally:
                resp.abort()
            served = parse_model_list(orjson.loads(raw)) if ok else None
        except (UpstreamError, TimeoutError, orjson.JSONDecodeError):
            served = None
        if served is None or backend.state != ACTIVE:
            self.model_read_failures += 1
            return False
        self.model_reads += 1
        if core.pools.listed(backend.index, served):
            log.info("backend %s serves %s", backend.url, ", ".join(sorted(served.models)) or "no model")
        return True

    async def models_loop(self) -> None:
        """Read every active backend's /v1/models now, then every ``models_interval_s``."""
        interval = self.state.config.models_interval_s
        while True:
            await asyncio.gather(*(self.read_models(b) for b in self.state.backends if b.state == ACTIVE))
            await asyncio.sleep(interval)

    async def health_loop(self) -> None:
        interval = self.state.config.health_interval_s
        while True:
            await asyncio.gather(*(self.check_health(b) for b in self.state.backends if b.state == ACTIVE))
            self.state.kv.expire(self.state.clock())
            await asyncio.sleep(interval)

    async def preload(self, index: int, prefix: Prefix) -> bool:
        """Cold start: send ``prefix`` to backend ``index`` as a ``max_tokens: 1`` completion so that
        the backend caches it; counted in the backend's load while it runs. True on a 2xx."""
        if prefix.tokens is None:
            return False
        core, cfg = self.state, self.state.config
        backend = core.backends[index]
        if not backend.routable:
            return False
        body: dict[str, object] = {"prompt": list(prefix.tokens), "max_tokens": 1}
        if prefix.model is not None:
            body["model"] = prefix.model
        lease = Lease(backend, len(prefix.tokens), at=core.clock())
        core.kv.on_routed(index, prefix.chain, core.clock())
        ok = False
        try:
            resp = await self.transport.send(
                backend.url,
                "POST",
                "/v1/completions",
                orjson.dumps(body),
                {"Content-Type": "application/json"},
            )
            try:
                async with asyncio.timeout(cfg.upstream_timeout_s):
                    await resp.read()
                ok = 200 <= resp.status < 300
                resp.release()
            finally:
                resp.abort()
        except (UpstreamError, TimeoutError):
            ok = False
        finally:
            lease.release()
        if ok:
            self.preloads_sent += 1
        else:
            self.preload_failures += 1
            log.warning(
                "cold start: preloading a %d-token prefix on %s failed", len(prefix.tokens), backend.url
            )
        return ok

    async def preload_loop(self, interval_s: float = 0.1) -> None:
        """Send the preloads queued by cold start (backend re-admitted or cache cleared)."""
        while True:
            todo = self.state.take_preloads()
            if todo:
                await asyncio.gather(*(self.preload(i, p) for i, p in todo))
            await asyncio.sleep(interval_s)
