"""The router's path back from the engine, end to end over real sockets: raw client bytes in, the
router (``RouterServer``) in the middle, and either a real emulated engine (it answers ``Expect:
100-continue`` with an interim ``100`` like vLLM's uvicorn does, and names each completion
``cmpl-<X-Request-Id>``) or a raw upstream that records every header it receives."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Sequence

import aiohttp
import orjson
import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

from .rawupstream import CLOSE, RawRequest, RawUpstream, Step, ok

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
MODELS = b'{"object":"list","data":[{"id":"emu","object":"model"}]}'


async def eventually(cond, timeout_s: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())


async def raw_exchange(port: int, request: bytes, timeout_s: float = 10.0) -> bytes:
    """Send ``request`` as is on a fresh connection; everything the router answers until it closes
    the connection (every request here says ``Connection: close``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        async with asyncio.timeout(timeout_s):
            return await reader.read(-1)
    finally:
        writer.close()


def post(body: dict[str, object], *headers: str) -> bytes:
    data = orjson.dumps(body)
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: router",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data


def final_answer(raw: bytes) -> tuple[int, list[int], bytes]:
    """(final status, interim statuses before it, final body with chunked framing removed)."""
    interim = []
    while True:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if 100 <= status < 200:
            interim.append(status)
            raw = rest
            continue
        if b"transfer-encoding: chunked" in head.lower():
            out = b""
            while rest:
                size, _, rest = rest.partition(b"\r\n")
                n = int(size.split(b";")[0], 16)
                out += rest[:n]
                rest = rest[n + 2 :]
                if n == 0:
                    break
            rest = out
        return status, interim, rest


def completion_ids(body: bytes) -> set[str]:
    return set(re.findall(rb'"id":"(cmpl-[^"]*)"', body))  # type: ignore[arg-type]


async def start_engine(tokenizer: Tokenizer, time_scale: float = 50.0) -> EmulatorServer:
    """An emulated engine serving ``emu`` on loopback (``time_scale``: model seconds per second)."""
    settings = EmulatorSettings(
        model_name="emu",
        engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
        time_scale=time_scale,
    )
    eng = EmulatorServer(settings, COST, tokenizer)
    await eng.start("127.0.0.1", 0)
    return eng


@pytest.fixture
async def engine(tokenizer: Tokenizer) -> AsyncIterator[EmulatorServer]:
    eng = await start_engine(tokenizer)
    yield eng
    await eng.stop()


async def start_router(tokenizer: Tokenizer, url: str, **kw: object) -> RouterServer:
    cfg = RouterConfig(backends=(BackendSpec(url),), port=0, health_interval_s=0.2)
    router = RouterServer(cfg, tokenizer=tokenizer, **kw)  # type: ignore[arg-type]
    await router.start()
    assert await eventually(lambda: router.state.backends[0].healthy)
    return router


def port_of(router: RouterServer) -> int:
    return int(router.url.rsplit(":", 1)[1])


async def ordinary(router: RouterServer, rid: str, stream: bool = False) -> None:
    """An ordinary client: its answer is a 200 that names its own request id, and only that."""
    body = {"model": "emu", "prompt": f"hello {rid}", "max_tokens": 4, "stream": stream}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s,
        s.post(router.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}) as r,
    ):
        data = await r.read()
        assert r.status == 200, data
    assert completion_ids(data) == {f"cmpl-{rid}".encode()}, data


async def test_expect_100_continue_never_hands_a_completion_to_another_client(
    tokenizer: Tokenizer, engine: EmulatorServer
) -> None:
    """The attack: ``Expect: 100-continue`` from one client; the engine's interim 100 was taken
    as the answer and its 200 was served to the next client. Now the router answers the 100 itself
    and forwards no ``Expect``: each client reads its own completion."""
    router = await start_router(tokenizer, f"http://127.0.0.1:{engine.port}")
    try:
        port = port_of(router)
        for n in range(3):
            for stream in (False, True):
                rid = f"userone{n}{stream:d}"
                body = {"model": "emu", "prompt": "hello", "max_tokens": 8, "stream": stream}
                raw = await raw_exchange(port, post(body, "Expect: 100-continue", f"X-Request-Id: {rid}"))
                status, interim, data = final_answer(raw)
                assert (status, interim) == (200, [100]), raw[:300]  # the router's own 100, then the answer
                assert completion_ids(data) == {f"cmpl-{rid}".encode()}, data
                await ordinary(router, f"usertwo{n}{stream:d}", stream=stream)
        assert router.state.backends[0].healthy
    finally:
        await router.stop()


async def test_expect_attack_with_a_long_stream_never_ejects_the_backend(
    tokenizer: Tokenizer, engine: EmulatorServer
) -> None:
    """The streamed variant with a long output: the stream used to flow into the pooled connection
    until reading paused, and the next request waited for a head until the backend was ejected."""
    router = await start_router(tokenizer, f"http://127.0.0.1:{engine.port}")
    try:
        port = port_of(router)
        body = {"model": "emu", "prompt": "hello", "max_tokens": 12000, "stream": True}
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(post(body, "Expect: 100-continue", "X-Request-Id: attacker"))
        await writer.drain()
        await asyncio.sleep(1.5)  # the attacker reads nothing: over 1 MiB of stream waits
        for i in range(3):
            await ordinary(router, f"victim{i}")
        writer.close()
        assert router.state.backends[0].healthy
        assert router.state.counters.upstream_errors == 0
    finally:
        await router.stop()


def recording_upstream(
    final: Sequence[Step] | None = None, posts: list[RawRequest] | None = None
) -> RawUpstream:
    """A raw engine: ``/v1/models`` lists ``emu``; other GETs get an empty 200; a POST gets its own
    completion (or ``final`` when given). With ``posts``, every POST is appended there and only the
    first one gets ``final``."""

    def script(req: RawRequest) -> Sequence[Step]:
        if req.head.startswith(b"GET /v1/models"):
            return [ok(MODELS)]
        if req.head.startswith(b"GET"):
            return [ok(b"", "text/plain")]
        if posts is not None:
            posts.append(req)
        if final is not None and (posts is None or len(posts) == 1):
            return final
        rid = (req.values("x-request-id") or ["?"])[0]
        return [ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode())]

    return RawUpstream(script)


HOSTILE_HEADERS = (
    "X-Request-ID: client-chosen-id",
    "x-request-id: second-client-id",
    "Connection: close, X-Secret-Hop",
    "X-Secret-Hop: must-not-pass",
    "Keep-Alive: timeout=5",
    "Proxy-Connection: keep-alive",
    "TE: trailers",
    "Trailer: X-Checksum",
    "Upgrade: h2c",
    "HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA",
    "Proxy-Authorization: Basic cHJveHk6c2VjcmV0",
    "Proxy-Authenticate: Basic",
    "Expect: 100-continue",
    "X-Kept: yes",
)
DROPPED = (
    "connection",
    "x-secret-hop",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "http2-settings",
    "proxy-authorization",
    "proxy-authenticate",
    "expect",
    "transfer-encoding",
)


async def test_hop_by_hop_headers_never_reach_the_engine_and_one_request_id_does(
    tokenizer: Tokenizer,
) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, *HOSTILE_HEADERS))
            status, _, data = final_answer(raw)
            assert status == 200, raw
            (sent,) = [r for r in up.requests if r.head.startswith(b"POST")]
            names = [k.lower() for k, _ in sent.headers]
            for name in DROPPED:
                assert name not in names, (name, sent.head)
            assert sent.values("X-Kept") == ["yes"]
            (rid,) = sent.values("x-request-id")  # exactly one line: the id the router validated and logs
            assert rid == "client-chosen-id" == orjson.loads(data)["id"].removeprefix("cmpl-")
            assert completion_ids(data) == {f"cmpl-{rid}".encode()}
        finally:
            await router.stop()


@pytest.mark.parametrize("given", ["X-Request-ID: " + "a" * 200, "X-REQUEST-ID: caf\xe9"])
async def test_an_invalid_client_id_in_any_case_never_reaches_the_engine(
    tokenizer: Tokenizer, given: str
) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, given))
            assert final_answer(raw)[0] == 200, raw
            (sent,) = [r for r in up.requests if r.head.startswith(b"POST")]
            (rid,) = sent.values("x-request-id")
            assert re.fullmatch("[0-9a-f]{32}", rid), rid  # the router's own
        finally:
            await router.stop()


async def test_a_valid_client_id_in_canonical_case_is_the_one_forwarded(tokenizer: Tokenizer) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, "X-Request-ID: mine-42"))
            assert final_answer(raw)[0] == 200
            (sent,) = [r for r in up.requests if r.head.startswith(b"POST")]
            assert sent.values("x-request-id") == ["mine-42"]
        finally:
            await router.stop()


async def test_one_traceparent_reaches_the_engine_the_routers(tokenizer: Tokenizer) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra (opentelemetry-sdk) is not installed")
    from opentelemetry.sdk.trace import TracerProvider

    client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url, tracer_provider=TracerProvider())
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, f"TraceParent: {client}"))
            assert final_answer(raw)[0] == 200
            (sent,) = [r for r in up.requests if r.head.startswith(b"POST")]
            (tp,) = sent.values("traceparent")
            assert tp.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-") and tp != client  # the router's span
        finally:
            await router.stop()


async def test_a_101_from_the_engine_is_a_clean_502_and_the_backend_stays(tokenizer: Tokenizer) -> None:
    upgrade = [
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n\x00\x00",
        0.2,
    ]
    async with recording_upstream(upgrade) as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, "X-Request-Id: up101"))
            status, interim, data = final_answer(raw)
            assert (status, interim) == (502, [])
            assert orjson.loads(data)["error"]["type"] == "upstream_error"
            assert router.state.backends[0].healthy
        finally:
            await router.stop()


def sse_events(stream: bytes) -> list[str]:
    """The data of each event a Server-Sent Events client dispatches from ``stream`` (lines end in
    LF here; an event ends at a blank line; its ``data:`` lines joined by LF)."""
    events, data = [], []
    for line in stream.decode().split("\n"):
        if not line:
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    return events


@pytest.mark.parametrize(
    "cut", [b"", b'data: {"id":"cmpl-cut","choices":[{"te', b'data: {"id":"cmpl-cut"}\n']
)
async def test_a_stream_broken_inside_an_event_ends_with_an_error_event_of_its_own(
    tokenizer: Tokenizer, cut: bytes
) -> None:
    """An engine's stream that breaks off after a whole event and part of the next (cut inside a
    line, or after a line but before the blank one): the router's error event used to be glued to
    the unfinished one (``...{"tedata: {"error":...}``), so the client's SSE parser never saw it."""
    sent = b'data: {"id":"cmpl-cut","choices":[{"text":"a"}]}\n\n' + cut
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with recording_upstream([head + b"%x\r\n%s\r\n" % (len(sent), sent), 0.05, CLOSE]) as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4, "stream": True}
            status, _, data = final_answer(await raw_exchange(port_of(router), post(body)))
            assert status == 200 and data.startswith(sent), data
            *_, error, done = sse_events(data)
            assert orjson.loads(error)["error"]["type"] == "upstream_error", data
            assert done == "[DONE]"
            assert router.state.backends[0].healthy
        finally:
            await router.stop()


async def test_an_unknown_expectation_is_a_json_417_and_never_reaches_the_engine(
    tokenizer: Tokenizer,
) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            raw = await raw_exchange(port_of(router), post(body, "Expect: 100-continue-please"))
            status, interim, data = final_answer(raw)
            assert (status, interim) == (417, [])
            assert orjson.loads(data)["error"]["code"] == 417
            assert not [r for r in up.requests if r.head.startswith(b"POST")]
        finally:
            await router.stop()


P_ANSWER = ok(
    b'{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x"}],'
    b'"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"p"},'
    b'"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}}'
)


def engine_script(post_steps):  # type: ignore[no-untyped-def]
    """A raw engine for the P/D router: ``post_steps(rid)`` answers a POST."""

    def script(req: RawRequest) -> Sequence[Step]:
        if req.head.startswith(b"GET /v1/models"):
            return [ok(MODELS)]
        if req.head.startswith(b"GET"):
            return [ok(b"", "text/plain")]
        return post_steps((req.values("x-request-id") or ["?"])[0])

    return script


async def pd_router(tokenizer: Tokenizer, p_url: str, *d_urls: str, **kw: object):  # type: ignore[no-untyped-def]
    """A started P/D router over P ``p_url`` and the D ``d_urls`` (``kw``: to ``PDServer``)."""
    from kvroute.engine.cost import LinearCostModel
    from kvroute.engine.transfer import TransferModel
    from kvroute.server.pd import PDBackend, PDConfig, PDServer

    cost = LinearCostModel("test-linear", decode_s_per_seq=0.01, prefill_s_per_token=2e-5)
    cfg = PDConfig((PDBackend(p_url),), tuple(PDBackend(u) for u in d_urls), conditional=False)
    router = PDServer(cfg, tokenizer, cost, TransferModel(100_000.0, 100e9), **kw)  # type: ignore[arg-type]
    port = await router.start("127.0.0.1", 0)
    return router, port


PD_BODY = {"model": "emu", "prompt": "The quick brown fox " * 20, "max_tokens": 4}


async def test_pd_router_never_serves_a_late_decode_response_to_the_next_client(tokenizer: Tokenizer) -> None:
    """The P/D router's upstream client: a decode engine that sends a stray response while the
    connection idles in the pool must not answer the next client (aiohttp's client served it)."""
    stray = ok(b'{"id":"cmpl-stray","choices":[{"text":"not yours"}]}')

    def decode(rid: str) -> Sequence[Step]:
        return [ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode()), 0.05, stray]

    async with (
        RawUpstream(engine_script(lambda rid: [P_ANSWER])) as p,
        RawUpstream(engine_script(decode)) as d,
    ):
        router, port = await pd_router(tokenizer, p.url, d.url)
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as s:
                for rid in ("pdone", "pdtwo", "pdthree"):
                    async with s.post(
                        f"http://127.0.0.1:{port}/v1/completions", json=PD_BODY, headers={"X-Request-Id": rid}
                    ) as r:
                        data = await r.read()
                        assert r.status == 200, data
                    assert completion_ids(data) == {f"cmpl-{rid}".encode()}, data
                    await asyncio.sleep(0.3)  # the stray response arrives while the connection idles
        finally:
            await router.stop()


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_pd_router_never_relays_a_101(tokenizer: Tokenizer, leg: str) -> None:
    upgrade = [b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n", 0.2]

    def decode(rid: str) -> Sequence[Step]:
        return (
            upgrade if leg == "decode" else [ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode())]
        )

    def prefill(rid: str) -> Sequence[Step]:
        return upgrade if leg == "prefill" else [P_ANSWER]

    async with RawUpstream(engine_script(prefill)) as p, RawUpstream(engine_script(decode)) as d:
        router, port = await pd_router(tokenizer, p.url, d.url)
        try:
            raw = await raw_exchange(port, post(PD_BODY, "X-Request-Id: pd101"))
            status, interim, data = final_answer(raw)
            assert interim == [] and status != 101, raw[:200]
            if status != 200:  # no decode answered: a JSON 502
                assert status == 502 and "error" in orjson.loads(data), raw[:300]
            else:  # P failed: D alone answered
                assert completion_ids(data) == {b"cmpl-pd101"}, data
        finally:
            await router.stop()


@pytest.mark.parametrize("prefill", ["answers", "fails"])
async def test_pd_router_ends_a_decode_stream_broken_off_with_an_error_event(
    tokenizer: Tokenizer, prefill: str
) -> None:
    """D's stream breaks off inside its second event: the client's stream used to end cleanly (a
    truncated answer that looked whole, no [DONE]); now it ends with the router's SSE error event,
    an event of its own, then ``[DONE]`` (P answering: events are relayed whole, rewritten; P
    failing: D's bytes as they come)."""
    sent = b'data: {"id":"cmpl-cut","choices":[{"text":"a"}]}\n\ndata: {"id":"cmpl-cut","cho'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    broken = [head + b"%x\r\n%s\r\n" % (len(sent), sent), 0.05, CLOSE]
    p_steps = [P_ANSWER] if prefill == "answers" else [CLOSE]
    async with (
        RawUpstream(engine_script(lambda rid: p_steps)) as p,
        RawUpstream(engine_script(lambda rid: broken)) as d,
    ):
        router, port = await pd_router(tokenizer, p.url, d.url)
        try:
            body = {**PD_BODY, "stream": True}
            status, _, data = final_answer(await raw_exchange(port, post(body, "X-Request-Id: pdcut")))
            assert status == 200, data
            first, *_, error, done = sse_events(data)
            assert orjson.loads(first)["choices"] == [{"text": "a"}]
            assert orjson.loads(error)["error"]["type"] == "upstream_error", data
            assert done == "[DONE]"
        finally:
            await router.stop()


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_an_answer_larger_than_max_response_bytes_is_a_502_and_never_read_to_its_end(
    tokenizer: Tokenizer, framing: str
) -> None:
    """An engine whose non-streamed answer has no end in sight (announced by its Content-Length, or
    chunks that keep coming): the router stops reading at ``max_response_bytes``, answers its client
    a JSON 502 at once, drops that connection, and the next client gets its own answer."""
    big = b"x" * 3000
    if framing == "chunked":
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        flood: list[Step] = [head + b"%x\r\n%s\r\n" % (len(big), big) * 3, 30.0]
    else:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
        flood = [head + big * 3, 30.0]
    posts: list[RawRequest] = []
    async with recording_upstream(flood, posts) as up:
        cfg = RouterConfig(
            backends=(BackendSpec(up.url),), port=0, health_interval_s=0.2, max_response_bytes=4096
        )
        router = RouterServer(cfg, tokenizer=tokenizer)
        await router.start()
        try:
            assert await eventually(lambda: router.state.backends[0].healthy)
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            t0 = asyncio.get_running_loop().time()
            status, _, data = final_answer(await raw_exchange(port_of(router), post(body)))
            assert status == 502 and b"larger than 4096 bytes" in data, data
            assert orjson.loads(data)["error"]["type"] == "upstream_error"
            assert asyncio.get_running_loop().time() - t0 < 10  # it did not wait for the rest
            await ordinary(router, "after")
            assert posts[1].conn != posts[0].conn  # the flooded connection was not reused
        finally:
            await router.stop()


async def test_expect_100_continue_with_a_body_over_the_limit_is_answered_413_without_a_100(
    tokenizer: Tokenizer,
) -> None:
    """A client that announces a body the router would refuse gets the 413 in place of ``100
    Continue`` (RFC 9110 section 10.1.1), so it never uploads it; the connection is closed. Within
    the limit the router's own 100 still comes first."""
    async with recording_upstream() as up:
        cfg = RouterConfig(
            backends=(BackendSpec(up.url),), port=0, health_interval_s=0.2, max_body_bytes=4096
        )
        router = RouterServer(cfg, tokenizer=tokenizer)
        await router.start()
        try:
            assert await eventually(lambda: router.state.backends[0].healthy)
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                "Content-Length: 100000\r\nExpect: 100-continue\r\n\r\n"
            )
            raw = await raw_exchange(port_of(router), head.encode())  # no body: it waits for a 100
            status, interim, data = final_answer(raw)
            assert (status, interim) == (413, []), raw[:300]
            assert orjson.loads(data)["error"]["code"] == 413
            assert not [r for r in up.requests if r.head.startswith(b"POST")]
            body = {"model": "emu", "prompt": "hello", "max_tokens": 4}
            status, interim, _ = final_answer(
                await raw_exchange(port_of(router), post(body, "Expect: 100-continue"))
            )
            assert (status, interim) == (200, [100])
        finally:
            await router.stop()
