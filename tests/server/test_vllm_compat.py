"""The router against the emulated engine behaving as vLLM 0.32 does (issue 21), end to end over real
sockets: in-process ``EmulatorServer`` engines (HTTP and ZMQ KV events with replay on free loopback
ports) and the router with explanation headers, comparing the router's predicted ``cached_tokens``
(``x-kvroute-cached-tokens``) with what the engine reports in ``usage``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import BlockStored, EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.cluster import free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

from .test_e2e import eventually

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
MODEL = "emu"


class Fleet:
    def __init__(self) -> None:
        self.engines: list[EmulatorServer] = []
        self.specs: list[BackendSpec] = []
        self.router: RouterServer | None = None
        self.url = ""

    async def engine(
        self, tokenizer: Tokenizer, block_size: int = 16, blocks: int = 4096, buffer_steps: int = 10_000
    ) -> EmulatorServer:
        pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        settings = EmulatorSettings(
            model_name=MODEL,
            engine=EngineConfig(
                num_kv_blocks=blocks, block_size=block_size, report_tokens=True, max_model_len=32768
            ),
            time_scale=20.0,
            kv_events=KVEventsSettings(pub, replay_endpoint=rep, buffer_steps=buffer_steps),
        )
        eng = EmulatorServer(settings, COST, tokenizer)
        port = await eng.start("127.0.0.1", 0)
        self.engines.append(eng)
        self.specs.append(BackendSpec(f"http://127.0.0.1:{port}", pub, rep))
        return eng

    async def start(self, tokenizer: Tokenizer, **kw: Any) -> str:
        cfg = RouterConfig(
            backends=tuple(self.specs), port=0, health_interval_s=0.2, explain=True, policy="lmetric", **kw
        )
        self.router = RouterServer(cfg, tokenizer=tokenizer)
        self.url = await self.router.start()
        return self.url

    async def close(self) -> None:
        if self.router is not None:
            await self.router.stop()
        for e in self.engines:
            await e.stop()


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    yield f
    await f.close()


async def settle(fleet: Fleet) -> None:
    """Wait until the router has applied every KV event batch the engines published."""
    router = fleet.router
    assert router is not None
    subs = router.subscribers

    def caught_up() -> bool:
        pubs = [e.publisher for e in fleet.engines]
        return all(
            p is None or p.seq == 0 or s.last_seq == p.seq - 1 for p, s in zip(pubs, subs, strict=True)
        )

    assert await eventually(caught_up)


async def chat(
    s: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], **extra: Any
) -> tuple[int, int, str, dict[str, Any]]:
    """(predicted cached tokens, reported cached tokens, backend URL, the response body)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, **extra}
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
        predicted = int(r.headers["x-kvroute-cached-tokens"])
        backend = r.headers["x-kvroute-backend"]
    reported = data["usage"]["prompt_tokens_details"]["cached_tokens"]
    return predicted, reported, backend, data


SYSTEM = {"role": "system", "content": "You are a careful assistant who answers in full sentences. " * 30}


async def test_cache_salt_salted_repeat_hits_and_unsalted_same_text_misses(
    fleet: Fleet, tokenizer: Tokenizer
) -> None:
    """Fix 1: the emulator hashes ``cache_salt`` into the first block and reports it in its events'
    ``extra_keys`` as vLLM does; the router records the salted prefix as salted. A salted repeat is
    predicted (and gets) a hit on its holder; the same text unsalted, or under another salt, is
    predicted (and gets) a miss."""
    for _ in range(2):
        await fleet.engine(tokenizer)
    seen: list[BlockStored] = []
    for eng in fleet.engines:
        pub = eng.publisher
        assert pub is not None
        original = pub.publish

        def spy(events, ts=None, original=original):  # type: ignore[no-untyped-def]
            seen.extend(e for e in events if isinstance(e, BlockStored))
            return original(events, ts)

        pub.publish = spy  # type: ignore[method-assign]
    url = await fleet.start(tokenizer)
    msgs = [SYSTEM, {"role": "user", "content": "What is the tallest mountain on Earth? " * 4}]
    async with aiohttp.ClientSession() as s:
        p0, r0, holder, _ = await chat(s, url, msgs, cache_salt="tenant-a")
        assert p0 == r0 == 0
        await settle(fleet)
        p1, r1, again, _ = await chat(s, url, msgs, cache_salt="tenant-a")
        assert again == holder and p1 == r1 > 0
        await settle(fleet)
        p2, r2, _, _ = await chat(s, url, msgs)
        assert p2 == r2 == 0
        await settle(fleet)
        p3, r3, _, _ = await chat(s, url, msgs, cache_salt="tenant-b")
        assert p3 == r3 == 0
        async with s.post(
            url + "/v1/chat/completions", json={"model": MODEL, "messages": msgs, "cache_salt": 3}
        ) as r:
            assert r.status == 400  # the router refuses a non-string salt
        # completions too: a salted text prompt, then its salted repeat on the holder
        body = {"model": MODEL, "prompt": "Salted completion prompt about rivers. " * 30, "max_tokens": 2}
        salted = {**body, "cache_salt": "tenant-c"}
        async with s.post(url + "/v1/completions", json=salted) as r:
            assert r.status == 200 and int(r.headers["x-kvroute-cached-tokens"]) == 0
            first = r.headers["x-kvroute-backend"]
        await settle(fleet)
        async with s.post(url + "/v1/completions", json=salted) as r:
            data = await r.json()
            hit = int(r.headers["x-kvroute-cached-tokens"])
            assert r.headers["x-kvroute-backend"] == first
            assert hit == data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        await settle(fleet)
        async with s.post(url + "/v1/completions", json=body) as r:
            data = await r.json()
            assert int(r.headers["x-kvroute-cached-tokens"]) == 0
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    roots = [e for e in seen if e.parent_block_hash is None]
    assert {e.extra_keys[0] if e.extra_keys else None for e in roots} == {
        ("tenant-a",),
        ("tenant-b",),
        ("tenant-c",),
        None,
    }
    assert all(e.extra_keys is not None and len(e.extra_keys) == len(e.block_hashes) for e in seen)
    assert all(k is None for e in seen if e.parent_block_hash is not None for k in e.extra_keys or ())


async def conversation_run(
    fleet: Fleet, turns: int, convs: int, salt: str | None = None
) -> list[tuple[int, int, str]]:
    """``convs`` conversations of ``turns`` turns sharing a system prompt, one request at a time, the
    view settled before each: ``(predicted, reported, engine block size header)`` per request."""
    out: list[tuple[int, int, str]] = []
    extra = {} if salt is None else {"cache_salt": salt}
    async with aiohttp.ClientSession() as s:
        history = [[SYSTEM] for _ in range(convs)]
        for turn in range(turns):
            for c in range(convs):
                msgs = history[c]
                msgs.append(
                    {"role": "user", "content": f"Conversation {c}, question {turn}: why? " * (3 + turn)}
                )
                await asyncio.sleep(0.05)
                await settle(fleet)
                body = {"model": MODEL, "messages": msgs, "max_tokens": 6, **extra}
                async with s.post(fleet.url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    data = await r.json()
                    pred = int(r.headers["x-kvroute-cached-tokens"])
                    ebs = r.headers["x-kvroute-engine-block-size"]
                out.append((pred, data["usage"]["prompt_tokens_details"]["cached_tokens"], ebs))
                msgs.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return out


@pytest.mark.parametrize("engine_bs", [16, 32, 128])
async def test_predicted_cached_tokens_in_whole_engine_blocks(
    fleet: Fleet, tokenizer: Tokenizer, engine_bs: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Fix 2: the router (block size 16) learns each engine's block size (``cache_config_info`` and
    ``BlockStored.block_size``) and predicts hits in whole engine blocks: over a multi-turn run the
    predicted ``cached_tokens`` equal the engine's, request by request; the explanation header names
    the engine's block size; a differing size is logged once per backend."""
    caplog.set_level("WARNING", logger="kvroute.server")
    for _ in range(2):
        await fleet.engine(tokenizer, block_size=engine_bs)
    await fleet.start(tokenizer)
    assert fleet.router is not None
    kv = fleet.router.state.kv
    assert await eventually(lambda: all(kv.engine_block_size(i) == engine_bs for i in range(2)))
    rows = await conversation_run(fleet, turns=4, convs=3)
    assert [p for p, _, _ in rows] == [r for _, r, _ in rows]
    assert sum(r for _, r, _ in rows) > 0 and all(r % engine_bs == 0 for _, r, _ in rows)
    assert {h for _, _, h in rows} == {str(engine_bs)}
    lines = [r for r in caplog.records if "caches in blocks of" in r.getMessage()]
    assert len(lines) == (0 if engine_bs == 16 else 2)


async def direct_chat(eng: EmulatorServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{eng.port}/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "max_tokens": 4},
        ) as r,
    ):
        assert r.status == 200
        out: dict[str, Any] = await r.json()
        return out


@pytest.mark.parametrize("buffer_steps", [10_000, 2], ids=["whole-buffer", "buffer-trimmed"])
async def test_router_started_after_the_engines(
    fleet: Fleet, tokenizer: Tokenizer, buffer_steps: int
) -> None:
    """Fix 5: the engines take traffic, then the router starts. It asks for the replay on subscribe
    and its start waits for it: the first request is predicted exactly what the engine serves from
    cache and goes to the engine holding its prefix. With a replay buffer of 2 batches (vLLM's
    ``buffer_steps``) the buffer no longer starts at 0: the view is partial, counted
    (``kvroute_kv_event_partial_replays``), and the backend routes on ``max(exact, approximate)``."""
    for _ in range(2):
        await fleet.engine(tokenizer, buffer_steps=buffer_steps)
    warm = fleet.engines[1]
    convs = [[SYSTEM, {"role": "user", "content": f"Tell me about river number {i}. " * 6}] for i in range(4)]
    for msgs in convs:
        await direct_chat(warm, msgs)
    pub = warm.publisher
    assert pub is not None and pub.seq > 2
    await fleet.start(tokenizer)
    router = fleet.router
    assert router is not None
    sub = router.subscribers[1]
    assert sub.synced.is_set()
    async with aiohttp.ClientSession() as s:
        predicted, reported, backend, _ = await chat(s, fleet.url, convs[-1])
        async with s.get(fleet.url + "/metrics") as r:
            metrics = await r.text()
    now = router.state.clock()
    partial_line = f'kvroute_kv_event_partial_replays_total{{backend="{fleet.specs[1].url}"}}'
    if buffer_steps > pub.seq:
        assert backend == fleet.specs[1].url and predicted == reported > 0
        assert sub.partial == 0 and router.state.kv.mode(1, now) == "exact"
        assert f"{partial_line} 0.0" in metrics
    else:
        assert sub.partial == 1 and router.state.kv.mode(1, now) == "recovering"
        assert f"{partial_line} 1.0" in metrics
        assert predicted <= reported


async def test_late_all_blocks_cleared_is_bounded_by_the_shortfall_evidence(
    fleet: Fleet, tokenizer: Tokenizer
) -> None:
    """Fix 4: ``POST /reset_prefix_cache`` on the emulator drops its cache at once but publishes
    ``AllBlocksCleared`` only with its next step, as vLLM. The first request after the reset is
    predicted a hit and gets 0: that shortfall is evidence, counted on /metrics; with the engine's
    next step the event arrives, and the request after is predicted exactly again."""
    for _ in range(2):
        await fleet.engine(tokenizer)
    url = await fleet.start(tokenizer)
    router = fleet.router
    assert router is not None
    msgs = [SYSTEM, {"role": "user", "content": "Describe the water cycle in detail. " * 5}]
    async with aiohttp.ClientSession() as s:
        await chat(s, url, msgs)
        await settle(fleet)
        predicted, reported, holder, _ = await chat(s, url, msgs)
        assert predicted == reported > 0
        index = [spec.url for spec in fleet.specs].index(holder)
        eng = fleet.engines[index]
        await settle(fleet)
        pub = eng.publisher
        assert pub is not None
        seq = pub.seq
        async with s.post(f"http://127.0.0.1:{eng.port}/reset_prefix_cache") as r:
            assert r.status == 200
        await asyncio.sleep(0.2)
        assert pub.seq == seq  # no step yet: AllBlocksCleared not published
        assert eng.model.stats().cached_blocks == 0
        p1, r1, b1, _ = await chat(s, url, msgs)
        assert b1 == holder and p1 == predicted and r1 == 0  # the late event's damage: one request
        assert router.state.kv.shortfalls == {index: 1}
        await settle(fleet)
        assert pub.seq > seq
        p2, r2, _, _ = await chat(s, url, msgs)
        assert p2 == r2
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    assert f'kvroute_kv_cached_shortfalls_total{{backend="{holder}"}} 1.0' in metrics


async def test_router_metrics_name_the_scraper(fleet: Fleet, tokenizer: Tokenizer) -> None:
    """Fix 3 on /metrics: a single router is its machine's scraper; idle, its interval grows."""
    await fleet.engine(tokenizer)
    url = await fleet.start(tokenizer)
    await asyncio.sleep(1.0)
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    assert "kvroute_scraper 1.0" in text and "kvroute_scrapes_total" in text
    line = next(x for x in text.splitlines() if x.startswith("kvroute_scrape_interval_seconds"))
    assert float(line.split()[-1]) > 0.05
