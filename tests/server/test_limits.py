"""Limits on clients over real sockets (:mod:`kvroute.server.wire.limits`): the connection cap (a JSON
503, not a reset), the head, body and keep-alive timeouts (a partial head, a half-sent body and an idle
connection are closed), the write timeout (a client that stops reading its stream: the engine's
request is cancelled and the lease released), the prompt-token cap (a 400 before hashing, from the
backends' ``max_model_len`` when they list one) and large bodies parsed off the event loop. The
timeouts are configured small; the tests only bound them generously."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvroute.blocks import hash_blocks
from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

from .fakes import FakeEngine

WAIT_S = 20.0  # a generous bound on anything that a timeout of ~0.3 s must bring about

Make = Callable[..., Awaitable[tuple[RouterServer, int]]]


@pytest.fixture
async def make_router(tokenizer: Tokenizer) -> AsyncIterator[Make]:
    """``await make(url=None, engine=None, **config)``: a router on a free port in front of the
    engine at ``url``, else of ``engine`` (a :class:`FakeEngine`, started and stopped here; a new one
    by default); returns (router, port)."""
    started: list[Any] = []

    async def make(
        url: str | None = None, engine: FakeEngine | None = None, **kw: Any
    ) -> tuple[RouterServer, int]:
        if url is None:
            engine = engine or FakeEngine()
            url = await engine.start()
            started.append(engine)
        cfg = RouterConfig(backends=(BackendSpec(url),), port=0, health_interval_s=0.2, **kw)
        server = RouterServer(cfg, tokenizer=tokenizer)
        started.append(server)
        await server.start()
        return server, int(server.url.rsplit(":", 1)[1])

    yield make
    for thing in reversed(started):
        await thing.stop()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 answer with a Content-Length: status, headers (lower-case names), body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), WAIT_S)
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """The peer closed the connection (EOF or reset) within ``WAIT_S``."""
    try:
        return await asyncio.wait_for(reader.read(65536), WAIT_S) == b""
    except ConnectionResetError:
        return True


def json_error(body: bytes) -> dict[str, Any]:
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err  # type: ignore[no-any-return]


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


LIVEZ = b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"


async def test_connection_beyond_the_cap_gets_a_json_503_and_a_later_one_is_served(make_router: Make) -> None:
    _, port = await make_router(max_connections=2)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    await asyncio.sleep(0.05)  # both accepted
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(LIVEZ)
    status, headers, body = await read_answer(reader)
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert "max_connections=2" in json_error(body)["message"]
    assert await closed(reader)
    writer.close()
    for _, w in held:
        w.close()
    await asyncio.sleep(0.1)  # the router sees them go
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(LIVEZ)
    status, _, _ = await read_answer(reader)
    assert status == 200
    writer.close()


async def test_partial_head_is_answered_408_and_closed(make_router: Make) -> None:
    _, port = await make_router(header_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    status, headers, body = await read_answer(reader)
    assert status == 408 and headers["connection"] == "close"
    assert "head" in json_error(body)["message"]
    assert await closed(reader)
    writer.close()


async def test_idle_keepalive_connection_is_closed(make_router: Make) -> None:
    _, port = await make_router(keepalive_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    assert await closed(reader)  # never sent a byte
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(LIVEZ)
    status, _, _ = await read_answer(reader)
    assert status == 200
    assert await closed(reader)  # idle after its answer
    writer.close()


async def test_half_sent_body_is_answered_408_and_closed(make_router: Make) -> None:
    server, port = await make_router(body_timeout_s=0.3)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"prompt": '
    )
    status, headers, body = await read_answer(reader)
    assert status == 408 and headers["connection"] == "close"
    assert "body" in json_error(body)["message"]
    assert await closed(reader)
    writer.close()
    assert server.proxy.inflight == 0


class BigStream(FakeEngine):
    """A :class:`FakeEngine` whose streams are 64 KiB SSE events back to back (a client that does
    not read fills every buffer on the way within a few hundred of them)."""

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if not body.get("stream"):
            return await super().generate(request)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = (
            b"data: " + orjson.dumps({"id": "1", "choices": [{"index": 0, "text": "x" * 65536}]}) + b"\n\n"
        )
        self.active += 1
        try:
            while True:
                await resp.write(event)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


def counters_zero(router: RouterServer) -> bool:
    return all(
        (b.waiting, b.running, b.queued_prefill, b.blocks, b.pending) == (0, 0, 0, 0, 0)
        for b in router.state.backends
    )


async def until(cond: Callable[[], bool]) -> bool:
    for _ in range(int(WAIT_S / 0.05)):
        if cond():
            return True
        await asyncio.sleep(0.05)
    return cond()


async def test_client_that_stops_reading_its_stream_cancels_the_engine_and_releases_the_lease(
    make_router: Make,
) -> None:
    engine = BigStream()
    server, port = await make_router(engine=engine, write_timeout_s=0.3)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills fast: then it reads nothing
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    body = orjson.dumps({"prompt": "hi", "max_tokens": 10_000_000, "stream": True})
    writer.write(post("/v1/completions", body))
    assert await until(lambda: engine.active == 1)
    assert await until(lambda: engine.cancelled == 1 and engine.active == 0)
    assert await until(lambda: counters_zero(server) and server.proxy.inflight == 0)
    assert server.state.backends[0].healthy  # the client's doing: never the backend's
    writer.close()


async def test_client_that_never_reads_a_buffered_answer_is_closed(make_router: Make) -> None:
    server, port = await make_router(write_timeout_s=0.3)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(post("/v1/completions", orjson.dumps({"prompt": "hi", "max_tokens": 20_000_000})))
    assert await until(lambda: server.client_connections == 1)
    assert await until(lambda: server.client_connections == 0)  # a 20 MB answer never taken: closed
    assert counters_zero(server) and server.state.backends[0].healthy
    writer.close()


async def test_prompt_over_the_config_cap_is_400_and_never_forwarded(make_router: Make) -> None:
    engine = FakeEngine()  # its /v1/models lists no max_model_len
    _, port = await make_router(engine=engine, max_prompt_tokens=1000)
    async with aiohttp.ClientSession() as s:
        for prompt in (list(range(1001)), "hello " * 3000):
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": prompt}) as r:
                assert r.status == 400
                err = await r.json()
                assert err["error"]["code"] == "context_length_exceeded"
                assert "at most 1000" in err["error"]["message"]
        async with s.post(
            f"http://127.0.0.1:{port}/v1/completions", json={"prompt": list(range(1000)), "max_tokens": 1}
        ) as r:
            assert r.status == 200
    assert engine.requests == 1


async def test_prompt_cap_comes_from_the_backends_max_model_len(
    make_router: Make, tokenizer: Tokenizer
) -> None:
    cost = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
    settings = EmulatorSettings(
        model_name="emu", engine=EngineConfig(num_kv_blocks=4096, max_model_len=2048), time_scale=50.0
    )
    eng = EmulatorServer(settings, cost, tokenizer)
    port_e = await eng.start("127.0.0.1", 0)
    try:
        await _over_max_model_len(
            eng, *await make_router(f"http://127.0.0.1:{port_e}", models_interval_s=0.1)
        )
    finally:
        await eng.stop()


async def _over_max_model_len(eng: EmulatorServer, server: RouterServer, port: int) -> None:
    assert await until(lambda: server.state.pools.max_model_len() == 2048)
    async with aiohttp.ClientSession() as s:
        body = {"model": "emu", "prompt": list(range(1, 2049)), "max_tokens": 1}
        async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
            assert r.status == 400
            assert "this router takes at most 2047" in (await r.json())["error"]["message"]
    assert eng.model.stats().prefix_query_tokens == 0  # the engine never saw it


@pytest.mark.parametrize("mode", ["process", "thread"])
async def test_large_token_id_body_is_parsed_capped_and_hashed_off_the_loop(
    make_router: Make, mode: str
) -> None:
    engine = FakeEngine()
    seen: list[dict[str, object]] = []
    engine.on_request = seen.append
    server, port = await make_router(
        engine=engine, parse_offload=mode, parse_offload_bytes=4096, max_prompt_tokens=50_000, block_size=16
    )
    ids = [(i * 7919) % 150_000 for i in range(40_000)]
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with s.post(url, json={"prompt": ids, "max_tokens": 1}) as r:
            assert r.status == 200
        async with s.post(url, json={"prompt": ids + ids, "max_tokens": 1}) as r:  # over: from the worker
            assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
        async with s.post(url, json={"prompt": [*ids[:-1], 2**32], "max_tokens": 1}) as r:
            assert r.status == 400 and "token ids" in (await r.json())["error"]["message"]
    assert server.proxy.parser.offloaded == 3
    assert seen == [{"prompt": ids, "max_tokens": 1}]  # forwarded unchanged
    chain = hash_blocks(ids, 16)
    kv = server.state.kv
    assert kv.match(chain, server.state.clock())[0] == len(chain)  # routed on the chain hashed off the loop


async def test_limit_flags_and_yaml_keys(tmp_path: Any) -> None:
    import argparse

    from kvroute.commands.serve import add_arguments, config_from_args
    from kvroute.commands.settings import load_config_file
    from kvroute.errors import UserError

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--backend", "http://127.0.0.1:1", "--max-connections", "7", "--header-timeout", "1.5",
         "--body-timeout", "2", "--keepalive-timeout", "3", "--write-timeout", "4",
         "--max-prompt-tokens", "99", "--parse-offload", "thread"]
    )  # fmt: skip
    cfg = config_from_args(args)
    assert (cfg.max_connections, cfg.header_timeout_s, cfg.body_timeout_s) == (7, 1.5, 2.0)
    assert (cfg.keepalive_timeout_s, cfg.write_timeout_s, cfg.max_prompt_tokens) == (3.0, 4.0, 99)
    assert cfg.parse_offload == "thread"
    f = tmp_path / "c.yaml"
    f.write_text("backends: [http://127.0.0.1:1]\nmax_connections: 3\nwrite_timeout_s: 0.5\n")
    cfg = load_config_file(f)
    assert (cfg.max_connections, cfg.write_timeout_s) == (3, 0.5)
    f.write_text("backends: [http://127.0.0.1:1]\nmax_connections: 0\n")
    with pytest.raises(UserError, match="max_connections"):
        load_config_file(f).validate()


@pytest.fixture
async def pd_router(tokenizer: Tokenizer) -> AsyncIterator[tuple[Any, BigStream, int]]:
    """A P/D router (no prefill instance: the decode instance prefills) before a FakeEngine, with
    small limits; (router, engine, port)."""
    from kvroute.engine.transfer import TransferModel
    from kvroute.server.pd import PDBackend, PDConfig, PDServer
    from kvroute.server.wire.limits import ClientLimits

    engine = BigStream()
    url = await engine.start()
    limits = ClientLimits(max_connections=2, header_timeout_s=0.3, body_timeout_s=0.3, write_timeout_s=0.3)
    cfg = PDConfig((), (PDBackend(url),), limits=limits, max_prompt_tokens=1000)
    cost = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
    router = PDServer(cfg, tokenizer, cost, TransferModel(100_000.0, 100e9))
    port = await router.start("127.0.0.1", 0)
    try:
        yield router, engine, port
    finally:
        await router.stop()
        await engine.stop()


async def test_pd_mode_keeps_the_same_limits(pd_router: tuple[Any, BigStream, int]) -> None:
    _, engine, port = pd_router
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a partial head: 408
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    status, _, _ = await read_answer(reader)
    assert status == 408 and await closed(reader)
    writer.close()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a half-sent body: 408
    writer.write(post("/v1/completions", b'{"prompt": "hello", "max_tokens": 1}')[:-5])
    status, _, _ = await read_answer(reader)
    assert status == 408 and await closed(reader)
    writer.close()
    body = {"prompt": list(range(1001))}  # over the prompt cap: 400, never forwarded
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r,
    ):
        assert r.status == 400 and (await r.json())["error"]["code"] == "context_length_exceeded"
    assert engine.requests == 0
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]  # the cap: 503
    await asyncio.sleep(0.05)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    status, _, _ = await read_answer(reader)
    assert status == 503
    writer.close()
    for _, w in held:
        w.close()


async def test_pd_mode_client_that_stops_reading_cancels_the_decode(
    pd_router: tuple[Any, BigStream, int],
) -> None:
    router, engine, port = pd_router
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(
        post("/v1/completions", orjson.dumps({"prompt": "hi", "max_tokens": 10_000_000, "stream": True}))
    )
    assert await until(lambda: engine.active == 1)
    assert await until(lambda: engine.cancelled == 1 and engine.active == 0)
    assert await until(lambda: not router.pools["decode"][0].inflight)  # the lease is released
    writer.close()
