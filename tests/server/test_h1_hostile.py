"""H1Transport against upstreams that misbehave on purpose (a raw asyncio server on loopback):
whatever an upstream sends, each request gets its own response and never a byte of another one,
and a connection goes back to the pool only when its response ended exactly at a message boundary.

Every upstream here answers request ``n`` with a body naming ``n`` (``own(n)``), so a response read
on the wrong request is visible; each case is followed by ordinary requests over the same pool."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Sequence

import pytest

from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.transport import UpstreamConnectError, UpstreamTimeoutError

from .rawupstream import CLOSE, RawRequest, RawUpstream, Step, ok

REQUEST_ID = "x-request-id"


def own(rid: str) -> bytes:
    return b'{"id":"cmpl-%s"}' % rid.encode()


def answer(req: RawRequest) -> bytes:
    """The well-formed answer to ``req``: its own id in the body."""
    return ok(own(req.values(REQUEST_ID)[0]))


@pytest.fixture
async def transport() -> AsyncIterator[H1Transport]:
    t = H1Transport(connect_timeout_s=1.0, read_timeout_s=3.0)
    yield t
    await t.close()


async def call(t: H1Transport, url: str, rid: str, timeout_s: float = 3.0) -> tuple[int, bytes]:
    up = await t.send(url, "POST", "/v1/completions", b"{}", {REQUEST_ID: rid}, timeout_s=timeout_s)
    body = await up.read()
    up.release()
    return up.status, body


async def then_ordinary(t: H1Transport, url: str, n: int = 3) -> None:
    """``n`` ordinary requests after a hostile case: each gets its own answer."""
    for i in range(n):
        rid = f"after{i}"
        assert await call(t, url, rid) == (200, own(rid))


def first_only(hostile: Sequence[Step]):  # type: ignore[no-untyped-def]
    """A script: the first request ever gets ``hostile``, every other one its own answer."""

    def script(req: RawRequest) -> Sequence[Step]:
        if req.values(REQUEST_ID)[0] == "hostile":
            return [s if s is not None else answer(req) for s in hostile]
        return [answer(req)]

    return script


@pytest.mark.parametrize("status", [100, 102, 103])
async def test_interim_responses_are_consumed_not_relayed(transport: H1Transport, status: int) -> None:
    interim = b"HTTP/1.1 %d Interim\r\nLink: </style.css>; rel=preload\r\n\r\n" % status
    async with RawUpstream(first_only([interim, None])) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        await then_ordinary(transport, up.url)
        assert up.connections == 1  # the final answer ended at a boundary: the connection is reused


async def test_interim_response_in_its_own_read_then_the_answer(transport: H1Transport) -> None:
    async with RawUpstream(first_only([b"HTTP/1.1 100 Continue\r\n\r\n", 0.05, None])) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        await then_ordinary(transport, up.url)


async def test_several_interim_responses_then_the_answer(transport: H1Transport) -> None:
    interims = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\nHTTP/1.1 103 Early Hints\r\n\r\n"
    async with RawUpstream(first_only([interims, None])) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        await then_ordinary(transport, up.url)


async def test_101_closes_the_connection_without_a_transport_traceback(
    transport: H1Transport, caplog: pytest.LogCaptureFixture
) -> None:
    upgrade = (
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n\x00\x00\x12\x04"
    )
    errors: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    caplog.set_level(logging.ERROR)
    async with RawUpstream(first_only([upgrade, 0.2])) as up:
        resp = await transport.send(up.url, "POST", "/v1/completions", b"{}", {REQUEST_ID: "hostile"})
        assert resp.status == 101  # the relay turns it into a 502 (tests/server/test_wire_e2e.py)
        assert await resp.read() == b""
        resp.release()
        await then_ordinary(transport, up.url)
        assert up.connections == 2  # the upgraded connection was closed, never reused
    assert errors == []
    assert "Fatal error" not in caplog.text


@pytest.mark.parametrize(
    "extra",
    [
        b"garbage",
        b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"id":"evil"}',  # a second response
        b"HTTP/1.1 200 OK\r\nContent-Le",  # a dangling head
        b"\x00\x01\x02",
    ],
    ids=["garbage", "second-response", "dangling-head", "binary"],
)
async def test_bytes_past_the_end_in_the_same_read_close_the_connection(
    transport: H1Transport, extra: bytes
) -> None:
    def script(req: RawRequest) -> Sequence[Step]:
        if req.values(REQUEST_ID)[0] == "hostile":
            return [answer(req) + extra]
        return [answer(req)]

    async with RawUpstream(script) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        await then_ordinary(transport, up.url)
        assert up.connections == 2


@pytest.mark.parametrize(
    "late",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"id":"evil"}',
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n" + b"x" * 3_000_000,  # fills the buffer
    ],
    ids=["late-response", "late-dangling-head", "late-stream-over-1MiB"],
)
async def test_bytes_arriving_while_idle_in_the_pool_close_the_connection(
    transport: H1Transport, late: bytes
) -> None:
    async with RawUpstream(first_only([None, 0.05, late])) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        await asyncio.sleep(0.3)  # the late bytes arrive while the connection is idle
        await then_ordinary(transport, up.url)
        assert up.connections == 2


async def test_late_bytes_not_yet_read_by_the_loop_are_seen_before_reuse(transport: H1Transport) -> None:
    """Bytes that reached the socket but not the protocol yet: the pool checks before reuse."""
    late = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nno"
    async with RawUpstream(first_only([None, 0.1, late])) as up:
        assert await call(transport, up.url, "hostile") == (200, own("hostile"))
        pool = next(p for p in transport._pools.values() if p is not None)
        conn = pool.idle[-1]
        assert conn.transport is not None
        conn.transport.pause_reading()  # nothing reads the late bytes: they wait in the socket
        await asyncio.sleep(0.4)
        assert not conn.closed
        assert pool.get() is None  # the waiting bytes were seen: closed, not handed out
        assert conn.closed
        await then_ordinary(transport, up.url)


@pytest.mark.parametrize("status", [204, 304])
async def test_bodiless_status_with_a_body_closes_the_connection(transport: H1Transport, status: int) -> None:
    head = b"HTTP/1.1 %d Nothing\r\nContent-Type: application/json\r\n\r\n" % status
    async with RawUpstream(first_only([head + b'{"id":"evil"}'])) as up:
        assert await call(transport, up.url, "hostile") == (status, b"")
        await then_ordinary(transport, up.url)
        assert up.connections == 2


async def test_xchunked_is_not_chunked_the_body_ends_at_close(transport: H1Transport) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: xchunked\r\n\r\n"
    async with RawUpstream(first_only([head + b"hello ", 0.02, b"world", CLOSE])) as up:
        assert await call(transport, up.url, "hostile") == (200, b"hello world")
        await then_ordinary(transport, up.url)


async def test_transfer_encoding_is_a_token_list_last_coding_chunked(transport: H1Transport) -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with RawUpstream(first_only([head + b"5\r\nhello\r\n0\r\n\r\n"])) as up:
        assert await call(transport, up.url, "hostile") == (200, b"hello")
        await then_ordinary(transport, up.url)
        assert up.connections == 1


async def test_trailers_are_read_and_never_change_the_head(transport: H1Transport) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    body = b"Trailer: Content-Type\r\n\r\n5;ext=1\r\nhello\r\n0\r\nContent-Type: text/evil\r\nX-T: 1\r\n\r\n"
    async with RawUpstream(first_only([head + body])) as up:
        resp = await transport.send(up.url, "POST", "/v1/completions", b"{}", {REQUEST_ID: "hostile"})
        assert (resp.status, resp.content_type, await resp.read()) == (200, "text/event-stream", b"hello")
        resp.release()
        await then_ordinary(transport, up.url)
        assert up.connections == 1


async def test_stream_over_the_buffer_with_a_stalled_reader_is_never_reused(transport: H1Transport) -> None:
    """A stream that fills the 1 MiB buffer while nobody reads it pauses the reader; such a
    connection is closed, and the next request gets a head at once (it never waits on a paused
    transport)."""
    chunk = b"data: " + b"x" * 65536 + b"\n\n"
    piece = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    async with RawUpstream(first_only([head, *([piece] * 40), b"0\r\n\r\n"])) as up:
        resp = await transport.send(up.url, "POST", "/v1/completions", b"{}", {REQUEST_ID: "hostile"})
        await asyncio.sleep(0.3)  # the client stalls: more than 1 MiB arrives, reading pauses
        resp.release()  # not read to its end: closed
        await then_ordinary(transport, up.url)


async def test_a_head_that_never_comes_is_a_connect_error_for_that_request_only(
    transport: H1Transport,
) -> None:
    async with RawUpstream(first_only([b"HTTP/1.1 100 Continue\r\n\r\n", 5.0])) as up:
        with pytest.raises(UpstreamTimeoutError):
            await call(transport, up.url, "hostile", timeout_s=0.3)
        await then_ordinary(transport, up.url)


async def test_the_pd_relay_never_relays_a_101(transport: H1Transport) -> None:
    from kvroute.server.wire.pdrelay import LegFailed, relay_whole

    upgrade = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n"
    async with RawUpstream(first_only([upgrade, 0.2])) as up:
        resp = await transport.send(up.url, "POST", "/v1/completions", b"{}", {REQUEST_ID: "hostile"})
        with pytest.raises(LegFailed, match="101"):
            await relay_whole(resp, None, {}, 1 << 20)


async def test_the_pd_relay_stops_reading_an_answer_past_its_limit(transport: H1Transport) -> None:
    """D's whole answer is read up to ``max_response_bytes`` only: past it the leg fails at once
    (another D may answer), without waiting for the rest of a body that never ends."""
    from kvroute.server.wire.pdrelay import LegFailed, relay_whole

    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
    async with RawUpstream(first_only([head + b"x" * 5000, 30.0])) as up:
        resp = await transport.send(up.url, "POST", "/v1/completions", b"{}", {REQUEST_ID: "hostile"})
        async with asyncio.timeout(10):
            with pytest.raises(LegFailed, match="larger than 4096 bytes"):
                await relay_whole(resp, None, {}, 4096)


async def test_pooled_connections_above_descriptor_1023_are_reused(transport: H1Transport) -> None:
    """The reuse check works for any descriptor number (``select.select`` fails above 1023)."""
    import resource
    import socket

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"needs 1200 file descriptors, the limit is {soft}")
    held = [socket.socket() for _ in range(1100)]  # push the next descriptors above 1023
    try:
        async with RawUpstream(lambda req: [answer(req)]) as up:
            for i in range(3):
                assert await call(transport, up.url, f"r{i}") == (200, own(f"r{i}"))
            assert up.connections == 1
    finally:
        for s in held:
            s.close()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server context, client context trusting it): a self-signed certificate for 127.0.0.1."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")
    key, cert = d / "key.pem", d / "cert.pem"
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                "/CN=127.0.0.1",
            ),
            *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    return server, ssl.create_default_context(cafile=str(cert))


async def test_https_backends_get_the_same_guarantees(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """https goes through H1Transport too (aiohttp's client served a stray response that arrived
    while the connection idled in the pool to the next request)."""
    server, client = tls
    t = H1Transport(connect_timeout_s=2.0, read_timeout_s=3.0, ssl_context=client)
    late = b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"id":"evil"}'
    try:
        async with RawUpstream(
            first_only([b"HTTP/1.1 100 Continue\r\n\r\n", 0.02, None, 0.05, late]), server
        ) as up:
            assert up.url.startswith("https://")
            assert await call(t, up.url, "hostile") == (200, own("hostile"))
            await asyncio.sleep(0.3)
            await then_ordinary(t, up.url)
            assert up.connections == 2  # the stray bytes closed the first; the second is kept alive
    finally:
        await t.close()


async def test_https_certificate_is_verified(tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server, _ = tls
    t = H1Transport(connect_timeout_s=2.0, read_timeout_s=3.0)  # the system's CAs: self-signed is refused
    try:
        async with RawUpstream(lambda req: [answer(req)], server) as up:
            with pytest.raises(UpstreamConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await call(t, up.url, "x")
    finally:
        await t.close()


async def test_a_base_url_path_prefixes_every_request(transport: H1Transport) -> None:
    async with RawUpstream(lambda req: [answer(req)]) as up:
        assert await call(transport, up.url + "/engine/a/", "p1") == (200, own("p1"))
        assert up.requests[0].head.startswith(b"POST /engine/a/v1/completions HTTP/1.1\r\n")


async def test_an_error_answer_to_a_request_with_a_body_is_not_followed_on_its_connection(
    transport: H1Transport,
) -> None:
    """An engine that refuses a request before reading its body, then reads the rest of that body as
    a request of its own and answers it (no ``x-request-id``: it has none): on a reused connection
    that late answer came after the next request was sent and was taken for its answer. An error
    answer to a request with a body now closes its connection."""
    refused = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    late = b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 7\r\n\r\ngarbage"
    async with RawUpstream(first_only([refused, 0.3, late])) as up:
        assert await call(transport, up.url, "hostile") == (400, b"{}")
        await then_ordinary(transport, up.url)
