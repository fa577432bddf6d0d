"""End to end over real sockets: the router in front of real emulated engines (in-process
``EmulatorServer`` instances on free loopback ports, KV events over ZMQ on free ports)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.cluster import EngineCluster, free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost


class Cluster:
    def __init__(self) -> None:
        self.engines: list[EmulatorServer] = []
        self.specs: list[BackendSpec] = []
        self.router: RouterServer | None = None

    async def add_engine(
        self, tokenizer: Tokenizer, events: bool, time_scale: float = 20.0
    ) -> EmulatorServer:
        kv = None
        pub = rep = None
        if events:
            pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            kv = KVEventsSettings(pub, replay_endpoint=rep)
        settings = EmulatorSettings(
            model_name="emu",
            engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
            time_scale=time_scale,
            kv_events=kv,
        )
        eng = EmulatorServer(settings, COST, tokenizer)
        port = await eng.start("127.0.0.1", 0)
        self.engines.append(eng)
        self.specs.append(BackendSpec(f"http://127.0.0.1:{port}", pub, rep))
        return eng

    async def start_router(
        self, tokenizer: Tokenizer, extra: tuple[BackendSpec, ...] = (), **kw: object
    ) -> str:
        cfg = RouterConfig(backends=(*self.specs, *extra), port=0, health_interval_s=0.2, **kw)  # type: ignore[arg-type]
        self.router = RouterServer(cfg, tokenizer=tokenizer)
        return await self.router.start()

    async def close(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for e in self.engines:
            await e.stop()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


def counters_zero(router: RouterServer) -> bool:
    return all(
        b.waiting == 0 and b.running == 0 and b.queued_prefill == 0 and b.blocks == 0 and b.pending == 0
        for b in router.state.backends
    )


async def eventually(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


async def test_openai_client_streamed_and_not(cluster: Cluster, tokenizer: Tokenizer) -> None:
    await cluster.add_engine(tokenizer, events=True)
    url = await cluster.start_router(tokenizer)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["emu"]
        done = await client.completions.create(model="emu", prompt="The capital of France is", max_tokens=5)
        assert done.usage is not None and done.usage.completion_tokens == 5 and done.choices[0].text
        chat = await client.chat.completions.create(
            model="emu", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model="emu",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage = [], None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(pieces) >= 1 and usage is not None and usage.completion_tokens == 6
    finally:
        await client.close()
    assert cluster.router is not None and counters_zero(cluster.router)


@pytest.mark.parametrize("events", [True, False], ids=["exact", "approx"])
async def test_second_turn_lands_where_its_prefix_is_cached(
    cluster: Cluster, tokenizer: Tokenizer, events: bool
) -> None:
    for _ in range(3):
        await cluster.add_engine(tokenizer, events=events)
    url = await cluster.start_router(tokenizer, policy="lmetric")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    system = {"role": "system", "content": "You are a meticulous assistant. " * 40}
    try:
        for conv in range(3):
            msgs = [
                system,
                {"role": "user", "content": f"Conversation {conv}: tell me about topic {conv}. " * 8},
            ]
            first = await client.chat.completions.create(model="emu", messages=msgs, max_tokens=8)  # type: ignore[arg-type]
            assert first.usage is not None
            engines_before = [e.model.stats().prefix_query_tokens for e in cluster.engines]
            if events:  # wait for the BlockStored events to reach the router
                subs = cluster.router.subscribers if cluster.router else []
                await eventually(lambda subs=subs: any(s.batches for s in subs))
                await asyncio.sleep(0.1)
            msgs = [
                *msgs,
                {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And more?"},
            ]
            second = await client.chat.completions.create(model="emu", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            # The whole first-turn prompt (system + user) is a cached prefix of the second turn.
            assert (
                second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
            )
            engines_after = [e.model.stats().prefix_query_tokens for e in cluster.engines]
            grew = [i for i, (a, b) in enumerate(zip(engines_before, engines_after, strict=True)) if b > a]
            assert len(grew) == 1
    finally:
        await client.close()


async def test_backend_killed_mid_stream(cluster: Cluster, tokenizer: Tokenizer) -> None:
    """The victim is a real ``kvroute engine`` subprocess, SIGKILLed while it streams."""
    victim = EngineCluster(1, ["--time-scale", "2", "--kv-blocks", "4096", "--model", "emu"], kv_events=False)
    (spec,) = await victim.start()
    try:
        await cluster.add_engine(tokenizer, events=False, time_scale=2.0)
        url = await cluster.start_router(tokenizer, extra=(spec,), policy="round-robin")
        router = cluster.router
        assert router is not None
        body = {"model": "emu", "prompt": "hello " * 20, "max_tokens": 400, "stream": True}
        async with aiohttp.ClientSession() as s:
            small = {**body, "max_tokens": 1, "stream": False}
            async with s.post(url + "/v1/completions", json=small) as r:  # round-robin: engine 0 first
                assert r.status == 200
            async with s.post(url + "/v1/completions", json=body) as r:  # ... then the victim
                assert r.status == 200
                first = await r.content.readline()
                assert first.startswith(b"data: ")
                victim.engines[0].proc.kill()
                rest = await r.content.read()
            assert b'"upstream_error"' in rest and rest.rstrip().endswith(b"data: [DONE]")
            assert await eventually(lambda: counters_zero(router))
            # Later requests are served by the survivor.
            for _ in range(3):
                async with s.post(
                    url + "/v1/completions", json={**body, "max_tokens": 2, "stream": False}
                ) as r:
                    assert r.status == 200
        assert not router.state.backends[1].healthy
        assert counters_zero(router)
    finally:
        victim.stop()


async def test_backend_down_at_start(cluster: Cluster, tokenizer: Tokenizer) -> None:
    await cluster.add_engine(tokenizer, events=False)
    dead = BackendSpec(f"http://127.0.0.1:{free_port()}")
    url = await cluster.start_router(tokenizer, extra=(dead,), policy="round-robin")
    router = cluster.router
    assert router is not None
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(url + "/v1/completions", json={"prompt": "hi there", "max_tokens": 2}) as r:
                assert r.status == 200
    assert not router.state.backends[1].healthy and router.state.backends[0].healthy
    assert counters_zero(router)


async def test_client_disconnect_cancels_upstream(cluster: Cluster, tokenizer: Tokenizer) -> None:
    eng = await cluster.add_engine(tokenizer, events=False, time_scale=1.0)
    url = await cluster.start_router(tokenizer)
    router = cluster.router
    assert router is not None
    body = {"model": "emu", "prompt": "hello " * 20, "max_tokens": 5000, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.content.readline()
        assert eng.model.stats().running == 1
        b = router.state.backends[0]
        assert (b.running, b.queued_prefill) == (1, 0) and b.blocks > 0  # started: its blocks count
        r.close()  # drop the connection mid-stream
    assert await eventually(lambda: eng.model.stats().running == 0 and eng.model.stats().waiting == 0)
    assert await eventually(lambda: counters_zero(router))
    assert router.state.counters.cancelled == 1


async def test_all_backends_down_503(cluster: Cluster, tokenizer: Tokenizer) -> None:
    dead = (BackendSpec(f"http://127.0.0.1:{free_port()}"), BackendSpec(f"http://127.0.0.1:{free_port()}"))
    url = await cluster.start_router(tokenizer, extra=dead)
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == 503
        async with s.get(url + "/v1/models") as r:
            assert r.status == 503


async def test_scrapes_read_filtered_and_whole_metric_pages(cluster: Cluster, tokenizer: Tokenizer) -> None:
    """The scraper asks for the samples it reads (``name[]``); the emulated engines, as vLLM 0.32,
    serve their whole page, so does the fake: both end up in the backends' load view."""
    from .fakes import FakeEngine

    await cluster.add_engine(tokenizer, events=False)
    await cluster.add_engine(tokenizer, events=False)
    fake = FakeEngine("fake")
    fake_url = await fake.start()
    try:
        await cluster.start_router(tokenizer, extra=(BackendSpec(fake_url),), scrape_interval_s=0.05)
        router = cluster.router
        assert router is not None
        assert await eventually(lambda: all(b.scraped is not None for b in router.state.backends))
        assert fake.metrics_queries and all("vllm:num_requests_running" in q for q in fake.metrics_queries)
        assert all(b.scraped is not None and b.scraped.running == 0 for b in router.state.backends)
    finally:
        await fake.stop()
