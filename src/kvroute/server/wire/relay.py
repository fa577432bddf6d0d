"""The relay stage: one upstream response carried to the client, and what became of it.

Rules (the pipeline's module docstring has the whole request's):

- nothing is sent to the client before the first upstream body byte; a response that breaks before
  it is no answer at all (``Relayed.response is None``: the pipeline retries elsewhere); one whose
  first body byte does not come within the transport's read timeout, the connection up all along,
  is the request's own slowness, not a failing backend: a 504 JSON error (:func:`timed_out`), the
  upstream request aborted (the engine cancels it), no retry;
- a non-streamed request, or a response that is not a 200, is buffered and answered whole; a body
  that breaks off becomes a 502 JSON error;
- a stream is passed through chunk by chunk, as the upstream's reads deliver them (what arrived
  together goes out together; the last chunk and the end of the stream go out in one write when
  the upstream is known to have ended, ``UpstreamResponse.ended``); one that breaks off ends with
  an SSE error event (``data: {"error": ...}`` then ``data: [DONE]``, after a blank line that ends
  the event the break cut short, if any: :func:`error_event`); a client that goes away
  ends it (at any chunk or at the final end of the stream: a ``cancelled`` outcome, no traceback);
- an upstream status that is not a final answer (``101 Switching Protocols``; interim 1xx never
  reach the relay) or not an HTTP status at all becomes a 502 JSON error: the client never gets a
  1xx as its answer;
- while the router shuts down (``draining()`` true), a stream cancelled by the drain ends with an SSE
  error event too.

The relay counts nothing and records nothing: it returns a frozen :class:`Relayed` and the settle
stage books it. The upstream response is released (read to its end) or aborted on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from kvroute.server.wire.http import error_response
from kvroute.server.wire.limits import write_within
from kvroute.server.wire.transport import (
    UpstreamBrokenError,
    UpstreamResponse,
    UpstreamStalledError,
    UpstreamTooLargeError,
    read_capped,
)
from kvroute.server.wire.validate import ApiError, error_body

__all__ = [
    "BROKEN",
    "CANCELLED",
    "CLIENT_ERROR",
    "DRAINED",
    "OK",
    "UNCOUNTED",
    "UPSTREAM_ERROR",
    "Relayed",
    "error_event",
    "relay",
    "shutting_down",
    "timed_out",
]

TAIL_BYTES = 8192
"""How much of a stream's end is kept to read its usage (bytes)."""

OK = "ok"
CLIENT_ERROR = "client_error"  # a 4xx passed through from the backend
UPSTREAM_ERROR = "upstream_error"  # a 5xx passed through, or the response broke off after its first byte
CANCELLED = "cancelled"  # the client went away mid-stream
DRAINED = "drained"  # ended by the shutdown's drain mid-stream
BROKEN = "broken"  # broke before its first byte: nothing sent, retry elsewhere
UNCOUNTED = "uncounted"  # cancelled while buffering: the handler's cancellation goes on, no counter


def shutting_down(detail: str) -> ApiError:
    """The 503 of a router that is shutting down."""
    return ApiError(503, f"the router is shutting down: {detail}", etype="service_unavailable")


def timed_out(detail: str) -> ApiError:
    """The 504 of a request the backend took but did not answer in time (the client's own request
    took long: the backend is not ejected)."""
    return ApiError(504, f"the backend did not answer in time: {detail}", etype="timeout_error")


@dataclass(frozen=True, slots=True)
class Relayed:
    """What the relay made of one upstream response.

    ``response``: the client's answer (None when ``outcome == BROKEN``); ``status``: its status for
    the decision record (None when the stream never started or the client's cancellation goes on);
    ``complete``: the answer reached its end; ``end``: the body (buffered 200) or the stream's last
    ``TAIL_BYTES`` (a stream that ended normally), to read the usage from, else None;
    ``first_byte``: ``time.perf_counter()`` at the first upstream byte (0.0 when none came);
    ``cancelled``: the handler was cancelled (the client left) and must go on being cancelled once
    the outcome is settled; ``error``: why a ``BROKEN`` response broke."""

    outcome: str
    response: web.StreamResponse | None = None
    status: int | None = None
    complete: bool = False
    end: bytes | None = None
    first_byte: float = 0.0
    cancelled: bool = False
    error: str = ""


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


async def relay(
    request: web.Request,
    up: UpstreamResponse,
    stream: bool,
    headers: Mapping[str, str],
    on_first_byte: Callable[[], None],
    after_first: Callable[[], None] | None,
    draining: Callable[[], bool],
    write_timeout_s: float | None = None,
    max_response_bytes: int | None = None,
) -> Relayed:
    """Carry ``up`` to the client of ``request`` (module docstring). ``headers``: added to the
    answer; ``on_first_byte``: called when the first upstream byte arrives (before anything is
    sent); ``after_first``: called once the first bytes reached the client (a stream: on the next
    loop turn) or the whole body was read (buffered); ``draining``: true while the router's
    shutdown ends the requests in flight; ``write_timeout_s``: a stream write the client does not
    take within it (seconds; None: no limit) ends the stream as a client that went away, its
    connection aborted (:func:`kvroute.server.wire.limits.write_within`); ``max_response_bytes``:
    an answer read whole (not a stream) that grows past it is not read further, the client gets a
    502 and the connection is aborted (None: no limit)."""
    done = False
    if not 200 <= up.status <= 599:
        up.abort()
        err = ApiError(
            502, f"backend answered status {up.status}, not a final answer", etype="upstream_error"
        )
        resp = error_response(err)
        resp.headers.update(headers)
        return Relayed(UPSTREAM_ERROR, resp, 502)
    chunks: AsyncIterator[bytes] = up.iter_chunks()
    try:
        try:
            first = await anext(chunks)
        except StopAsyncIteration:
            first = b""
        except UpstreamStalledError as exc:
            resp = error_response(timed_out(str(exc)))
            resp.headers.update(headers)
            return Relayed(UPSTREAM_ERROR, resp, 504)
        except UpstreamBrokenError as exc:
            return Relayed(BROKEN, error=str(exc))
        on_first_byte()
        t_first = time.perf_counter()
        if not stream or up.status != 200:
            try:
                relayed = await _buffered(up, first, chunks, headers, t_first, max_response_bytes)
            except asyncio.CancelledError:
                return Relayed(UNCOUNTED, first_byte=t_first, cancelled=True)
            except UpstreamTooLargeError as exc:  # not read to its end: the connection is aborted
                resp = error_response(ApiError(502, f"backend {exc}", etype="upstream_error"))
                resp.headers.update(headers)
                return Relayed(UPSTREAM_ERROR, resp, 502, first_byte=t_first)
            done = True
            if after_first is not None:
                after_first()
            return relayed
        out = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
        if headers:
            out.headers.update(headers)
        out.enable_chunked_encoding()
        relayed = await _stream(
            request, out, up, first, chunks, after_first, draining, t_first, write_timeout_s
        )
        done = relayed.end is not None
        return relayed
    finally:
        if done:
            up.release()
        else:
            up.abort()


async def _buffered(
    up: UpstreamResponse,
    first: bytes,
    chunks: AsyncIterator[bytes],
    headers: Mapping[str, str],
    t_first: float,
    limit: int | None,
) -> Relayed:
    """The whole answer read, then relayed in one response; :class:`UpstreamTooLargeError` once it
    is over ``limit`` bytes (None: no limit)."""
    try:
        body = await read_capped(chunks, limit, first)
    except UpstreamTooLargeError:
        raise
    except UpstreamBrokenError as exc:
        resp = error_response(ApiError(502, f"backend response broke off: {exc}", etype="upstream_error"))
        resp.headers.update(headers)
        return Relayed(UPSTREAM_ERROR, resp, 502, False, None, t_first)
    status = up.status
    outcome = OK if status < 400 else CLIENT_ERROR if status < 500 else UPSTREAM_ERROR
    resp = web.Response(status=status, body=body, headers={"Content-Type": up.content_type})
    resp.headers.update(headers)
    return Relayed(outcome, resp, status, status < 500, body if status == 200 else None, t_first)


async def _stream(
    request: web.Request,
    out: web.StreamResponse,
    up: UpstreamResponse,
    first: bytes,
    chunks: AsyncIterator[bytes],
    after_first: Callable[[], None] | None,
    draining: Callable[[], bool],
    t_first: float,
    timeout_s: float | None = None,
) -> Relayed:
    """Stream to the client; ``end`` is the stream's last bytes when it ended normally. A chunk
    after which ``up`` has ended goes out with the stream's end (one write); the final
    :func:`_eof` is then a no-op."""

    def ended(outcome: str, end: bytes | None = None) -> Relayed:
        status = out.status if out.prepared else None
        return Relayed(outcome, out, status, end is not None, end, t_first)

    tail = first  # the last bytes sent (or being sent) to the client
    try:
        await _write(out, request, first, prepare=True, last=up.ended, timeout_s=timeout_s)
        if after_first is not None:
            asyncio.get_running_loop().call_soon(after_first)
        try:
            async for chunk in chunks:
                tail = (tail + chunk)[-TAIL_BYTES:] if len(chunk) < TAIL_BYTES else chunk
                await _write(out, request, chunk, last=up.ended, timeout_s=timeout_s)
        except UpstreamBrokenError as exc:
            err = ApiError(502, f"backend stream broke off: {exc}", etype="upstream_error")
            with contextlib.suppress(_ClientGone, ConnectionError, RuntimeError):  # counted once
                await _write(out, request, error_event(err, tail))
                await out.write_eof()
            return ended(UPSTREAM_ERROR)
        await _eof(out)  # a client that leaves at the very end is gone like one that leaves mid-way
    except _ClientGone:
        return ended(CANCELLED)
    except asyncio.CancelledError:
        if not (draining() and out.prepared):
            return Relayed(CANCELLED, out, None, False, None, t_first, cancelled=True)
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        err = shutting_down("stream not finished in time")
        with contextlib.suppress(_ClientGone, ConnectionError, RuntimeError):
            await _write(out, request, error_event(err, tail))
            await out.write_eof()
        return ended(DRAINED)
    return ended(OK, tail)


def error_event(err: ApiError, tail: bytes) -> bytes:
    """``err`` as the SSE event that ends a stream, then ``data: [DONE]``, each an event of its own:
    after a blank line when the stream's last bytes (``tail``) left an event unfinished (the
    upstream's reads end anywhere, inside a line too), else the error would join that event."""
    done = not tail or tail.endswith((b"\n\n", b"\r\r", b"\r\n\r\n"))
    return (b"" if done else b"\n\n") + b"data: " + error_body(err) + b"\n\ndata: [DONE]\n\n"


async def _eof(out: web.StreamResponse) -> None:
    try:
        await out.write_eof()
    except (ConnectionError, RuntimeError) as exc:
        raise _ClientGone(str(exc)) from None


async def _write(
    out: web.StreamResponse,
    request: web.Request,
    data: bytes,
    prepare: bool = False,
    last: bool = False,
    timeout_s: float | None = None,
) -> None:
    """``data`` to the client (after the head when ``prepare``); ``last``: with the stream's end;
    ``timeout_s``: see :func:`relay`."""
    try:
        if prepare:
            await out.prepare(request)
        if timeout_s is not None:
            if last or data:
                await write_within(out, request, data, timeout_s, eof=last)
        elif last:
            await out.write_eof(data)
        elif data:
            await out.write(data)
    except (ConnectionError, RuntimeError) as exc:  # ClientConnectionResetError is a ConnectionError
        raise _ClientGone(str(exc)) from None
