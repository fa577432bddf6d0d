"""Background loops: active health checks and metric scraping of every backend, TTL expiry.

- Health: ``GET /health`` every ``health_interval_s`` (timeout ``health_timeout_s``); a 2xx is a
  pass. ``eject_after`` consecutive failures eject a backend; ``readmit_after`` consecutive passes
  re-admit it (a connection error on a proxied request ejects at once, see the proxy).
- Scrape: ``GET /metrics`` of every healthy backend every ``scrape_interval_s``; parsed with
  :func:`~kvroute.server.backends.parse_vllm_metrics` into ``BackendState.scraped``. A failed scrape
  leaves the old value, which the load view ignores once older than ``scrape_stale_s``.
"""

from __future__ import annotations

import asyncio
import logging

from kvroute.server.backends import BackendState, parse_vllm_metrics
from kvroute.server.router import RouterCore
from kvroute.server.transport import Transport, UpstreamError

__all__ = ["Monitor"]

log = logging.getLogger("kvroute.server")


class Monitor:
    """Runs the loops for ``core``'s backends through ``transport``. Mutates backend health and
    scraped metrics only."""

    def __init__(self, core: RouterCore, transport: Transport) -> None:
        self.core = core
        self.transport = transport
        self.scrapes = 0
        self.scrape_failures = 0

    async def check_health(self, backend: BackendState) -> bool:
        """One health check; updates the backend and returns whether it passed."""
        cfg = self.core.config
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
        if ok:
            if backend.check_passed(cfg.readmit_after):
                log.warning("re-admitted backend %s", backend.url)
        elif backend.check_failed(cfg.eject_after):
            log.warning("ejected backend %s after %d failed health checks", backend.url, backend.failures)
        return ok

    async def scrape(self, backend: BackendState) -> None:
        """One /metrics scrape of ``backend``."""
        cfg = self.core.config
        try:
            resp = await self.transport.send(backend.url, "GET", "/metrics", timeout_s=cfg.health_timeout_s)
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
            parsed = parse_vllm_metrics(text, self.core.clock())
            if parsed is not None:
                backend.scraped = parsed

    async def health_loop(self) -> None:
        interval = self.core.config.health_interval_s
        while True:
            await asyncio.gather(*(self.check_health(b) for b in self.core.backends))
            self.core.kv.expire(self.core.clock())
            await asyncio.sleep(interval)

    async def scrape_loop(self) -> None:
        interval = self.core.config.scrape_interval_s
        while True:
            await asyncio.gather(*(self.scrape(b) for b in self.core.backends if b.healthy))
            await asyncio.sleep(interval)
