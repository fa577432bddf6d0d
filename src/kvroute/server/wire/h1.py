"""A lean HTTP/1.1 client for the router's upstream calls: :class:`H1Transport`.

The router needs a small part of HTTP: a pool of keep-alive connections per backend, a request
written in one call, the status line, the ``Content-Type`` header and the body (fixed-length,
chunked or close-delimited) as it arrives. The response is parsed by ``httptools`` (llhttp, Node.js's
parser); this module only frames messages and manages connections.

Kept rather than replaced by aiohttp's client, by measurement and by proof:

- **CPU**: ``make bench ONLY=transport`` (:mod:`benchmarks.bench_transport`) runs two routers that
  differ only in their transport, interleaved over the same engines and arrivals. On a 2-core
  machine at load average 16 to 22 (other jobs running), 6 rounds per rate (``benchmarks/results/transport.json``): router CPU per proxied request
  2.68 ms with this client vs 3.11 ms with aiohttp's at 50 req/s (14 % less; lower in 6 of 6
  rounds), 2.21 vs 2.57 ms at 125 req/s (14 % less; 5 of 6 rounds); idle, 8 vs 12 ms of CPU per
  second (the /metrics scrapes and health checks). The safety checks below cost nothing measurable:
  the same A/B of this client before and after them (:mod:`benchmarks.peers_ab`, load 10 to 15,
  ``benchmarks/results/transport-fixes.json``) gave 3.28 vs 3.56 ms at 50 req/s and 2.19 vs
  2.29 ms at 125 req/s (after vs before).
- **Correctness**: ``tests/server/test_h1_differential.py`` feeds the same upstream byte streams
  (fixed-length, chunked with extensions and trailers, close-delimited, ``xchunked``, interim 1xx
  then the answer, 101, 204/304, broken and malformed answers; split at random points over real
  sockets, and at every byte boundary into the protocol object) to this client and to aiohttp's:
  the same status, content type and body, or both fail. ``tests/server/test_h1_hostile.py`` runs
  upstreams that misbehave on purpose, each case followed by ordinary requests on the same pool.

Behaviour (the :class:`~kvroute.server.wire.transport.Transport` contract):

- :class:`UpstreamConnectError` when no response head arrives: connection refused or reset, or
  connect timeout (``connect_timeout_s``); its subclass :class:`UpstreamTimeoutError` when the
  request was written and no head came within ``timeout_s`` (when given; else within
  ``read_timeout_s``), the connection then closed (the engine cancels the request). A pooled connection that turns out closed before any response byte is
  replaced by a fresh one once (the usual keep-alive race; nothing was processed on it);
- :class:`UpstreamBrokenError` when the body breaks off or is malformed; its subclass
  :class:`UpstreamStalledError` when no bytes arrive for ``read_timeout_s``;
- interim responses (``100``-``199`` but ``101``) are read and dropped: the head is the final
  answer's. A ``101`` is returned as is with an empty body and its connection closed (the relay
  answers the client with a 502);
- ``Transfer-Encoding`` is a list of codings: the body is chunked when the last one is ``chunked``,
  else it ends when the connection closes (RFC 9112 section 6.3); trailers are read and ignored;
- a connection goes back to the pool only when its response ended exactly at a message boundary,
  was read to its end and ``release()``-d, the server keeps it alive, and its reader is not paused;
  a byte past the end of the response (in the same read, or later while the connection is idle)
  closes it, and the pool checks the socket for waiting bytes before it hands a connection out.
  At most ``max_idle`` idle connections per backend; ``abort()`` closes the connection, which a
  vLLM-style engine takes as a cancelled request;
- an error answer (status 400 or more) to a request with a body closes its connection once read:
  an engine may answer before it has read the body, and the rest of that body, read later as a
  request of its own, would have its answer taken for the next request's on that connection;
- a connection idle in the pool for more than ``keepalive_s`` seconds (the injected ``clock``) is
  closed: by :meth:`H1Transport.prune` (every 50 ms, :mod:`kvroute.server.wire.pruning`), and
  by the pool before it would hand it out. Without it, a connection would stay open until the engine
  closes it, which an engine without an idle timeout never does (15 s by default, as aiohttp's
  connector's ``keepalive_timeout``);
- reading pauses when more than ``_HIGH_WATER`` bytes are buffered (a slow client), so a stream is
  never buffered without bound;
- **a stray response is never taken for the answer**: when the request carries ``x-request-id``
  (the router sends exactly one on every request to an engine, P/D legs included: the request's id,
  :func:`kvroute.server.observe.observer.request_id`) and the final response head carries one too,
  they must be equal. A response sent late on a keep-alive connection that has meanwhile carried
  the next request looks, to HTTP/1.1 framing, exactly like that request's answer; its echoed id
  does not. On a mismatch the connection is closed, the response
  is never returned (so nothing of it is relayed), it is counted (:attr:`H1Transport.strays`) and
  logged (rate-limited, escaped), and the request is sent again once on a fresh connection; a
  mismatch there too is an :class:`UpstreamConnectError`. A response without the header is accepted:
  the guarantee needs an engine that echoes the id (vLLM with ``--enable-request-id-headers``,
  kvroute's emulated engine);
- ``http://`` and ``https://`` base URLs (with a path prefix or not) are served here (https with
  ``ssl_context``, else the system's default verification); the pool's check for waiting bytes
  before reuse is skipped on TLS connections (the socket may hold TLS records that carry no data),
  the rest holds. Other URLs go to :class:`AiohttpTransport`, which reports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import ssl
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from urllib.parse import urlsplit

import httptools

from kvroute.server.wire.http import HOP_BY_HOP
from kvroute.server.wire.httperrors import RateLimitedLog
from kvroute.server.wire.transport import (
    AiohttpTransport,
    Transport,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamStalledError,
    UpstreamTimeoutError,
)

__all__ = ["H1Transport"]

_HIGH_WATER = 1 << 20  # bytes buffered before reading pauses
_LOW_WATER = 1 << 16  # bytes left buffered when reading resumes
_ID = "x-request-id"  # the header an engine echoes: the request's id on its answer

log = logging.getLogger(__name__)


class _Extra(Exception):
    """A second response began on a connection whose response had ended (raised in a parser
    callback, so that ``feed_data`` stops at once)."""


class _Conn(asyncio.Protocol):
    """One keep-alive connection; carries one request at a time. ``head`` resolves with the
    final response head (or an exception); ``body`` holds unread body pieces; ``complete`` is set
    when the response ended; ``error`` when the connection broke first.

    Invariant: once ``complete`` is set, no further byte is accepted until :meth:`begin`: a byte
    that arrives after the end of the response (in the same read or later, while the connection
    waits in the pool) closes the connection, so it can never be read as the next request's answer.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, live: set[_Conn]) -> None:
        self.loop = loop
        self.live = live  # the pool's open connections; this one leaves it when lost
        self.transport: asyncio.Transport | None = None
        self.fd = -1  # the socket's file descriptor (-1: unknown)
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False  # has served a response before (pooled)
        self.timed_out = False
        self.paused = False  # reading paused (too much body buffered); never reset but by take()
        self.idle_since = 0.0  # when it last went back to the pool (the pool's clock, seconds)
        self._begin()

    def _begin(self) -> None:
        self.head: asyncio.Future[None] = self.loop.create_future()
        self.status = 0
        self.content_type = "application/json"
        self.delimited = False  # Content-Length or chunked: the end is in the stream, not at EOF
        self.keep_alive = False  # the server lets the connection carry another request
        self.body: list[bytes] = []
        self.buffered = 0
        self.got_bytes = False
        self.complete = False
        self.error: Exception | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.echoed: bytes | None = None  # the final head's x-request-id (None: absent)
        self._message()

    def _message(self) -> None:
        """Reset what one message's head says (a final response may follow interim ones)."""
        self.in_head = True  # headers seen now are the head's, not trailers
        self.interim = False  # the message is a 1xx other than 101: consumed, never relayed
        self.m_type = b"application/json"
        self.m_length = False  # Content-Length seen
        self.m_te = False  # Transfer-Encoding seen
        self.m_chunked = False  # its last transfer coding is chunked (RFC 9112 section 6.1)
        self.m_rid: bytes | None = None  # x-request-id (two different values: b"", never a match)

    def begin(self) -> None:
        """Reset the per-response state for the next request on this connection (one that
        :attr:`reusable` allowed back into the pool)."""
        self.reused = True
        self._begin()

    # ---- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self.fd = sock.fileno()  # not with TLS: the socket may hold TLS records that are no data
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        if self.complete:  # bytes past the end of the response, or while idle in the pool
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # a 101: its head was taken, the rest is not HTTP
            self.close()
        except httptools.HttpParserError as exc:
            if not self.complete:  # else: a second message began after the end (on_message_begin)
                self._fail(UpstreamBrokenError(f"malformed response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.live.discard(self)
        if self.complete:
            return
        if self.head.done() and not self.delimited and self.error is None:
            self.on_message_complete()  # a close-delimited body ends at EOF
            return
        self._fail(UpstreamBrokenError(f"connection lost: {exc!r}" if exc else "connection closed"))

    def pause_writing(self) -> None:  # request bodies are small; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # ---- httptools callbacks -------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.complete:
            raise _Extra
        self._message()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_head:  # a trailer: never changes what the head said
            return
        low = name.lower()
        if low == b"content-type":
            self.m_type = value
        elif low == b"content-length":
            self.m_length = True
        elif low == b"x-request-id":
            value = value.strip(b" \t")
            self.m_rid = value if self.m_rid is None or self.m_rid == value else b""
        elif low == b"transfer-encoding":
            self.m_te = True
            codings = [c for c in value.split(b",") if c.strip()]
            if codings:  # several header lines form one list: the last line's last coding counts
                self.m_chunked = codings[-1].strip().lower() == b"chunked"

    def on_headers_complete(self) -> None:
        self.in_head = False
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue, 102 Processing, 103 Early Hints: the answer follows
            return
        self.status = status
        self.content_type = self.m_type.decode("latin-1")
        self.echoed = self.m_rid
        # RFC 9112 section 6.3: Transfer-Encoding overrides Content-Length; a last coding other
        # than chunked means the body ends when the connection closes
        self.delimited = self.m_chunked if self.m_te else self.m_length
        self.keep_alive = status != 101 and self.parser.should_keep_alive()  # llhttp resets it later
        if status == 101:  # switching protocols: no HTTP answer follows; the connection is closed
            self.complete = True
        if not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.complete:  # a 101's bytes: not HTTP
            raise _Extra
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True
        if not self.head.done():
            self.head.set_result(None)
        self._wake()

    # ---- helpers -------------------------------------------------------------------------------

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if not self.head.done():
            self.head.set_exception(exc)
            self.head.exception()  # retrieved: no "never retrieved" warning if nobody waits
        self._wake()

    def take(self) -> bytes:
        """All buffered body bytes (resumes reading when it was paused)."""
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return data

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    @property
    def reusable(self) -> bool:
        """The response ended at a message boundary, nothing of it is left unread, the server
        keeps the connection open, and its reader runs."""
        return (
            self.complete
            and self.keep_alive
            and not self.closed
            and self.error is None
            and not self.paused
            and not self.body
        )

    def quiet(self) -> bool:
        """No byte is waiting to be read (nor EOF) on the socket now: checked before reuse, for
        bytes that came in since the event loop last polled it."""
        if self.fd < 0:
            return True
        try:
            poller = select.poll()  # not select.select: descriptors above 1023 are common here
            poller.register(self.fd, select.POLLIN)
            return not poller.poll(0)
        except (OSError, ValueError):
            return False


class _H1Response:
    """An :class:`~kvroute.server.wire.transport.UpstreamResponse` over one :class:`_Conn`."""

    __slots__ = ("_conn", "_done", "_keep", "_pool", "_read_timeout_s", "content_type", "status")

    def __init__(self, conn: _Conn, pool: _Pool, read_timeout_s: float | None, keep: bool = True) -> None:
        self._conn = conn
        self._pool = pool
        self._read_timeout_s = read_timeout_s
        self._keep = keep  # False: closed at release even when reusable (H1Transport._exchange)
        self._done = False
        self.status = conn.status
        self.content_type = conn.content_type

    @property
    def ended(self) -> bool:
        conn = self._conn
        return conn.complete and not conn.body and conn.error is None

    async def read(self) -> bytes:
        parts = [chunk async for chunk in self.iter_chunks()]
        return b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                yield conn.take()
                continue
            if conn.complete:
                return
            if conn.error is not None:
                raise conn.error
            waiter = conn.waiter = conn.loop.create_future()
            try:
                if self._read_timeout_s is None:
                    await waiter
                else:
                    async with asyncio.timeout(self._read_timeout_s):
                        await waiter
            except TimeoutError:
                raise UpstreamStalledError(f"no data for {self._read_timeout_s} s") from None
            finally:
                conn.waiter = None

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        if self._keep and self._conn.reusable:
            self._pool.put(self._conn)
        else:
            self._conn.close()

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._conn.close()


class _Pool:
    """Idle keep-alive connections to one ``host:port`` (most recently used first out).

    Invariant: ``idle`` is in the order the connections went idle (``idle_since`` never decreases
    along it; ``clock`` is monotonic): the oldest first, the next one handed out last. A connection
    idle for more than ``keepalive_s`` seconds (None: no limit) is closed, never handed out."""

    __slots__ = (
        "base",
        "clock",
        "host",
        "hostport",
        "idle",
        "keepalive_s",
        "live",
        "max_idle",
        "port",
        "prefix",
        "retired",
        "tls",
    )

    def __init__(
        self,
        host: str,
        port: int,
        max_idle: int,
        tls: bool = False,
        prefix: str = "",
        keepalive_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.clock = clock
        self.host = host
        self.port = port
        self.tls = tls
        self.prefix = prefix  # the base URL's path, prepended to every request's
        self.base = f"{'https' if tls else 'http'}://{host}:{port}{prefix}"
        self.hostport = f"{host}:{port}".encode("latin-1")
        self.idle: list[_Conn] = []
        self.live: set[_Conn] = set()  # every open connection, idle or carrying a request
        self.max_idle = max_idle
        self.retired = False  # its backend is gone: a connection released now is closed, not kept

    def get(self) -> _Conn | None:
        idle = self.idle
        if idle and self.keepalive_s is not None:
            self.expire(self.clock() - self.keepalive_s)
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if conn.quiet():
                return conn
            conn.close()  # bytes (or EOF) arrived while it was idle
        return None

    def put(self, conn: _Conn) -> None:
        if self.retired or len(self.idle) >= self.max_idle:
            conn.close()
        else:
            conn.idle_since = self.clock()
            self.idle.append(conn)

    def expire(self, cutoff: float) -> int:
        """Close the idle connections that went idle before ``cutoff`` (the pool's clock); returns
        how many."""
        idle = self.idle
        n = 0
        while n < len(idle) and idle[n].idle_since < cutoff:
            idle[n].close()
            n += 1
        del idle[:n]
        return n

    def retire(self) -> None:
        """Close the idle connections now, and each one in use when its response is released."""
        self.retired = True
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    def close(self) -> None:
        """Close every connection, idle or in use (their responses then break off)."""
        for conn in list(self.live):
            conn.close()
        self.idle.clear()


class H1Transport:
    """The router's default transport (see the module docstring). Create and use it inside one
    event loop; ``close()`` closes the idle connections (and the fallback's session).
    ``keepalive_s``: the longest a connection waits idle in a pool (None: until the engine closes
    it), by ``clock`` (monotonic seconds)."""

    def __init__(
        self,
        connect_timeout_s: float = 2.0,
        read_timeout_s: float | None = 600.0,
        max_idle: int = 256,
        fallback: Transport | None = None,
        ssl_context: ssl.SSLContext | None = None,
        keepalive_s: float | None = 15.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._keepalive_s = keepalive_s
        self._clock = clock
        self._connect_timeout_s = connect_timeout_s
        self._ssl = ssl_context  # for https backends (None: the system's default, made when needed)
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._pools: dict[str, _Pool | None] = {}  # base URL -> pool (None: not http or https)
        self._fallback = fallback
        self._fallback_args = (connect_timeout_s, read_timeout_s or 600.0)
        self.strays = 0  # responses whose echoed x-request-id was another request's (module docstring)
        self._stray_log = RateLimitedLog(log, interval_s=10.0)

    def _pool(self, base_url: str) -> _Pool | None:
        try:
            return self._pools[base_url]
        except KeyError:
            pass
        parts = urlsplit(base_url)
        pool = None
        tls = parts.scheme == "https"
        if (tls or parts.scheme == "http") and parts.hostname and not parts.query and not parts.fragment:
            try:
                port = parts.port or (443 if tls else 80)
            except ValueError:  # a malformed port: let aiohttp report it
                port = -1
            if port > 0:
                prefix = parts.path.rstrip("/")
                pool = _Pool(
                    parts.hostname, port, self._max_idle, tls, prefix, self._keepalive_s, self._clock
                )
        self._pools[base_url] = pool
        return pool

    async def send(
        self,
        base_url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        pool = self._pool(base_url)
        if pool is None:
            if self._fallback is None:
                self._fallback = AiohttpTransport(*self._fallback_args)
            return await self._fallback.send(base_url, method, path, body, headers, timeout_s)
        request = _request_bytes(method, pool.prefix + path, pool.hostport, body, headers)
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        sent_id = _sent_id(headers)
        conn = pool.get()
        if conn is not None:
            conn.begin()
            try:
                resp = await self._exchange(conn, pool, request, deadline, bool(body))
            except UpstreamConnectError:
                if conn.got_bytes or conn.timed_out:
                    raise
                # the pooled connection was closed under us before answering: one fresh try
            else:
                if self._answers(conn, pool, sent_id):
                    return resp
                # a stray response: nothing of it was returned, so one fresh try
        conn = await self._connect(pool, loop, deadline)
        resp = await self._exchange(conn, pool, request, deadline, bool(body))
        if not self._answers(conn, pool, sent_id):
            raise UpstreamConnectError(f"{pool.base}: answered with another request's id")
        return resp

    def _answers(self, conn: _Conn, pool: _Pool, sent_id: bytes | None) -> bool:
        """The response on ``conn`` may be the answer to the request that carried ``sent_id``: no
        id was sent, none was echoed, or the echo is equal. Else it is a stray: ``conn`` is closed
        (the engine takes that as a cancelled request), counted and logged."""
        echoed = conn.echoed
        if sent_id is None or echoed is None or echoed == sent_id:
            return True
        conn.close()
        self.strays += 1
        self._stray_log.emit(
            "stray",
            f"stray response from {pool.base} on a {'reused' if conn.reused else 'fresh'} connection: "
            f"sent x-request-id {sent_id.decode('latin-1')!r}, got {echoed.decode('latin-1')!r}; "
            "connection closed, response dropped",
        )
        return False

    async def _connect(self, pool: _Pool, loop: asyncio.AbstractEventLoop, deadline: float | None) -> _Conn:
        limit = self._connect_timeout_s
        if deadline is not None:
            limit = min(limit, max(deadline - loop.time(), 0.0))
        context = None
        if pool.tls:
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, pool.live), pool.host, pool.port, ssl=context
                )
        except (TimeoutError, OSError) as exc:  # ssl.SSLError is an OSError
            raise UpstreamConnectError(f"{pool.base}: {exc!r}") from None
        return conn

    async def _exchange(
        self, conn: _Conn, pool: _Pool, request: bytes, deadline: float | None, has_body: bool = False
    ) -> _H1Response:
        assert conn.transport is not None
        if conn.closed:
            raise UpstreamConnectError("connection closed")
        try:
            conn.transport.write(request)
            if deadline is not None:
                async with asyncio.timeout_at(deadline):
                    await conn.head
            elif self._read_timeout_s is not None:
                async with asyncio.timeout(self._read_timeout_s):
                    await conn.head
            else:
                await conn.head
        except TimeoutError:
            conn.timed_out = True
            conn.close()
            raise UpstreamTimeoutError(f"{pool.base}: no response in time") from None
        except UpstreamBrokenError as exc:
            conn.close()
            raise UpstreamConnectError(f"{pool.base}: {exc}") from None
        except BaseException:  # cancelled: the request is in flight, so the connection is unusable
            conn.close()
            raise
        # an error answer to a request with a body may have come before the engine read that body
        # (module docstring): its connection is not reused
        return _H1Response(conn, pool, self._read_timeout_s, keep=not (has_body and conn.status >= 400))

    def open_connections(self) -> dict[str, int]:
        """Base URL → the connections open to it (idle or carrying a request), for each pool."""
        return {url: len(pool.live) for url, pool in self._pools.items() if pool is not None}

    def forget(self, base_url: str) -> None:
        """``base_url``'s backend is gone (removed from the router): its idle keep-alive
        connections are closed now, those carrying a request when their response is released, and
        its pool is dropped (a later call to the same URL starts a new one). Without this, a
        removed backend that keeps idle connections open (aiohttp's server for 75 s, some never)
        holds up to ``max_idle`` descriptors per worker, and one pool per URL ever used stays."""
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.retire()

    def prune(self, keep: Collection[str]) -> None:
        """:meth:`forget` every base URL with a pool that is not in ``keep`` (the backends listed
        now), and close every connection idle for more than ``keepalive_s`` seconds by the
        injected clock's now. Called again and again, it also catches a pool made for a removed
        backend after its removal (a health check or scrape that began before it)."""
        for url in [u for u in self._pools if u not in keep]:
            self.forget(url)
        if self._keepalive_s is not None:
            cutoff = self._clock() - self._keepalive_s
            for pool in self._pools.values():
                if pool is not None and pool.idle:
                    pool.expire(cutoff)

    async def close(self) -> None:
        for pool in self._pools.values():
            if pool is not None:
                pool.close()
        self._pools.clear()
        if self._fallback is not None:
            with contextlib.suppress(Exception):
                await self._fallback.close()
            self._fallback = None


_SKIP = HOP_BY_HOP | {"host", "content-length"}


def _sent_id(headers: Mapping[str, str] | None) -> bytes | None:
    """The ``x-request-id`` value :func:`_request_bytes` sends (the last given in any case), as
    bytes on the wire; None when it sends none."""
    if not headers:
        return None
    found = None
    for k, v in headers.items():
        if k.lower() == _ID:
            found = v
    if found is None or "\r" in found or "\n" in found:
        return None
    return found.strip(" \t").encode("utf-8", "surrogateescape")


def _request_bytes(
    method: str, path: str, hostport: bytes, body: bytes | None, headers: Mapping[str, str] | None
) -> bytes:
    """The request head and body as one buffer. Header names/values with CR or LF are dropped (no
    header injection); hop-by-hop headers are dropped; ``Host`` and ``Content-Length`` are always
    ours; names are matched case-insensitively, and of two that differ only in case the last one
    given is sent (one line per name)."""
    lines = [f"{method} {path} HTTP/1.1\r\n".encode("latin-1"), b"Host: ", hostport, b"\r\n"]
    if headers:
        named = {k.lower(): (k, v) for k, v in headers.items()}
        for low, (k, v) in named.items():
            if low in _SKIP or "\r" in k or "\n" in k or "\r" in v or "\n" in v:
                continue
            lines.append(f"{k}: {v}\r\n".encode("utf-8", "surrogateescape"))
    if body is not None:
        lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        lines.append(body)
    else:
        lines.append(b"\r\n")
    return b"".join(lines)
