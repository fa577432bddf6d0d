"""H1Transport against aiohttp's client on the same upstream byte streams: the same messages.

A catalogue of upstream answers (fixed-length, chunked with extensions and trailers, close-delimited,
interim responses, bodiless statuses, broken and malformed ones) is served by a raw loopback server,
split into pieces written apart (hypothesis picks the split points), to :class:`H1Transport` and to
:class:`AiohttpTransport` (aiohttp's client). Both must give the same status, content type and body
bytes, or both fail. Every split point of every entry is also fed to H1's protocol object directly
(over a real socket transport), which must give what the unsplit stream gave.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.server.wire.h1 import H1Transport, _Conn
from kvroute.server.wire.transport import AiohttpTransport, Transport, UpstreamError

from .rawupstream import CLOSE, RawRequest, RawUpstream, Step

H = b"HTTP/1.1 "
CHUNKED = b"Transfer-Encoding: chunked\r\n"

# name -> (the answer's bytes, whether the server closes the connection after them)
CATALOGUE: dict[str, tuple[bytes, bool]] = {
    "fixed": (H + b'200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}', False),
    "fixed-lower-case-names": (
        H + b"200 OK\r\ncontent-type: text/plain\r\ncontent-length: 3\r\n\r\nabc",
        False,
    ),
    "empty-fixed": (H + b"200 OK\r\nContent-Length: 0\r\n\r\n", False),
    "chunked-ext-trailers": (
        H + b"200 OK\r\nContent-Type: text/event-stream\r\n" + CHUNKED + b"\r\n"
        b"3;ext=v\r\nabc\r\n4;a=b;c\r\ndefg\r\nA\r\n0123456789\r\n0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n",
        False,
    ),
    "chunked-hex-upper": (H + b"200 OK\r\n" + CHUNKED + b"\r\n1A\r\n" + b"z" * 26 + b"\r\n0\r\n\r\n", False),
    "chunked-then-close": (H + b"200 OK\r\n" + CHUNKED + b"\r\n2\r\nok\r\n0\r\n\r\n", True),
    "close-delimited": (H + b"200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the connection closes", True),
    "http10-close-delimited": (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nold", True),
    "xchunked-close-delimited": (H + b"200 OK\r\nTransfer-Encoding: xchunked\r\n\r\nnot chunked", True),
    "100-then-fixed": (H + b"100 Continue\r\n\r\n" + H + b"200 OK\r\nContent-Length: 2\r\n\r\nhi", False),
    "103-then-chunked": (
        H + b"103 Early Hints\r\nLink: </a.css>; rel=preload\r\n\r\n" + H + b"200 OK\r\n" + CHUNKED + b"\r\n"
        b"2\r\nhi\r\n0\r\n\r\n",
        False,
    ),
    "102-100-then-close-delimited": (
        H + b"102 Processing\r\n\r\n" + H + b"100 Continue\r\n\r\n" + H + b"200 OK\r\n\r\nbye",
        True,
    ),
    "101-then-other-protocol": (
        H + b"101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\n\x00\x00\x12\x04",
        False,
    ),
    "204": (H + b"204 No Content\r\nContent-Type: text/plain\r\n\r\n", False),
    "304": (H + b"304 Not Modified\r\n\r\n", False),
    "404-json": (
        H + b"404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        False,
    ),
    "503-close-delimited": (H + b'503 Busy\r\nContent-Type: application/json\r\n\r\n{"e":1}', True),
    "ctype-with-params": (
        H + b"200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nContent-Length: 1\r\n\r\nx",
        False,
    ),
    "fixed-broken-off": (H + b"200 OK\r\nContent-Length: 10\r\n\r\nhalf", True),
    "chunked-broken-off": (H + b"200 OK\r\n" + CHUNKED + b"\r\n5\r\nab", True),
    "chunked-bad-size": (H + b"200 OK\r\n" + CHUNKED + b"\r\nzz\r\nab\r\n0\r\n\r\n", True),
    "bad-status-line": (b"HTTX/1.1 200 OK\r\nContent-Length: 2\r\n\r\nhi", True),
    "head-broken-off": (H + b"200 OK\r\nContent-Len", True),
    "nothing": (b"", True),
}

Result = tuple[int, str, bytes] | str  # (status, content type, body), or "failed"


def script_for(answer: bytes, close: bool, splits: Sequence[int]) -> Sequence[Step]:
    """``answer`` cut at ``splits`` (sorted offsets), the pieces written apart."""
    steps: list[Step] = []
    start = 0
    for cut in [*splits, len(answer)]:
        if cut > start:
            steps.extend([answer[start:cut], 0.003])
            start = cut
    if close:
        steps.append(CLOSE)
    else:
        steps.append(2.0)  # keep-alive: the client must know the end from the framing alone
    return steps


async def fetch(t: Transport, url: str) -> Result:
    try:
        up = await t.send(url, "POST", "/v1/completions", b"{}", {"content-type": "application/json"}, 5.0)
        body = await up.read()
    except UpstreamError:
        return "failed"
    up.release()
    return up.status, up.content_type, body


@pytest.fixture
async def clients() -> AsyncIterator[tuple[Transport, Transport]]:
    h1 = H1Transport(connect_timeout_s=1.0, read_timeout_s=1.0)
    aio = AiohttpTransport(connect_timeout_s=1.0, read_timeout_s=1.0)
    yield h1, aio
    await h1.close()
    await aio.close()


async def both(
    name: str, splits: Sequence[int], clients: tuple[Transport, Transport]
) -> tuple[Result, Result]:
    answer, close = CATALOGUE[name]
    out = []
    for t in clients:

        def script(req: RawRequest) -> Sequence[Step]:
            return script_for(answer, close, splits)

        async with RawUpstream(script) as up:
            out.append(await fetch(t, up.url))
    return out[0], out[1]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
async def test_same_messages_as_aiohttp_unsplit(name: str, clients: tuple[Transport, Transport]) -> None:
    h1, aio = await both(name, (), clients)
    assert h1 == aio


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
async def test_same_messages_as_aiohttp_split(
    data: st.DataObject, clients: tuple[Transport, Transport]
) -> None:
    name = data.draw(st.sampled_from(sorted(CATALOGUE)), label="entry")
    n = len(CATALOGUE[name][0])
    splits = sorted(data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=4), label="splits"))
    h1, aio = await both(name, splits, clients)
    assert h1 == aio, (name, splits)


async def feed_h1(answer: bytes, close: bool, cuts: Sequence[int]) -> Result:
    """H1's protocol object, on a real socket transport, fed ``answer`` cut at ``cuts``: the head
    as the caller sees it once the head resolves, the body as it stands once the response is
    complete (what a reader sees; later bytes must not change it)."""
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    transport, conn = await loop.create_connection(lambda: _Conn(loop, set()), sock=a)
    head: tuple[int, str] | None = None
    body: bytes | None = None

    def look() -> None:
        nonlocal head, body
        if head is None and conn.head.done() and conn.head.exception() is None:
            head = (conn.status, conn.content_type)
        if body is None and conn.complete:
            body = b"".join(conn.body)

    try:
        start = 0
        for cut in [*cuts, len(answer)]:
            if cut > start and not conn.closed:
                conn.data_received(answer[start:cut])
                look()
            start = cut
        if close and not conn.closed:
            conn.connection_lost(None)
            look()
        if head is None or body is None:
            return "failed"
        return (*head, body)
    finally:
        transport.close()
        b.close()


@pytest.mark.parametrize("name", sorted(CATALOGUE))
async def test_h1_gives_the_same_message_at_every_split_point(name: str) -> None:
    answer, close = CATALOGUE[name]
    whole = await feed_h1(answer, close, ())
    for cut in range(1, len(answer)):
        assert await feed_h1(answer, close, (cut,)) == whole, cut
    assert await feed_h1(answer, close, range(1, len(answer))) == whole  # one byte at a time
