"""The P/D router's relay of D's answer: unchanged but for ``usage.prompt_tokens_details.cached_tokens``,
which becomes P's when the request was disaggregated (vLLM's D reports only its local hit; the
proxies report P's). Streamed answers are rewritten event by event (only an SSE event carrying a
``usage`` object changes); a stream that breaks after its first byte ends with the same SSE error
event as the router's (:func:`kvroute.server.wire.relay.error_event`). Bytes in, bytes out.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
from aiohttp import web

from kvroute.server.wire.limits import write_within
from kvroute.server.wire.relay import error_event
from kvroute.server.wire.transport import UpstreamBrokenError, UpstreamResponse, read_capped
from kvroute.server.wire.validate import ApiError

__all__ = ["LegFailed", "relay_stream", "relay_whole", "rewrite_event", "set_cached"]

log = logging.getLogger("kvroute.server.pd")


class LegFailed(Exception):
    """An upstream failed before answering (connection error, a 5xx, a body broken before it was
    relayed): the caller tries another instance."""


def set_cached(obj: dict[str, Any], cached: int) -> bool:
    """Replace ``usage.prompt_tokens_details.cached_tokens`` in a response object; True if changed."""
    use = obj.get("usage")
    if not isinstance(use, dict):
        return False
    details = use.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = use["prompt_tokens_details"] = {}
    details["cached_tokens"] = cached
    return True


def rewrite_event(event: bytes, cached: int) -> bytes:
    """An SSE event with P's cached tokens in its usage (unchanged when it carries no usage)."""
    if not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    try:
        obj = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return event
    if isinstance(obj, dict) and set_cached(obj, cached):
        return b"data: " + orjson.dumps(obj)
    return event


async def relay_whole(
    resp: UpstreamResponse, p_cached: int | None, headers: dict[str, str], limit: int
) -> web.Response:
    """D's whole answer to the client; :class:`LegFailed` when it broke before it was read, grew
    past ``limit`` bytes (its connection aborted), or its status is no final answer (a ``101``:
    never relayed)."""
    if not 200 <= resp.status <= 599:
        resp.abort()
        raise LegFailed(f"HTTP {resp.status} is not a final answer")
    try:
        data = await read_capped(resp.iter_chunks(), limit)
    except UpstreamBrokenError as exc:
        resp.abort()
        raise LegFailed(str(exc)) from None  # nothing sent to the client yet: another D
    resp.release()
    if resp.status == 200 and p_cached is not None:
        with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
            obj = orjson.loads(data)
            if isinstance(obj, dict) and set_cached(obj, p_cached):
                data = orjson.dumps(obj)
    ctype = resp.content_type or "application/json"
    return web.Response(status=resp.status, body=data, headers={**headers, "Content-Type": ctype})


async def relay_stream(
    request: web.Request,
    resp: UpstreamResponse,
    p_cached: int | None,
    headers: dict[str, str],
    write_timeout_s: float = 30.0,
) -> web.StreamResponse:
    """D's stream to the client, with P's cached tokens in its usage. A write the client does not
    take within ``write_timeout_s`` seconds aborts its connection and raises ConnectionResetError
    (:func:`kvroute.server.wire.limits.write_within`): the caller aborts D's request."""
    out = web.StreamResponse(
        status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    buf = b""
    tail = b""  # the last bytes sent: does an event stand unfinished?
    try:
        async for chunk in resp.iter_chunks():
            if p_cached is None:
                tail = chunk
                await write_within(out, request, chunk, write_timeout_s)
                continue
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            if events:
                data = b"".join(rewrite_event(e, p_cached) + b"\n\n" for e in events)
                tail = data
                await write_within(out, request, data, write_timeout_s)
    except UpstreamBrokenError as exc:  # after the first byte: nothing to retry, end the stream
        log.warning("decode stream broke off: %s", exc)
        resp.abort()
        err = ApiError(502, f"backend stream broke off: {exc}", etype="upstream_error")
        with contextlib.suppress(ConnectionError):  # the client left too
            await write_within(out, request, error_event(err, tail), write_timeout_s)
        return out
    if buf:
        await write_within(out, request, buf, write_timeout_s)
    resp.release()
    with contextlib.suppress(ConnectionError):
        await out.write_eof()
    return out
