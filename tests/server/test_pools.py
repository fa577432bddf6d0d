"""Model pools, LoRA adapters and SGLang-flavoured engines, end to end over real sockets: the router in
front of in-process emulated engines (HTTP and ZMQ KV events on free loopback ports)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest

from kvroute.blocks import extra_key, hash_blocks
from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.cluster import free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
BS = 16


class Fleet:
    def __init__(self) -> None:
        self.engines: list[EmulatorServer] = []
        self.specs: list[BackendSpec] = []
        self.router: RouterServer | None = None

    async def engine(
        self,
        tokenizer: Tokenizer,
        model: str,
        *,
        lora: tuple[str, ...] = (),
        flavor: str = "vllm",
        page_size: int = 0,
    ) -> EmulatorServer:
        pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        fmt = "sglang" if flavor == "sglang" else "array"
        settings = EmulatorSettings(
            model_name=model,
            engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
            time_scale=20.0,
            kv_events=KVEventsSettings(pub, fmt, replay_endpoint=rep, page_size=page_size),
            lora_modules=lora,
            flavor=flavor,
        )
        eng = EmulatorServer(settings, COST, tokenizer)
        port = await eng.start("127.0.0.1", 0)
        self.engines.append(eng)
        self.specs.append(BackendSpec(f"http://127.0.0.1:{port}", pub, rep))
        return eng

    async def start(self, tokenizer: Tokenizer, **kw: object) -> str:
        cfg = RouterConfig(backends=tuple(self.specs), port=0, health_interval_s=0.2, **kw)  # type: ignore[arg-type]
        self.router = RouterServer(cfg, tokenizer=tokenizer)
        url = await self.router.start()
        pools = self.router.state.pools
        assert await eventually(lambda: all(pools.served_by(i) is not None for i in range(len(self.specs))))
        return url

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


async def eventually(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


def sent(router: RouterServer) -> list[int]:
    return [b.requests_total for b in router.state.backends]


async def complete(
    s: aiohttp.ClientSession, url: str, model: str, prompt: Sequence[int], max_tokens: int = 2
) -> tuple[int, dict]:  # type: ignore[type-arg]
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens}
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def predicted(router: RouterServer, backend: int, ids: Sequence[int], adapter: str | None = None) -> int:
    """The router's exact KV view's cached prefix of ``ids`` on ``backend``, tokens (as it plans)."""
    chain = hash_blocks(ids, BS, extra_key(adapter))
    matched = router.state.kv.match(chain, router.state.clock())[backend]
    return min(matched, (len(ids) - 1) // BS) * BS


async def test_two_model_fleet_with_an_sglang_backend(fleet: Fleet, tokenizer: Tokenizer) -> None:
    """alpha on two vLLM-flavoured engines, beta on one SGLang-flavoured engine (1-token pages, as
    SGLang's default): each request goes to its model's pool, an unknown model is a 404 naming the
    served ones, /v1/models lists the union; the SGLang engine's load is read from SGLang's metric
    names (detected) and its KV events give exact hits."""
    await fleet.engine(tokenizer, "alpha")
    await fleet.engine(tokenizer, "alpha")
    beta = await fleet.engine(tokenizer, "beta", flavor="sglang", page_size=1)
    url = await fleet.start(tokenizer, policy="lmetric")
    router = fleet.router
    assert router is not None
    ids = tokenizer.encode("A long shared preamble about the history of tea and its trade routes. " * 12)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/models") as r:
            assert r.status == 200
            assert sorted(m["id"] for m in (await r.json())["data"]) == ["alpha", "beta"]
        status, body = await complete(s, url, "gamma", ids)
        assert status == 404
        err = body["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "served models: alpha, beta" in err["message"]
        for i in range(4):
            before = sent(router)
            status, _ = await complete(s, url, "alpha", [*ids, 100 + i])
            assert status == 200
            after = sent(router)
            assert after[2] == before[2] and sum(after) == sum(before) + 1  # never on beta's engine
        before = sent(router)
        status, _ = await complete(s, url, "beta", ids)
        assert status == 200 and sent(router)[2] == before[2] + 1
        # The SGLang engine's one-token pages, re-blocked into the router's blocks: exact.
        full = len(ids) // BS * BS
        assert await eventually(lambda: predicted(router, 2, [*ids, 1]) == full)
        second = [*ids, *tokenizer.encode(" And then the second question follows here.")]
        expect = predicted(router, 2, second)
        status, body = await complete(s, url, "beta", second)
        assert status == 200
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == expect == full
        # Load from SGLang's names: the engine kind is detected, a long request is seen running.
        assert await eventually(lambda: router.monitor.engines == {0: "vllm", 1: "vllm", 2: "sglang"})
        task = asyncio.create_task(complete(s, url, "beta", [7] * 40, max_tokens=2000))
        state = router.state.backends[2]
        assert await eventually(lambda: beta.model.stats().running == 1)
        assert await eventually(lambda: state.scraped is not None and state.scraped.running == 1)
        assert state.scraped is not None and state.scraped.num_kv_blocks == 4096
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert fleet.router is not None


async def test_lora_adapter_pool_and_cache_key(fleet: Fleet, tokenizer: Tokenizer) -> None:
    """Adapter ``sql`` is loaded on engine 0 only: its requests go there, its blocks are keyed by the
    adapter (a second turn hits exactly as predicted), and a base-model request with the same tokens
    shares none of them."""
    await fleet.engine(tokenizer, "base", lora=("sql",))
    await fleet.engine(tokenizer, "base")
    url = await fleet.start(tokenizer, policy="lmetric")
    router = fleet.router
    assert router is not None
    assert router.state.pools.is_adapter("sql") and not router.state.pools.is_adapter("base")
    ids = tokenizer.encode("SELECT name, price FROM products WHERE price > 10 ORDER BY price; " * 10)
    full = len(ids) // BS * BS
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            before = sent(router)
            status, _ = await complete(s, url, "sql", ids)
            assert status == 200 and sent(router)[0] == before[0] + 1
        assert await eventually(lambda: predicted(router, 0, [*ids, 1], "sql") == full)
        second = [*ids, *tokenizer.encode(" -- and now join the orders table")]
        expect = predicted(router, 0, second, "sql")
        status, body = await complete(s, url, "sql", second)
        assert status == 200
        assert body["model"] == "sql"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == expect == full
        # Same tokens for the base model: no shared blocks anywhere, as predicted.
        assert predicted(router, 0, second) == predicted(router, 1, second) == 0
        status, body = await complete(s, url, "base", second)
        assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        status, body = await complete(s, url, "nope", ids)
        assert status == 404 and "served models: base, sql" in body["error"]["message"]


async def test_declared_models_need_no_listing(fleet: Fleet, tokenizer: Tokenizer) -> None:
    """Models declared in the config are used as they are (the engine's /v1/models is not read), and
    a declared model whose only backend is down is a 503, not a 404."""
    await fleet.engine(tokenizer, "alpha")
    dead = BackendSpec(f"http://127.0.0.1:{free_port()}", models=("omega",))
    fleet.specs[0] = BackendSpec(fleet.specs[0].url, models=("alpha",))
    fleet.specs.append(dead)
    url = await fleet.start(tokenizer, eject_after=1)
    router = fleet.router
    assert router is not None
    served = router.state.pools.served_by(0)
    assert served is not None and served.declared
    assert await eventually(lambda: not router.state.backends[1].healthy)
    async with aiohttp.ClientSession() as s:
        status, body = await complete(s, url, "omega", [1, 2, 3])
        assert status == 503 and "omega" in body["error"]["message"]
        status, _ = await complete(s, url, "alpha", [1, 2, 3])
        assert status == 200
        status, body = await complete(s, url, "zeta", [1, 2, 3])
        assert status == 404 and body["error"]["code"] == "model_not_found"
