"""The periodic prune of the pooled upstream connections, for the router and the P/D router alike.

A prune (:meth:`~kvroute.server.wire.h1.H1Transport.prune`) closes the pooled connections of every
base URL that is not listed now (a backend that left, also a pool made for it after it left by a
health check, scrape or request begun before), and every connection idle in its pool for longer
than ``upstream_keepalive_s``. The router prunes at each of its fleet's reaps
(:meth:`kvroute.server.sync.fleet.Fleet.reap`, every ``REAP_INTERVAL_S``); the P/D router, which has
no fleet, runs :func:`prune_every`. A transport without pools (one a test injects) is not pruned.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection

from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.transport import Transport

__all__ = ["PRUNE_INTERVAL_S", "Prune", "prune_every", "pruner"]

PRUNE_INTERVAL_S = 0.05
"""Seconds between two prunes: how late past ``upstream_keepalive_s`` an idle connection may close."""

Prune = Callable[[Collection[str]], None]
"""Keep the pooled connections to these base URLs only, and close those idle for too long."""


def pruner(transport: Transport) -> Prune | None:
    """``transport``'s prune, or None for a transport without pools."""
    return transport.prune if isinstance(transport, H1Transport) else None


async def prune_every(
    prune: Prune, listed: Callable[[], Collection[str]], interval_s: float = PRUNE_INTERVAL_S
) -> None:
    """Until cancelled: ``prune(listed())`` (``listed``: the base URLs listed now), then again every
    ``interval_s`` seconds."""
    while True:
        prune(listed())
        await asyncio.sleep(interval_s)
