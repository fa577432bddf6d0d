"""H1Transport against real servers on loopback: keep-alive pooling, streaming, every failure mode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from kvroute.server.cluster import free_port
from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.transport import (
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamStalledError,
    UpstreamTimeoutError,
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Server:
    """An aiohttp server on a free port that records which connection served each request."""

    def __init__(self, handler: Handler, keepalive_timeout: float = 75.0) -> None:
        self.handler = handler
        self.keepalive_timeout = keepalive_timeout
        self.peers: list[object] = []
        self.cancelled = asyncio.Event()
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _wrap(self, request: web.Request) -> web.StreamResponse:
        self.peers.append(request.transport)
        try:
            return await self.handler(request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def __aenter__(self) -> Server:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._wrap)
        self._runner = web.AppRunner(app, keepalive_timeout=self.keepalive_timeout, handler_cancellation=True)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    @property
    def connections(self) -> int:
        return len({id(p) for p in self.peers})


@pytest.fixture
async def transport() -> AsyncIterator[H1Transport]:
    t = H1Transport(connect_timeout_s=1.0, read_timeout_s=5.0)
    yield t
    await t.close()


async def _text(request: web.Request) -> web.Response:
    return web.Response(text="x" * 5000)


async def test_keep_alive_connection_is_reused(transport: H1Transport) -> None:
    async with Server(_text) as srv:
        for _ in range(5):
            resp = await transport.send(srv.url, "GET", "/metrics", timeout_s=1.0)
            assert resp.status == 200
            assert await resp.read() == b"x" * 5000
            resp.release()
            resp.abort()  # after release: a no-op, the connection stays pooled
        assert srv.connections == 1


async def test_unreleased_response_is_not_reused(transport: H1Transport) -> None:
    async with Server(_text) as srv:
        for _ in range(2):
            resp = await transport.send(srv.url, "GET", "/", timeout_s=1.0)
            resp.abort()  # body never read: the connection must not carry the next request
        assert srv.connections == 2


async def test_post_streams_chunks_in_order_and_forwards_headers(transport: H1Transport) -> None:
    seen: dict[str, str] = {}

    async def stream(request: web.Request) -> web.StreamResponse:
        seen.update(request.headers)
        seen["body"] = (await request.read()).decode()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {i}\n\n".encode())
            await asyncio.sleep(0.02)
        await resp.write_eof()
        return resp

    async with Server(stream) as srv:
        headers = {"X-Req": "7", "Connection": "upgrade", "X-Bad": "a\r\nInjected: 1"}
        resp = await transport.send(srv.url, "POST", "/v1/completions", b'{"a": 1}', headers)
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        chunks = [c async for c in resp.iter_chunks()]
        resp.release()
    assert b"".join(chunks) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert len(chunks) >= 2  # streamed as it arrived, not buffered to the end
    assert seen["body"] == '{"a": 1}'
    assert seen["X-Req"] == "7"
    assert seen["Host"] == srv.url.removeprefix("http://")
    assert "X-Bad" not in seen and "Injected" not in seen  # no header injection
    assert seen.get("Connection", "keep-alive").lower() == "keep-alive"  # hop header not forwarded


async def test_connection_refused_is_a_connect_error(transport: H1Transport) -> None:
    with pytest.raises(UpstreamConnectError):
        await transport.send(f"http://127.0.0.1:{free_port()}", "GET", "/health", timeout_s=1.0)


async def test_no_head_in_time_is_a_timeout_and_cancels_upstream(transport: H1Transport) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response(text="late")

    async with Server(slow) as srv:
        with pytest.raises(UpstreamTimeoutError):  # a connect error's kind: the request was sent
            await transport.send(srv.url, "GET", "/", timeout_s=0.2)
        await asyncio.wait_for(srv.cancelled.wait(), 2.0)  # the connection was closed


async def test_body_breaking_off_is_a_broken_error(transport: H1Transport) -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.close()
        return resp

    async with Server(breaks) as srv:
        resp = await transport.send(srv.url, "POST", "/", b"{}")
        got = []
        with pytest.raises(UpstreamBrokenError):
            async for chunk in resp.iter_chunks():
                got.append(chunk)
        resp.abort()
    assert b"".join(got) == b"data: first\n\n"


async def test_a_body_that_stalls_past_the_read_timeout_is_a_stall_not_a_break() -> None:
    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)  # the head now, the body never
        await asyncio.sleep(5)
        return resp

    t = H1Transport(connect_timeout_s=1.0, read_timeout_s=0.2)
    try:
        async with Server(stalls) as srv:
            resp = await t.send(srv.url, "POST", "/", b"{}")
            with pytest.raises(UpstreamStalledError):
                await resp.read()
            resp.abort()
            await asyncio.wait_for(srv.cancelled.wait(), 2.0)
    finally:
        await t.close()


async def test_stale_pooled_connection_is_replaced_transparently(transport: H1Transport) -> None:
    async with Server(_text, keepalive_timeout=0.05) as srv:
        resp = await transport.send(srv.url, "GET", "/", timeout_s=1.0)
        await resp.read()
        resp.release()
        await asyncio.sleep(0.3)  # the server closes the idle connection
        resp = await transport.send(srv.url, "POST", "/", b"{}", timeout_s=1.0)
        assert resp.status == 200 and len(await resp.read()) == 5000
        resp.release()
        assert srv.connections == 2


async def _endless(request: web.Request) -> web.StreamResponse:
    """Streams ticks until the client goes away."""
    resp = web.StreamResponse()
    await resp.prepare(request)
    while True:
        await resp.write(b"data: tick\n\n")
        await asyncio.sleep(0.01)


async def test_abort_mid_stream_cancels_the_upstream_handler(transport: H1Transport) -> None:
    async with Server(_endless) as srv:
        resp = await transport.send(srv.url, "POST", "/", b"{}")
        chunks = resp.iter_chunks()
        assert (await anext(chunks)).startswith(b"data: tick")
        resp.abort()
        await asyncio.wait_for(srv.cancelled.wait(), 2.0)
        with contextlib.suppress(UpstreamBrokenError, StopAsyncIteration):
            await anext(chunks)


async def test_connection_close_response_is_not_pooled(transport: H1Transport) -> None:
    async def closing(request: web.Request) -> web.Response:
        return web.Response(text="bye", headers={"Connection": "close"})

    async with Server(closing) as srv:
        for _ in range(2):
            resp = await transport.send(srv.url, "GET", "/", timeout_s=1.0)
            assert await resp.read() == b"bye"
            resp.release()
        assert srv.connections == 2


async def test_close_delimited_body_and_malformed_head() -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nhello, world",
        b"NOT HTTP AT ALL\r\n\r\n",
    ]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(replies.pop(0))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t = H1Transport(connect_timeout_s=1.0, read_timeout_s=2.0)
    try:
        resp = await t.send(f"http://127.0.0.1:{port}", "GET", "/", timeout_s=1.0)
        assert (resp.status, resp.content_type) == (200, "text/plain")
        assert await resp.read() == b"hello, world"
        resp.release()
        with pytest.raises(UpstreamConnectError, match="malformed"):
            await t.send(f"http://127.0.0.1:{port}", "GET", "/", timeout_s=1.0)
    finally:
        await t.close()
        server.close()
        await server.wait_closed()


async def test_large_body_survives_backpressure(transport: H1Transport) -> None:
    payload = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: more than the high-water mark

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=payload)

    async with Server(big) as srv:
        resp = await transport.send(srv.url, "GET", "/", timeout_s=1.0)
        parts = []
        async for chunk in resp.iter_chunks():
            parts.append(chunk)
            await asyncio.sleep(0.005)  # a slow reader: the connection pauses and resumes
        resp.release()
    assert b"".join(parts) == payload


@pytest.mark.parametrize("scheme", ["https", "ftp"])  # ftp: through the aiohttp fallback
async def test_unreachable_or_unsupported_urls_are_connect_errors(
    transport: H1Transport, scheme: str
) -> None:
    with pytest.raises(UpstreamConnectError):  # same error contract through the fallback
        await transport.send(f"{scheme}://127.0.0.1:{free_port()}", "GET", "/health", timeout_s=1.0)


async def test_close_closes_connections_in_use() -> None:
    t = H1Transport()
    async with Server(_endless) as srv:
        resp = await t.send(srv.url, "POST", "/", b"{}")
        await anext(resp.iter_chunks())
        await t.close()
        await asyncio.wait_for(srv.cancelled.wait(), 2.0)


async def test_ended_says_when_the_last_chunk_came_with_the_end(transport: H1Transport) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        for last, chunk in ((False, b"data: 0\n\n"), (True, b"data: 1\n\n")):
            # the last chunk and the chunked end go out in one write
            await (resp.write_eof(chunk) if last else resp.write(chunk))
            await asyncio.sleep(0.05)
        return resp

    async with Server(stream) as srv:
        resp = await transport.send(srv.url, "POST", "/", b"{}")
        seen = [(chunk, resp.ended) async for chunk in resp.iter_chunks()]
        resp.release()
        assert seen == [(b"data: 0\n\n", False), (b"data: 1\n\n", True)]
        unread = await transport.send(srv.url, "POST", "/", b"{}")
        assert not unread.ended  # the head only: its body is still to come
        unread.abort()
