"""A response an upstream sends late, on a keep-alive connection that has meanwhile carried the next
request, is that request's answer to HTTP/1.1 framing. The engine's echoed ``X-Request-Id`` tells
them apart: these upstreams (real sockets on loopback, :mod:`tests.server.rawupstream`) echo the id,
and send another request's answer first on a reused connection."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Sequence

import aiohttp
import pytest
from prometheus_client import generate_latest

from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.transport import UpstreamConnectError
from kvroute.tokenizer import Tokenizer

from .rawupstream import RawRequest, RawUpstream, Step, ok
from .test_wire_e2e import (
    MODELS,
    P_ANSWER,
    PD_BODY,
    engine_script,
    final_answer,
    pd_router,
    port_of,
    post,
    raw_exchange,
    start_router,
)

REQUEST_ID = "x-request-id"


def echoed(rid: str, body: bytes | None = None) -> bytes:
    """A 200 as an echoing engine sends it: ``X-Request-Id: rid`` and ``cmpl-<rid>`` in the body."""
    data = body if body is not None else b'{"id":"cmpl-%s","choices":[{"text":"x"}]}' % rid.encode()
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Request-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
        % (rid.encode("latin-1"), len(data), data)
    )


def late_on_reuse(up: RawUpstream):  # type: ignore[no-untyped-def]
    """A script for ``up``: a POST on a reused connection is answered first with the answer to the
    POST before it (on any connection; ``intruder`` when none), sent late, then with its own; every
    answer echoes its request's id (GETs carry none and get none)."""

    def script(req: RawRequest) -> Sequence[Step]:
        if req.head.startswith(b"GET /v1/models"):
            return [ok(MODELS)]
        if req.head.startswith(b"GET"):
            return [ok(b"", "text/plain")]
        rid = req.values(REQUEST_ID)[-1]
        if req.index == 0:
            return [echoed(rid)]
        posts = [r for r in up.requests if r.head.startswith(b"POST") and r is not req]
        stray = posts[-1].values(REQUEST_ID)[-1] if posts else "intruder"
        return [echoed(stray), echoed(rid)]

    return script


@pytest.fixture
async def transport() -> AsyncIterator[H1Transport]:
    t = H1Transport(connect_timeout_s=1.0, read_timeout_s=3.0)
    yield t
    await t.close()


async def call(t: H1Transport, url: str, rid: str) -> tuple[int, bytes]:
    up = await t.send(url, "POST", "/v1/completions", b"{}", {REQUEST_ID: rid}, timeout_s=3.0)
    body = await up.read()
    up.release()
    return up.status, body


async def test_a_late_response_on_a_reused_connection_is_dropped_and_the_request_sent_again(
    transport: H1Transport, caplog: pytest.LogCaptureFixture
) -> None:
    async with RawUpstream(lambda req: []) as up:
        up.script = late_on_reuse(up)
        assert await call(transport, up.url, "first") == (
            200,
            b'{"id":"cmpl-first","choices":[{"text":"x"}]}',
        )
        with caplog.at_level(logging.WARNING):
            status, body = await call(transport, up.url, "second")
        assert status == 200
        assert b"cmpl-first" not in body and b"cmpl-second" in body
        assert transport.strays == 1
        # sent on the reused connection (answered by the stray), then once more on a fresh one
        assert [(r.conn, r.index) for r in up.requests] == [(0, 0), (0, 1), (1, 0)]
        lines = [r.getMessage() for r in caplog.records if "stray response" in r.getMessage()]
        assert len(lines) == 1 and "'second'" in lines[0] and "'first'" in lines[0], lines


async def test_a_stray_on_a_fresh_connection_is_an_error_never_an_answer(transport: H1Transport) -> None:
    async with RawUpstream(lambda req: [echoed("someone-else")]) as up:
        with pytest.raises(UpstreamConnectError, match="another request's id"):
            await call(transport, up.url, "mine")
        assert transport.strays == 1


async def test_an_answer_without_the_header_is_accepted(transport: H1Transport) -> None:
    plain = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with RawUpstream(lambda req: [plain]) as up:
        for rid in ("a", "b"):
            assert await call(transport, up.url, rid) == (200, b"ok")
        assert transport.strays == 0 and up.connections == 1


async def test_the_router_never_relays_a_late_response_to_the_next_client(tokenizer: Tokenizer) -> None:
    """Through ``kvroute serve``'s pipeline: each client gets its own completion, the stray is
    counted on /metrics."""
    async with RawUpstream(lambda req: []) as up:
        up.script = late_on_reuse(up)
        router = await start_router(tokenizer, up.url)
        try:
            for client in ("alice", "bob", "carol"):
                body = {"model": "emu", "prompt": f"hello {client}", "max_tokens": 4}
                raw = await raw_exchange(port_of(router), post(body, f"X-Request-Id: {client}"))
                status, _, data = final_answer(raw)
                assert status == 200, raw
                assert set(re.findall(rb'"id":"(cmpl-[^"]*)"', data)) == {f"cmpl-{client}".encode()}, data
            assert router.transport.strays >= 1  # type: ignore[attr-defined]
            async with aiohttp.ClientSession() as s, s.get(router.url + "/metrics") as r:
                text = await r.text()
            m = re.search(r"^kvroute_upstream_stray_responses_total (\S+)$", text, re.M)
            assert m is not None and float(m.group(1)) >= 1.0, text
        finally:
            await router.stop()


async def test_the_pd_router_never_relays_a_late_decode_response_to_the_next_client(
    tokenizer: Tokenizer,
) -> None:
    """The same on the P/D router's decode leg (prefill answers without an id: accepted)."""
    async with (
        RawUpstream(engine_script(lambda rid: [P_ANSWER])) as p,
        RawUpstream(lambda req: []) as d,
    ):
        d.script = late_on_reuse(d)
        router, port = await pd_router(tokenizer, p.url, d.url)
        try:
            for client in ("alice", "bob", "carol"):
                raw = await raw_exchange(port, post(PD_BODY, f"X-Request-Id: {client}"))
                status, _, data = final_answer(raw)
                assert status == 200, raw[:300]
                assert set(re.findall(rb'"id":"(cmpl-[^"]*)"', data)) == {f"cmpl-{client}".encode()}, data
            assert router.transport.strays >= 1
            text = generate_latest(router.registry).decode()
            m = re.search(r"^kvroute_upstream_stray_responses_total (\S+)$", text, re.M)
            assert m is not None and float(m.group(1)) >= 1.0, text
        finally:
            await router.stop()
