"""The live router's router-side queue over real sockets: emulated engines on loopback, the router in
front with ``router_queue`` on; a queued request goes out when the engine frees, a client that leaves
while queued is counted and dropped, a request past the TTL gets a 503 with Retry-After."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.routing.queue import QueueConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.observe.dashstate import dashboard_state
from kvroute.server.stages.wait import WaitingRoom
from kvroute.tokenizer import Tokenizer

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost


class Setup:
    def __init__(self) -> None:
        self.engines: list[EmulatorServer] = []
        self.router: RouterServer | None = None

    async def start(
        self, tokenizer: Tokenizer, queue: QueueConfig, limits: tuple[int, int], time_scale: float
    ) -> str:
        settings = EmulatorSettings(
            model_name="emu",
            engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
            time_scale=time_scale,
        )
        eng = EmulatorServer(settings, COST, tokenizer)
        port = await eng.start("127.0.0.1", 0)
        self.engines.append(eng)
        cfg = RouterConfig(
            backends=(BackendSpec(f"http://127.0.0.1:{port}"),),
            port=0,
            health_interval_s=0.2,
            router_queue=queue,
            engine_limits=limits,
        )
        self.router = RouterServer(cfg, tokenizer=tokenizer)
        return await self.router.start()

    @property
    def room(self) -> WaitingRoom:
        assert self.router is not None and self.router.proxy.waiting is not None
        return self.router.proxy.waiting

    def idle(self) -> bool:
        assert self.router is not None
        return all(
            b.waiting == 0 and b.running == 0 and b.queued_prefill == 0 and b.blocks == 0
            for b in self.router.state.backends
        )

    async def close(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for e in self.engines:
            await e.stop()


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    s = Setup()
    yield s
    await s.close()


async def eventually(cond, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


def body(text: str, max_tokens: int) -> dict[str, object]:
    return {"model": "emu", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}


async def post(
    session: aiohttp.ClientSession, url: str, text: str, max_tokens: int = 4
) -> tuple[int, dict, dict]:
    async with session.post(url + "/v1/chat/completions", json=body(text, max_tokens)) as r:
        return r.status, dict(r.headers), await r.json()


async def test_queued_requests_go_out_as_the_engine_frees(setup: Setup, tokenizer: Tokenizer) -> None:
    # a 64-token chunk budget: a ~400-token prompt saturates the engine until its first token
    url = await setup.start(tokenizer, QueueConfig(ttl_s=30), (64, 256), time_scale=20.0)
    async with aiohttp.ClientSession() as s:
        outs = await asyncio.gather(*(post(s, url, f"question {k} " + "word " * 400) for k in range(4)))
        assert [o[0] for o in outs] == [200] * 4
        metrics = await (await s.get(url + "/metrics")).text()
    q = setup.room.queue
    assert q.enqueued >= 1 and q.dispatched == q.enqueued and len(q) == 0 and q.depth == {}
    assert await eventually(setup.idle)  # no leaked counters (the holds were released)
    queued = [line for line in metrics.splitlines() if line.startswith("kvroute_router_queue_queued_total")]
    assert queued and float(queued[0].split()[-1]) == q.enqueued
    assert 'kvroute_router_queue_wait_seconds_bucket{le="+Inf"}' in metrics
    assert setup.router is not None
    records = [r for r in setup.router.observer.log._records if r.decision.queued_s > 0]
    assert 1 <= len(records) <= q.enqueued  # the decision records of the requests that waited
    dash = dashboard_state(setup.router.observer)["router_queue"]
    assert dash["queued"] == q.enqueued and dash["waiting"] == 0 and dash["wait_ms_mean"] > 0
    # each request counts once as routed, queued or not (the wait stage's hold is not an attempt)
    assert [b.requests_total for b in setup.router.state.backends] == [4]
    routed = [line for line in metrics.splitlines() if line.startswith("kvroute_backend_routed_total{")]
    assert len(routed) == 1 and float(routed[0].split()[-1]) == 4


async def test_a_client_that_leaves_while_queued_is_counted_and_dropped(
    setup: Setup, tokenizer: Tokenizer
) -> None:
    # a batch limit of 1: while the first request runs, the second waits at the router
    url = await setup.start(tokenizer, QueueConfig(ttl_s=30), (0, 1), time_scale=1.0)
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(post(s, url, "a long answer please", max_tokens=200))
        assert await eventually(
            lambda: (
                setup.router is not None
                and setup.router.state.backends[0].waiting + setup.router.state.backends[0].running == 1
            )
        )
        second = asyncio.ensure_future(post(s, url, "me too", max_tokens=4))
        assert await eventually(lambda: len(setup.room.queue) == 1)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
    async with aiohttp.ClientSession() as s2:
        # the router notices the closed connection: the request leaves the queue, counted
        assert await eventually(lambda: setup.room.queue.cancelled == 1)
        assert len(setup.room.queue) == 0 and setup.room.queue.depth == {}
        first.cancel()
        status, _, _ = await post(s2, url, "after", max_tokens=2)
        assert status == 200
    assert await eventually(setup.idle)


async def test_a_request_past_the_ttl_gets_503_with_retry_after(setup: Setup, tokenizer: Tokenizer) -> None:
    url = await setup.start(tokenizer, QueueConfig(ttl_s=0.3), (0, 1), time_scale=1.0)
    async with aiohttp.ClientSession() as s:
        first = asyncio.ensure_future(post(s, url, "a long answer please", max_tokens=200))
        assert await eventually(
            lambda: (
                setup.router is not None
                and setup.router.state.backends[0].running + setup.router.state.backends[0].waiting == 1
            )
        )
        status, headers, err = await post(s, url, "me too", max_tokens=4)
        assert status == 503 and headers["Retry-After"] == "1"
        assert err["error"]["type"] == "service_unavailable" and "waited" in err["error"]["message"]
        assert setup.room.queue.expired == 1 and len(setup.room.queue) == 0
        assert setup.router is not None
        reasons = [r.decision.reason for r in setup.router.observer.log._records]
        assert "queue_ttl" in reasons
        first.cancel()
    assert await eventually(setup.idle)
