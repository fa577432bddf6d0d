"""A backend added and deleted through the admin API, again and again, leaves nothing behind in the
router: no descriptor (pooled upstream connection, KV event socket), no per-backend series.

A real ``kvroute serve`` process in front of raw keep-alive upstreams on loopback
(:mod:`tests.server.rawupstream`, which never close an idle connection, as a server without a
keep-alive timeout does); the router's descriptors are read from ``/proc`` by
:mod:`benchmarks.fdcensus` (which names each socket's peer). Counts only: every wait is a bounded
wait for a count to be reached (a hang guard, no speed claim).
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import orjson
import pytest
from benchmarks.fdcensus import Census, Peers, census

import kvroute
from kvroute.server.cluster import free_port
from kvroute.server.state.loadtable import url_digest

from .rawupstream import RawRequest, RawUpstream, Step, ok
from .test_wire_e2e import MODELS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

SRC = str(Path(kvroute.__file__).resolve().parents[1])
TOKEN = "churn-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROUNDS = 4
CLIENTS = 6  # concurrent requests per round
WAIT_S = 60.0  # a hang guard for each count to be reached (a loaded machine is no failure)


def engine(req: RawRequest) -> Sequence[Step]:
    """A keep-alive engine: models, empty metrics and health, a small completion for a POST."""
    if req.head.startswith(b"GET /v1/models"):
        return [ok(MODELS)]
    if req.head.startswith(b"GET"):
        return [ok(b"", "text/plain")]
    return [ok(b'{"id":"cmpl-x","object":"text_completion","choices":[{"index":0,"text":"ok"}]}')]


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def until(cond, what: str, timeout_s: float = WAIT_S):  # type: ignore[no-untyped-def]
    """``await cond()`` until it is truthy (its value) or ``timeout_s`` passed (AssertionError)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await cond()
        if got or time.monotonic() > deadline:
            assert got, what
            return got
        await asyncio.sleep(0.1)


class Router:
    """``kvroute serve`` over ``base`` (its KV events at ``kv``, where nothing publishes)."""

    def __init__(self, base: str, kv: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            *(sys.executable, "-m", "kvroute.cli", "serve", "--port", str(self.port)),
            *("--backend", base, "--kv-events", f"{base}={kv}", "--admin-token", TOKEN),
            *("--health-interval", "0.2", "--policy", "linear"),
        ]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
        }
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL, env=env
        )

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


async def get_json(s: aiohttp.ClientSession, url: str) -> tuple[int, object]:
    try:
        async with s.get(url, headers=AUTH) as r:
            return r.status, orjson.loads(await r.read()) if r.status < 500 else None
    except aiohttp.ClientError:
        return -1, None


async def metric_lines(s: aiohttp.ClientSession, url: str, name: str) -> list[str]:
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    return [ln for ln in text.splitlines() if ln.startswith(name + "{")]


async def traffic(s: aiohttp.ClientSession, url: str) -> None:
    body = {"model": "emu", "prompt": "hello there", "max_tokens": 2}

    async def one() -> None:
        async with s.post(url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.read()

    await asyncio.gather(*(one() for _ in range(CLIENTS)))


async def test_adding_and_deleting_a_backend_leaves_no_descriptor_or_state_behind(
    session: aiohttp.ClientSession,
) -> None:
    kv_base, kv_churn = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    async with RawUpstream(engine) as base, RawUpstream(engine) as churn:
        router = Router(base.url, kv_base)
        await router.start()
        assert router.proc is not None
        try:
            await until(lambda: _healthy(session, router.url), "the router never became healthy")
            peers = Peers(
                frozenset({router.port}),
                {port(base.url): "base", port(churn.url): "churn"},
                {port(kv_base): "base", port(kv_churn): "churn"},
            )
            for _ in range(2):  # the base's pool at the level this traffic needs
                await traffic(session, router.url)
            pid = router.proc.pid
            no_churn = functools.partial(_no_churn, pid, peers)
            before = census(pid, peers)
            assert before.by_peer.get("churn", 0) == 0 and before.fds > 0
            bid = url_digest(churn.url)
            spec = {"url": churn.url, "kv_events": kv_churn}
            for _ in range(ROUNDS):
                async with session.post(router.url + "/admin/backends", json=spec, headers=AUTH) as r:
                    assert r.status == 201, await r.read()
                await until(
                    lambda: _backend_is(session, router.url, bid, healthy=True),
                    "the backend was never admitted",
                )
                await traffic(session, router.url)  # some of it on the new backend
                held = census(pid, peers)
                assert held.by_peer.get("churn", 0) >= 1, held  # it did hold connections to it
                async with session.delete(f"{router.url}/admin/backends/{bid}", headers=AUTH) as r:
                    assert r.status == 202, await r.read()
                await until(lambda: _backend_is(session, router.url, bid, state="removed"), "never removed")
                gone = await until(no_churn, f"sockets to a deleted backend stay open: {held}")
                assert gone.by_peer.get("zmq:churn", 0) == 0, gone
            assert churn.connections >= 1  # the router did talk to it
            after = await until(no_churn, "sockets to a deleted backend")
            # every kind of descriptor back where it was, but the base's pooled connections (which
            # may grow by the requests in flight at once on it) and the test's own client sockets
            for kind in ("file", "pipe", "eventfd", "epoll", "anon_inode"):
                assert after.by_kind.get(kind, 0) == before.by_kind.get(kind, 0), (kind, before, after)
            for peer in ("listen", "unix", "zmq:base", "tcp:other", "tcp:unconnected", "unknown"):
                assert after.by_peer.get(peer, 0) == before.by_peer.get(peer, 0), (peer, before, after)
            assert after.by_peer.get("base", 0) <= before.by_peer.get("base", 0) + CLIENTS, (before, after)
            # per-backend state: no series for the deleted backend, one subscriber, one pool
            assert [ln for ln in await metric_lines(session, router.url, "kvroute_upstream_connections")
                    if churn.url in ln] == []  # fmt: skip
            batches = await metric_lines(session, router.url, "kvroute_kv_event_batches_total")
            assert len(batches) == 1 and base.url in batches[0], batches
            backends = await metric_lines(session, router.url, "kvroute_backends")
            assert 'kvroute_backends{state="active"} 1.0' in backends, backends
        finally:
            await router.close()


async def _healthy(s: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with s.get(url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def _backend_is(
    s: aiohttp.ClientSession, url: str, bid: str, healthy: bool | None = None, state: str | None = None
) -> bool:
    status, body = await get_json(s, f"{url}/admin/backends/{bid}")
    if status != 200 or not isinstance(body, dict):
        return False
    return (healthy is None or body.get("healthy") is healthy) and (
        state is None or body.get("state") == state
    )


async def _no_churn(pid: int, peers: Peers) -> Census | None:
    c = census(pid, peers)
    return c if c.by_peer.get("churn", 0) == 0 and c.by_peer.get("zmq:churn", 0) == 0 else None
