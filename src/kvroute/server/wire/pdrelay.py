"""The P/D router's relay of D's answer: unchanged but for ``usage.prompt_tokens_details.cached_tokens``,
which becomes P's when the request was disaggregated (vLLM's D reports only its local hit; the
proxies report P's). Streamed answers are rewritten event by event (only an SSE event carrying a
``usage`` object changes); a stream that breaks after its first byte just ends. Bytes in, bytes out.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import orjson
from aiohttp import web

from kvroute.server.wire.transport import UpstreamBrokenError, UpstreamResponse

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


async def relay_whole(resp: UpstreamResponse, p_cached: int | None, headers: dict[str, str]) -> web.Response:
    """D's whole answer to the client; :class:`LegFailed` when it broke before it was read, or
    its status is no final answer (a ``101``: never relayed)."""
    if not 200 <= resp.status <= 599:
        resp.abort()
        raise LegFailed(f"HTTP {resp.status} is not a final answer")
    try:
        data = await resp.read()
    except UpstreamBrokenError as exc:
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
    request: web.Request, resp: UpstreamResponse, p_cached: int | None, headers: dict[str, str]
) -> web.StreamResponse:
    out = web.StreamResponse(
        status=200, headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    buf = b""
    try:
        async for chunk in resp.iter_chunks():
            if p_cached is None:
                await out.write(chunk)
                continue
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            if events:
                await out.write(b"".join(rewrite_event(e, p_cached) + b"\n\n" for e in events))
    except UpstreamBrokenError as exc:  # after the first byte: nothing to retry, end the stream
        log.warning("decode stream broke off: %s", exc)
        resp.abort()
        return out
    if buf:
        await out.write(buf)
    resp.release()
    with contextlib.suppress(ConnectionError):
        await out.write_eof()
    return out
