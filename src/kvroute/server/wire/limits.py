"""Limits on client connections: how many at once, and how long a request head, a body, an idle
keep-alive connection and a write to the client may take. One :class:`ClientLimits` per server;
:class:`LimitedRunner` applies it to every connection the server accepts.

- **connections**: a connection accepted while ``max_connections`` others are open is answered a
  JSON 503 (``service_unavailable``, ``Retry-After``) to its first request and closed; it gets
  ``header_timeout_s`` from its opening to send that request's head.
- **head**: a request head must be complete ``header_timeout_s`` seconds after its first byte
  arrived, else the client gets a JSON 408 and the connection is closed (a partial head never holds
  a connection for longer).
- **keep-alive**: a connection with no request in progress and no byte of a next one is closed
  ``keepalive_timeout_s`` seconds after it opened or after its last response (aiohttp's own timer,
  whose default would be 3,630 s).
- **body**: :func:`read_body_within` reads a request body within ``body_timeout_s`` seconds of its
  head, else ApiError(408) whose answer closes the connection (after at most :data:`LINGER_S`).
- **writes**: :func:`write_within` gives a write to the client ``write_timeout_s`` seconds; a client
  that stops reading has its connection aborted and the write raises ``ConnectionResetError``, which
  the relays treat as a client that went away (the engine's request is aborted, the lease released).
  The answer's last writes (a whole buffered body, written by aiohttp once the handler returned) get
  ``write_timeout_s`` too, then the connection is aborted.

Units: seconds. Nothing here reads a clock but the event loop's timers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from kvroute.server.wire.http import read_body
from kvroute.server.wire.httperrors import (
    JsonErrorRunner,
    _JsonRequestHandler,
    _JsonServer,
    http_error,
)
from kvroute.server.wire.validate import ApiError, error_body

__all__ = ["LINGER_S", "ClientLimits", "LimitedRunner", "read_body_within", "write_within"]

LINGER_S = 2.0
"""Seconds the rest of an answered request's unread body is still read (and dropped) before its
connection closes, so that the client sees the answer rather than a reset (aiohttp's default: 10)."""


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """The limits of one server's client connections (module docstring); seconds for ``*_s``.
    Defaults are :class:`~kvroute.server.config.RouterConfig`'s."""

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 75.0
    write_timeout_s: float = 30.0
    retry_after_s: int = 1


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 JSON error answer that closes the connection (written to the transport
    directly, where no request object exists)."""
    etype = "service_unavailable" if status == 503 else "invalid_request_error"
    body = error_body(ApiError(status, message, etype=etype))
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class _LimitedHandler(_JsonRequestHandler):
    """aiohttp's connection handler with the connection cap and the head timeout (module docstring);
    its server sets ``limits``."""

    limits: ClientLimits

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.over = False  # accepted beyond max_connections: its first request gets a 503
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        manager = self._manager
        if manager is not None and len(manager.connections) > self.limits.max_connections:
            self.over = True
            self._head_timer = self._loop.call_later(self.limits.header_timeout_s, self._head_late)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiter = self._waiter
        if self._head_timer is None and data and waiter is not None and not waiter.done():
            self._head_timer = self._loop.call_later(self.limits.header_timeout_s, self._head_late)
        super().data_received(data)
        if self._head_timer is not None and self._messages:  # the head is complete (or refused)
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        """The head timeout fired: a connection still waiting for a complete head gets a 408."""
        self._head_timer = None
        waiter = self._waiter
        if self.transport is None or self._messages or waiter is None or waiter.done():
            return
        limit = self.limits.header_timeout_s
        peer = self.transport.get_extra_info("peername")
        self.limiter.emit("slow-head", f"client {peer}: no complete request head in {limit:g} s: closed")
        self.transport.write(
            _raw_error(408, "Request Timeout", f"the request head was not complete within {limit:g} s")
        )
        self.force_close()

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        """aiohttp's last writes of an answer (a buffered body, a stream's end), given
        ``write_timeout_s``: a client that does not take them has its connection aborted."""
        try:
            async with asyncio.timeout(self.limits.write_timeout_s):
                return await super().finish_response(request, resp, start_time)
        except TimeoutError:
            if self.transport is not None:
                self.transport.abort()
            limit = self.limits.write_timeout_s
            self.limiter.emit("slow-reader", f"client {request.remote} took no answer in {limit:g} s: closed")
            return resp, True

    async def _handle_request(
        self, request: BaseRequest, start_time: float | None, request_handler: Any
    ) -> Any:
        if not self.over:
            return await super()._handle_request(request, start_time, request_handler)
        limits = self.limits
        self.limiter.emit(
            "over-cap", f"client {request.remote}: over max_connections={limits.max_connections}: 503"
        )
        resp = http_error(
            503,
            f"too many client connections (max_connections={limits.max_connections}); retry later",
            {"Retry-After": str(limits.retry_after_s)},
        )
        resp.force_close()
        return await self.finish_response(request, resp, start_time)


class _LimitedServer(_JsonServer):
    limits: ClientLimits

    def __call__(self) -> RequestHandler:
        handler = super().__call__()
        handler.__class__ = _LimitedHandler  # same state; it adds behaviour only
        assert isinstance(handler, _LimitedHandler)
        handler.limits = self.limits
        return handler


class LimitedRunner(JsonErrorRunner):
    """:class:`~kvroute.server.wire.httperrors.JsonErrorRunner` whose connections keep ``limits``
    (module docstring); aiohttp's keep-alive timeout is ``limits.keepalive_timeout_s``."""

    def __init__(self, app: web.Application, limits: ClientLimits, *args: Any, **kwargs: Any) -> None:
        kwargs["keepalive_timeout"] = limits.keepalive_timeout_s
        kwargs["lingering_time"] = min(LINGER_S, limits.body_timeout_s)
        super().__init__(app, *args, **kwargs)
        self.limits = limits

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _LimitedServer  # same state; only the connection handler class differs
        assert isinstance(server, _LimitedServer)
        server.limits = self.limits
        return server


async def read_body_within(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The whole body (see :func:`~kvroute.server.wire.http.read_body`: 413 beyond ``limit`` bytes)
    within ``timeout_s`` seconds, else ApiError(408) with ``close`` set (its answer closes the
    connection: the rest of the body is never read)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await read_body(request, limit)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", close=True) from None


async def write_within(
    out: web.StreamResponse, request: web.Request, data: bytes, timeout_s: float, eof: bool = False
) -> None:
    """``out.write(data)`` (``eof``: ``out.write_eof(data)``), given ``timeout_s`` seconds (a write
    waits only while the client's socket buffers are full: it stopped reading). On timeout the
    client's connection is aborted and ``ConnectionResetError`` raised."""
    try:
        async with asyncio.timeout(timeout_s):
            await (out.write_eof(data) if eof else out.write(data))
    except TimeoutError:
        _abort(request)
        raise ConnectionResetError(
            f"the client read nothing for {timeout_s:g} s: connection closed"
        ) from None


def _abort(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()  # drop the unsent bytes: close() would wait for the client to read them
    logging.getLogger("kvroute.server").debug("client %s stopped reading: connection aborted", request.remote)
