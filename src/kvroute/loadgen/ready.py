"""Waiting, bounded, until a server answers ready: what lets ``kvroute up … & kvroute bench …`` work
as one line, the bench starting while the router is still bringing its engines up."""

from __future__ import annotations

import asyncio
import time

import aiohttp

__all__ = ["wait_ready"]

POLL_S = 0.25
"""Seconds between two probes."""


async def _ready(session: aiohttp.ClientSession, url: str) -> bool:
    """One probe: ``/health`` answers 200 (kvroute's router: a healthy engine behind it; vLLM: up), or,
    for a server without ``/health`` (404), ``/v1/models`` answers 200. Refused or reset: not ready."""
    try:
        async with session.get(url + "/health") as r:
            await r.read()
            if r.status != 404:
                return r.status == 200
        async with session.get(url + "/v1/models") as r:
            await r.read()
            return r.status == 200
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


async def wait_ready(url: str, timeout_s: float) -> float:
    """Probe ``url`` (base URL, no ``/v1``) every :data:`POLL_S` seconds until it is ready; return the
    seconds waited. Raises :class:`TimeoutError` when ``timeout_s`` seconds pass first (``0``: one
    probe)."""
    start = time.monotonic()
    probe = aiohttp.ClientTimeout(total=max(POLL_S * 4, 1.0))
    async with aiohttp.ClientSession(timeout=probe) as session:
        while True:
            if await _ready(session, url):
                return time.monotonic() - start
            left = timeout_s - (time.monotonic() - start)
            if left <= 0:
                raise TimeoutError(f"{url} was not ready after {timeout_s:g} s")
            await asyncio.sleep(min(POLL_S, left))
