"""Two router replicas (real ``kvroute serve`` processes) that share their reservations, in front of
real emulated engines on loopback: each sees the other's requests in flight, and when one is killed
the other loses no request and forgets the dead one's reservations within the expiry bound.

Emulated engines run at ``time_scale=0.1``: about 50 ms of wall time per decoded token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvroute.server.cluster import free_port
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster
from .test_shutdown import RouterProc, stream_body

SLOW = 0.1
EXPIRY_S = 1.5
REFRESH_S = 0.3


@pytest.fixture
async def engines() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def metric_sum(url: str, name: str) -> float:
    """The sum of ``name``'s samples on ``url``/metrics."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def until(cond, timeout_s: float) -> float:  # type: ignore[no-untyped-def]
    """Poll the async ``cond`` every 50 ms until true; returns the seconds it took (fails on timeout)."""
    t0 = time.monotonic()
    while not await cond():
        assert time.monotonic() - t0 < timeout_s, "condition not met in time"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


async def stream(url: str, max_tokens: int) -> bytes:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json=stream_body(max_tokens)) as r,
    ):
        assert r.status == 200
        return await r.read()


async def test_replicas_share_reservations_and_a_killed_one_expires(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    for _ in range(2):
        await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    ports = free_port(), free_port()
    binds = [f"tcp://127.0.0.1:{p}" for p in ports]
    peers = ",".join(binds)  # the same list for both: each ignores its own messages
    backends = [f for spec in engines.specs[1:] for f in ("--backend", spec.url)]
    common = ["--peers", peers, "--peer-expiry", str(EXPIRY_S), "--peer-refresh", str(REFRESH_S)]
    a = RouterProc(engines.specs[0].url, *backends, "--peer-bind", binds[0], *common)
    b = RouterProc(engines.specs[0].url, *backends, "--peer-bind", binds[1], *common)
    try:
        await asyncio.gather(a.start(), b.start())

        async def b_sees_a(n: int) -> bool:
            return await metric_sum(b.url, "kvroute_backend_remote_running") == n

        async def b_hears_a() -> bool:
            return await metric_sum(b.url, "kvroute_peers") == 1

        await until(b_hears_a, 10.0)
        # A's streams in flight show on B as remote running requests (and B's own stay local).
        on_a = [asyncio.create_task(stream(a.url, 200)) for _ in range(4)]
        await until(lambda: b_sees_a(4), 10.0)
        assert await metric_sum(b.url, "kvroute_backend_running") == 0
        assert await metric_sum(a.url, "kvroute_backend_remote_running") == 0

        # Traffic on B, spread over the kill: every request must complete normally.
        async def b_traffic() -> list[bytes]:
            out = []
            for _ in range(4):
                out.append(asyncio.create_task(stream(b.url, 20)))
                await asyncio.sleep(0.4)
            return list(await asyncio.gather(*out))

        traffic = asyncio.create_task(b_traffic())
        await asyncio.sleep(0.5)
        assert a.proc is not None
        a.proc.kill()
        # A is forgotten (how soon, within expiry plus a sweep, is test_peers' claim on an injected
        # clock: a wall-clock bound here would fail on a loaded machine); 30 s only guards a hang
        await until(lambda: b_sees_a(0), 30.0)
        assert await metric_sum(b.url, "kvroute_peers") == 0
        assert await metric_sum(b.url, "kvroute_peer_expired_total") == 1
        bodies = await asyncio.wait_for(traffic, 30.0)
        for body in bodies:
            assert body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in body
        assert await metric_sum(b.url, "kvroute_backend_remote_waiting") == 0
        # A's clients lost their connection with A (that is what killing a replica does).
        results = await asyncio.gather(*on_a, return_exceptions=True)
        assert all(isinstance(r, BaseException) or b"[DONE]" not in r for r in results)
        ok = await metric_sum(b.url, "kvroute_requests_total")
        assert ok == 4
    finally:
        await asyncio.gather(a.close(), b.close())


async def test_a_replica_with_workers_receives_once_for_its_machine(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    """Replica B runs ``--workers 2``: its supervisor binds ``--peer-bind`` and writes the other
    replicas' load into the machine's table, so every worker's view (and /metrics) shows replica A's
    streams; B's workers publish under one replica id, so A sees B's streams too."""
    from .test_workers import WorkersProc, scrape_worker, until_all_listen

    for _ in range(2):
        await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    ports = free_port(), free_port()
    binds = [f"tcp://127.0.0.1:{p}" for p in ports]
    peers = ",".join(binds)
    backends = [f for spec in engines.specs[1:] for f in ("--backend", spec.url)]
    common = ["--peers", peers, "--peer-expiry", str(EXPIRY_S), "--peer-refresh", str(REFRESH_S)]
    a = RouterProc(engines.specs[0].url, *backends, "--peer-bind", binds[0], *common)
    b = WorkersProc(engines.specs[0].url, *backends, "--peer-bind", binds[1], "--workers", "2", *common)
    try:
        await asyncio.gather(a.start(), b.start())
        await until_all_listen(b)
        a_streams = [asyncio.create_task(stream(a.url, 40)) for _ in range(3)]

        async def every_worker_sees_a() -> bool:
            for w in ("1", "2"):
                m = await scrape_worker(b.url, want=w)
                remote = sum(
                    v for k, v in m.samples.items() if k.startswith("kvroute_backend_remote_running")
                )
                if remote < 3:
                    return False
            return True

        await until(every_worker_sees_a, 15)
        b_streams = [asyncio.create_task(stream(b.url, 40)) for _ in range(2)]
        await until(lambda: _at_least(a.url, "kvroute_backend_remote_running", 2), 15)
        for raw in await asyncio.gather(*a_streams, *b_streams):
            assert raw.rstrip().endswith(b"data: [DONE]")
        await until(lambda: _at_most(a.url, "kvroute_backend_remote_running", 0), 15)
    finally:
        await asyncio.gather(a.close(), b.close())


async def _at_least(url: str, name: str, n: float) -> bool:
    return await metric_sum(url, name) >= n


async def _at_most(url: str, name: str, n: float) -> bool:
    return await metric_sum(url, name) <= n
