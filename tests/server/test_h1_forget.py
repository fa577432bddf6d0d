"""A removed backend's pooled connections are closed by the transport: :meth:`H1Transport.forget`
closes the idle ones at once and a busy one when its response is released; :meth:`H1Transport.prune`
forgets every URL not listed, also one whose pool was made after the backend was removed. Real
sockets on loopback (a raw keep-alive upstream that never closes an idle connection); this
process's own descriptors are counted (:mod:`benchmarks.fdcensus`), every wait bounded."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from benchmarks.fdcensus import Peers, census

from kvroute.server.wire.h1 import H1Transport

from .rawupstream import RawRequest, RawUpstream, Step, ok

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def slow_on_post(req: RawRequest) -> list[Step]:
    """A GET is answered at once, a POST after 0.3 s (so it is still in flight when asked)."""
    return [0.3, ok(b"{}")] if req.head.startswith(b"POST") else [ok(b"{}")]


def held(up: RawUpstream) -> int:
    """This process's sockets connected to ``up`` (the transport's side)."""
    port = int(up.url.rsplit(":", 1)[1])
    return census(os.getpid(), Peers(engines={port: "up"})).by_peer.get("up", 0)


async def until_held(up: RawUpstream, n: int) -> int:
    for _ in range(500):
        if held(up) == n:
            break
        await asyncio.sleep(0.02)
    return held(up)


async def get(t: H1Transport, url: str) -> None:
    resp = await t.send(url, "GET", "/health", timeout_s=10)
    await resp.read()
    resp.release()


async def test_forget_closes_idle_connections_now_and_a_busy_one_when_released() -> None:
    t = H1Transport(connect_timeout_s=5, read_timeout_s=10)
    try:
        async with RawUpstream(slow_on_post) as up:
            await asyncio.gather(get(t, up.url), get(t, up.url))  # two pooled connections
            assert t.open_connections() == {up.url: 2}
            busy = await t.send(up.url, "POST", "/v1/completions", b"{}", timeout_s=10)  # reuses one
            t.forget(up.url)
            assert await until_held(up, 1) == 1  # the idle one closed, the busy one not
            assert await busy.read() == b"{}"  # its response is whole
            busy.release()
            assert await until_held(up, 0) == 0  # closed on release, not pooled
            assert t.open_connections() == {}
            await get(t, up.url)  # the URL listed again: a new pool
            assert t.open_connections() == {up.url: 1} and up.connections == 3
    finally:
        await t.close()


async def test_prune_forgets_every_url_not_listed_also_a_pool_made_after_removal() -> None:
    t = H1Transport(connect_timeout_s=5, read_timeout_s=10)
    try:
        async with RawUpstream(slow_on_post) as kept, RawUpstream(slow_on_post) as gone:
            await asyncio.gather(get(t, kept.url), get(t, gone.url))
            t.prune({kept.url})
            assert await until_held(gone, 0) == 0 and held(kept) == 1
            await get(t, gone.url)  # a check begun before the removal connects after it
            assert held(gone) == 1
            t.prune({kept.url})  # the next prune closes it
            assert await until_held(gone, 0) == 0
            assert t.open_connections() == {kept.url: 1}
    finally:
        await t.close()
