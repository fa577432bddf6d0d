"""Every answer the router gives of its own making is an OpenAI-style JSON error, and every bad request
costs one log line at most (rate-limited), never a traceback.

Three places make such answers:

- **the handlers** raise :class:`~kvroute.server.wire.validate.ApiError` (400, 413, 429, 503, ...):
  :func:`json_errors` (an aiohttp middleware) renders any that escapes;
- **aiohttp's router** raises ``HTTPNotFound`` (unknown path), ``HTTPMethodNotAllowed`` (GET on a POST
  route, ...) and ``HTTPRequestEntityTooLarge``: :func:`json_errors` renders them as JSON with the same
  status (and ``Allow`` on a 405); any other exception out of a handler is a bug: a JSON 500, its
  traceback logged at most once per ``interval_s`` per exception type;
- **aiohttp's ``Expect`` check** runs before the middlewares, on every route (an unknown
  expectation raises ``HTTPExpectationFailed``): :class:`JsonErrorRunner` wraps the server's request
  handler so that an HTTP error escaping it is rendered as JSON too (a 417 on ``/health``,
  ``/metrics``, admin, debug and unknown routes alike);
- **aiohttp's HTTP parser** answers a malformed message (control characters in a header, a header over
  8190 bytes, bytes after ``Connection: close``, ...) before any handler runs, through
  ``RequestHandler.handle_error``, which would write ``text/plain`` and log "Error handling request"
  with a traceback. :class:`JsonErrorRunner` (an ``AppRunner``) makes the server use
  :class:`_JsonRequestHandler`, whose ``handle_error`` answers the JSON error and logs one line.

Logging: :class:`RateLimitedLog` writes at most one line per ``interval_s`` seconds per kind; the next
line of that kind says how many were suppressed meanwhile. Its lines quote the client (paths, parser
messages): each is escaped (:func:`kvroute.logtext.escape`), so a ``%0a`` in a path forges no line, and a
parser's message that quotes a credential header (``Authorization: …``) has its value redacted.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from kvroute.logtext import escape, redact
from kvroute.server.wire.http import EXPECT_ONLY, payload_error
from kvroute.server.wire.validate import ApiError, error_body

__all__ = ["JsonErrorRunner", "RateLimitedLog", "http_error", "json_errors"]

log = logging.getLogger("kvroute.server")

_JSON = "application/json"


class RateLimitedLog:
    """At most one log line per ``interval_s`` seconds (``clock``: monotonic) per kind; a line says how
    many of its kind were suppressed since the last one. Safe from several threads."""

    def __init__(
        self,
        logger: logging.Logger = log,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}  # kind -> time of its last line
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()
        self.lines = 0  # lines written
        self.suppressed_total = 0

    def emit(
        self, kind: str, message: str, level: int = logging.WARNING, exc: BaseException | None = None
    ) -> bool:
        """Log ``message`` (with ``exc``'s traceback when given) unless a line of ``kind`` was written
        less than ``interval_s`` ago; True if it was written."""
        now = self.clock()
        with self._lock:
            last = self._last.get(kind)
            if last is not None and now - last < self.interval_s:
                self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
                self.suppressed_total += 1
                return False
            self._last[kind] = now
            n = self._suppressed.pop(kind, 0)
            self.lines += 1
        message = escape(message)
        if n:
            message = f"{message} ({n} more suppressed in the last {self.interval_s:g} s)"
        self.logger.log(level, "%s", message, exc_info=exc)
        return True


def _etype(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 405:
        return "method_not_allowed"
    if status == 429:
        return "rate_limit_error"
    if status == 503:
        return "service_unavailable"
    return "server_error" if status >= 500 else "invalid_request_error"


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style JSON error answer of ``status`` with ``message``."""
    err = ApiError(status, message, etype=_etype(status))
    return web.Response(status=status, body=error_body(err), content_type=_JSON, headers=headers)


def _message(exc: web.HTTPException, request: BaseRequest) -> str:
    status = exc.status
    if status == 404:
        return f"no route {request.path!r}"
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return f"method {request.method} not allowed on {request.path!r} (allowed: {allowed})"
    if status == 413:
        return "request body too large"
    if status == 417:
        return EXPECT_ONLY
    text = exc.text or ""
    if text and not text.startswith(f"{status}:"):
        return text.strip()
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"HTTP {status}"


_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_errors(limiter: RateLimitedLog) -> Middleware:
    """The app's middleware: aiohttp's own HTTP errors and escaped ``ApiError`` as JSON; any other
    exception a JSON 500 (its traceback logged through ``limiter``)."""

    @web.middleware
    async def middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
        return await _answer(limiter, request, handler)

    return middleware


_ServerHandler = Callable[[BaseRequest], Awaitable[web.StreamResponse]]


def _json_http_errors(handler: _ServerHandler) -> _ServerHandler:
    """``handler`` (the app's, which runs the route's ``Expect`` check before the middlewares) with an
    HTTP error that escapes it answered as JSON: aiohttp would write it as text."""

    async def handle(request: BaseRequest) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return http_error(exc.status, _message(exc, request))

    return handle


async def _answer(limiter: RateLimitedLog, request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return http_error(exc.status, _message(exc, request), headers)
    except ApiError as err:
        return web.Response(status=err.status, body=error_body(err), content_type=_JSON)
    except web.RequestPayloadError as exc:  # a body that does not decode, read by a route itself
        bad = payload_error(exc)
        resp = web.Response(status=bad.status, body=error_body(bad), content_type=_JSON)
        resp.force_close()
        return resp
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as exc:
        limiter.emit(
            f"500:{type(exc).__name__}",
            f"internal error on {request.method} {request.path}: {type(exc).__name__}: {exc}",
            logging.ERROR,
            exc,
        )
        return http_error(500, "internal error")


class _JsonRequestHandler(RequestHandler):
    """aiohttp's connection handler, with its error answers in JSON and one rate-limited line each
    (through its server's ``limiter``)."""

    limiter: RateLimitedLog  # set by its server

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        detail = message or (str(exc) if exc is not None else "") or HTTPStatus(status).phrase
        # one line, bounded, no credential: it may quote the client's bytes (a bad header line)
        detail = escape(redact(detail), 200)
        if isinstance(exc, ConnectionError):  # the client went away mid-answer: not an error of ours
            self.limiter.emit("gone", f"client {request.remote} went away: {detail}", logging.DEBUG)
        elif status >= 500 and exc is not None:
            self.limiter.emit(
                f"{status}:{type(exc).__name__}",
                f"internal error handling a request from {request.remote}: {type(exc).__name__}: {detail}",
                logging.ERROR,
                exc,
            )
        else:
            kind = type(exc).__name__ if exc is not None else str(status)
            self.limiter.emit(f"http:{kind}", f"bad HTTP request from {request.remote}: {status} {detail}")
        if request.writer.output_size > 0:  # some of an answer went out: the connection is broken
            raise ConnectionError("response already started; cannot answer the error")
        text = "internal error" if status >= 500 else detail
        resp = http_error(status, text)
        resp.force_close()
        return resp

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """aiohttp's other error lines ("Unhandled exception", ...), rate-limited per message."""
        exc = kw.get("exc_info")
        fmt = str(args[0]) if args else "error"
        try:
            msg = fmt % args[1:]
        except (TypeError, ValueError):
            msg = fmt
        if isinstance(exc, ConnectionError):  # a broken connection (the client left): one debug line
            self.limiter.emit("gone", f"aiohttp: {msg}: {exc}", logging.DEBUG)
            return
        if isinstance(exc, web.RequestPayloadError):  # the client's body, drained after its 400
            detail = payload_error(exc).message
            self.limiter.emit("http:payload", f"bad request body from a client: {detail}: closed")
            return
        self.limiter.emit(f"aiohttp:{fmt}", f"aiohttp: {msg}", logging.ERROR, exc)


class _JsonServer(Server):
    limiter: RateLimitedLog

    def __call__(self) -> RequestHandler:
        handler = _JsonRequestHandler(self, loop=self._loop, **self._kwargs)
        handler.limiter = self.limiter
        return handler


class JsonErrorRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer malformed HTTP and HTTP errors raised before the
    middlewares (an unknown ``Expect``) with JSON errors (module docstring);
    add :func:`json_errors` to the app's middlewares for the handlers' side. ``limiter``: where the
    lines go (by default one of this runner's own)."""

    def __init__(self, app: web.Application, limiter: RateLimitedLog | None = None, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.limiter = limiter or RateLimitedLog()

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _JsonServer  # same state; only the connection handler class differs
        assert isinstance(server, _JsonServer)
        server.limiter = self.limiter
        server.request_handler = _json_http_errors(server.request_handler)
        return server
