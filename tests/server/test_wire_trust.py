"""The router's trust guarantee at its edges, end to end over real sockets: a client-chosen
``X-Request-Id`` already in flight is refused (never two requests under one id to an engine from
one router); a request that takes longer than ``upstream_timeout_s`` is that client's 504, never an
ejected backend; and every answer of the router's own, ``Expect`` errors included, is JSON."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from kvroute.emulator.server import EmulatorServer
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.wire.h1 import H1Transport
from kvroute.tokenizer import Tokenizer

from .rawupstream import RawRequest, RawUpstream, Step, ok
from .test_wire_e2e import (
    MODELS,
    P_ANSWER,
    PD_BODY,
    completion_ids,
    engine_script,
    eventually,
    final_answer,
    pd_router,
    port_of,
    post,
    raw_exchange,
    recording_upstream,
    start_engine,
    start_router,
)

BODY = {"model": "emu", "prompt": "hello", "max_tokens": 4}
TOKEN = "s3cret-token"


def slow_upstream(delay_s: float) -> RawUpstream:
    """A raw engine whose first completion is answered after ``delay_s``; each completion is named
    ``cmpl-<X-Request-Id>``."""
    posts: list[RawRequest] = []

    def script(req: RawRequest) -> list[Step]:
        if req.head.startswith(b"GET /v1/models"):
            return [ok(MODELS)]
        if req.head.startswith(b"GET"):
            return [ok(b"", "text/plain")]
        posts.append(req)
        rid = (req.values("x-request-id") or ["?"])[0]
        answer = ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode())
        return [delay_s, answer] if len(posts) == 1 else [answer]

    return RawUpstream(script)


def posts_of(up: RawUpstream) -> list[RawRequest]:
    return [r for r in up.requests if r.head.startswith(b"POST")]


# ---- a client-chosen X-Request-Id already in flight ------------------------------------------


async def test_an_id_already_in_flight_is_a_json_409_and_never_reaches_the_engine(
    tokenizer: Tokenizer,
) -> None:
    """Two requests under one id in flight would reach the engine under one id (an engine keying
    outputs by id could mix them, and one's cancellation could end the other's): the second is
    refused, whatever the case of the header's name; the id is free again once the first ends."""
    async with slow_upstream(1.5) as up:
        router = await start_router(tokenizer, up.url)
        try:
            port = port_of(router)
            first = asyncio.create_task(raw_exchange(port, post(BODY, "X-Request-Id: shared-id")))
            assert await eventually(lambda: len(posts_of(up)) == 1)  # the first is at the engine
            for header in ("X-Request-Id: shared-id", "x-request-id: shared-id", "X-REQUEST-ID: shared-id"):
                raw = await raw_exchange(port, post(BODY, header))
                status, _, data = final_answer(raw)
                assert status == 409, raw
                assert b"application/json" in raw.split(b"\r\n\r\n")[0].lower()
                err = orjson.loads(data)["error"]
                assert err["type"] == "invalid_request_error"
                assert err["param"] == "X-Request-Id" and "X-Request-Id" in err["message"]
            other = final_answer(await raw_exchange(port, post(BODY, "X-Request-Id: another-id")))
            assert other[0] == 200 and completion_ids(other[2]) == {b"cmpl-another-id"}  # not over-refused
            status, _, data = final_answer(await first)
            assert status == 200 and completion_ids(data) == {b"cmpl-shared-id"}
            assert [r.values("x-request-id") for r in posts_of(up)] == [["shared-id"], ["another-id"]]
            again = final_answer(await raw_exchange(port, post(BODY, "X-Request-Id: shared-id")))
            assert again[0] == 200 and completion_ids(again[2]) == {b"cmpl-shared-id"}  # freed
            assert router.state.backends[0].healthy
        finally:
            await router.stop()


async def test_a_refused_or_failed_request_frees_its_id(tokenizer: Tokenizer) -> None:
    """The id is held for the request's whole life and released on every path: a request refused
    for its body (400) or by no backend (503) leaves its id usable."""
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            port = port_of(router)
            bad = final_answer(await raw_exchange(port, post({"model": "emu"}, "X-Request-Id: again")))
            assert bad[0] == 400
            good = final_answer(await raw_exchange(port, post(BODY, "X-Request-Id: again")))
            assert good[0] == 200 and completion_ids(good[2]) == {b"cmpl-again"}
        finally:
            await router.stop()


# ---- a client's slow request never ejects a healthy backend -----------------------------------


@pytest.fixture
async def slow_engine(tokenizer: Tokenizer) -> AsyncIterator[EmulatorServer]:
    """An emulated engine in real time: a long generation takes seconds."""
    eng = await start_engine(tokenizer, time_scale=1.0)
    yield eng
    await eng.stop()


async def router_for(tokenizer: Tokenizer, *urls: str, **fields: Any) -> RouterServer:
    """A started router over ``urls`` (config ``fields`` added), every backend healthy."""
    cfg = RouterConfig(backends=tuple(BackendSpec(u) for u in urls), port=0, health_interval_s=0.2, **fields)
    router = RouterServer(cfg, tokenizer=tokenizer)
    await router.start()
    assert await eventually(lambda: all(b.healthy for b in router.state.backends))
    return router


async def test_a_generation_longer_than_the_timeout_is_that_clients_504_and_the_backend_stays(
    tokenizer: Tokenizer, slow_engine: EmulatorServer
) -> None:
    """A non-streamed generation gives no head until it ends: past ``upstream_timeout_s`` the client
    gets a JSON 504, the engine's request is cancelled (its connection closed), the backend is not
    ejected and not retried elsewhere, and the next client is served."""
    router = await router_for(tokenizer, f"http://127.0.0.1:{slow_engine.port}", upstream_timeout_s=0.5)
    try:
        long = {"model": "emu", "prompt": "hello", "max_tokens": 4000}
        raw = await raw_exchange(port_of(router), post(long, "X-Request-Id: long-one"))
        status, _, data = final_answer(raw)
        assert status == 504, raw
        err = orjson.loads(data)["error"]
        assert err["type"] == "timeout_error" and err["code"] == 504
        assert router.state.backends[0].healthy
        assert await eventually(lambda: not slow_engine.driver.known("cmpl-long-one"))  # cancelled
        assert router.state.counters.retries == 0
        short = final_answer(await raw_exchange(port_of(router), post(BODY, "X-Request-Id: next-one")))
        assert short[0] == 200 and completion_ids(short[2]) == {b"cmpl-next-one"}
        assert router.state.backends[0].healthy
    finally:
        await router.stop()


async def _two_slow_backends(tokenizer: Tokenizer, steps: list[Step], stream: bool) -> None:
    """Both backends answer every completion with ``steps``: the client gets a 504 from the first
    one tried, the other never sees the request, both stay healthy."""

    def script(req: RawRequest) -> list[Step]:
        if req.head.startswith(b"GET /v1/models"):
            return [ok(MODELS)]
        if req.head.startswith(b"GET"):
            return [ok(b"", "text/plain")]
        return steps

    async with RawUpstream(script) as a, RawUpstream(script) as b:
        router = await router_for(tokenizer, a.url, b.url, upstream_timeout_s=0.4)
        try:
            body = {**BODY, "stream": stream}
            raw = await raw_exchange(port_of(router), post(body, "X-Request-Id: slow-one"))
            status, _, data = final_answer(raw)
            assert status == 504, raw
            assert orjson.loads(data)["error"]["type"] == "timeout_error"
            assert len(posts_of(a)) + len(posts_of(b)) == 1  # not retried elsewhere
            assert all(x.healthy for x in router.state.backends)
            assert router.state.counters.upstream_errors == 1
        finally:
            await router.stop()


async def test_no_head_in_time_is_a_504_never_a_retry_or_an_ejection(tokenizer: Tokenizer) -> None:
    await _two_slow_backends(tokenizer, [3.0, ok(b'{"id":"cmpl-late"}')], stream=False)


async def test_no_first_body_byte_in_time_is_a_504_never_a_retry_or_an_ejection(tokenizer: Tokenizer) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    await _two_slow_backends(tokenizer, [head, 3.0, b"0\r\n\r\n"], stream=True)


# ---- every answer of the router's own is JSON --------------------------------------------------


def get(path: str, *headers: str) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: router", "Connection: close", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@pytest.mark.parametrize(
    "path",
    [
        "/health",
        "/livez",
        "/metrics",
        "/v1/models",
        "/admin/backends",
        "/debug/state",
        "/debug/decisions",
        "/dashboard",
        "/no/such/route",
    ],
)
async def test_an_unknown_expectation_is_a_json_417_on_every_route(tokenizer: Tokenizer, path: str) -> None:
    async with recording_upstream() as up:
        router = await router_for(tokenizer, up.url, admin_token=TOKEN)
        try:
            req = get(path, "Expect: 100-continue-please", f"Authorization: Bearer {TOKEN}")
            raw = await raw_exchange(port_of(router), req)
            status, interim, data = final_answer(raw)
            assert (status, interim) == (417, []), raw
            assert b"content-type: application/json" in raw.split(b"\r\n\r\n")[0].lower()
            err = orjson.loads(data)["error"]
            assert err["code"] == 417 and "100-continue" in err["message"]
            # 100-continue itself is still honoured there: the answer follows the router's own 100
            auth = f"Authorization: Bearer {TOKEN}"
            raw = await raw_exchange(port_of(router), get(path, "Expect: 100-continue", auth))
            assert final_answer(raw)[0] != 417, raw
        finally:
            await router.stop()


async def test_the_417_is_json_through_an_ordinary_client_too(tokenizer: Tokenizer) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            async with (
                aiohttp.ClientSession() as s,
                s.get(router.url + "/health", headers={"Expect": "something-else"}) as r,
            ):
                assert r.status == 417 and r.content_type == "application/json"
                assert (await r.json())["error"]["code"] == 417
        finally:
            await router.stop()


async def test_the_pd_router_refuses_an_id_already_in_flight_too(tokenizer: Tokenizer) -> None:
    """Both legs of a P/D request carry its id: a second request under it while the first is in
    flight is a JSON 409 and reaches neither P nor D."""
    decode_posts: list[str] = []

    def decode(rid: str) -> list[Step]:
        decode_posts.append(rid)
        answer = ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode())
        return [1.5, answer] if len(decode_posts) == 1 else [answer]

    async with (
        RawUpstream(engine_script(lambda rid: [P_ANSWER])) as p,
        RawUpstream(engine_script(decode)) as d,
    ):
        router, port = await pd_router(tokenizer, p.url, d.url)
        try:
            first = asyncio.create_task(raw_exchange(port, post(PD_BODY, "X-Request-Id: pd-shared")))
            assert await eventually(lambda: decode_posts == ["pd-shared"])
            status, _, data = final_answer(await raw_exchange(port, post(PD_BODY, "x-request-id: pd-shared")))
            assert status == 409, data
            assert orjson.loads(data)["error"]["param"] == "X-Request-Id"
            assert len(posts_of(p)) == 1 and decode_posts == ["pd-shared"]
            status, _, data = final_answer(await first)
            assert status == 200 and completion_ids(data) == {b"cmpl-pd-shared"}
        finally:
            await router.stop()


async def test_the_pd_router_answers_a_slow_decode_504_and_tries_no_other(tokenizer: Tokenizer) -> None:
    """D took the request and gives no head within the read timeout: the client's 504, and the
    long generation is not submitted again to the next D."""
    decode_posts: list[str] = []

    def decode(rid: str) -> list[Step]:
        decode_posts.append(rid)
        return [3.0, ok(b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode())]

    async with (
        RawUpstream(engine_script(lambda rid: [P_ANSWER])) as p,
        RawUpstream(engine_script(decode)) as d1,
        RawUpstream(engine_script(decode)) as d2,
    ):
        transport = H1Transport(connect_timeout_s=1.0, read_timeout_s=0.4)
        router, port = await pd_router(tokenizer, p.url, d1.url, d2.url, transport=transport)
        try:
            status, _, data = final_answer(await raw_exchange(port, post(PD_BODY, "X-Request-Id: pd-slow")))
            assert status == 504, data
            assert orjson.loads(data)["error"]["type"] == "timeout_error"
            assert decode_posts == ["pd-slow"]
        finally:
            await router.stop()
            await transport.close()
