"""HTTP of the router's own making: a bounded request body, error answers as OpenAI-style JSON, the
headers forwarded upstream, and the cached tokens a response reports. No routing state here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from kvroute.server.wire.validate import ApiError, body_too_large, error_body

REQUEST_ID_HEADER = "x-request-id"
"""The request-id header (lower-case): the router's own id for every request goes upstream and back
under it (:mod:`kvroute.server.observe.observer` decides the id)."""

__all__ = [
    "EXPECT_ONLY",
    "HOP_BY_HOP",
    "JSON",
    "REQUEST_ID_HEADER",
    "error_response",
    "expect_continue_within",
    "extract_cached_tokens",
    "forward_headers",
    "payload_error",
    "read_body",
    "usage_count",
]

JSON = "application/json"

EXPECT_ONLY = "only 'Expect: 100-continue' is supported"
"""The message of the router's 417 (any ``Expect`` but ``100-continue``), on every route."""


def error_response(err: ApiError, retry_after: int | None = None) -> web.Response:
    """``err`` as an OpenAI-style JSON error answer (``Retry-After``: seconds, when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(status=err.status, body=error_body(err), content_type=JSON, headers=headers)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body, decoded (aiohttp's server undoes a ``gzip`` or ``deflate``
    ``Content-Encoding``; ``limit`` counts decoded bytes); ApiError(413) once it is over ``limit``
    bytes (by its Content-Length, or while it is read); ApiError(400) with ``close`` set when it does
    not decode (:func:`payload_error`)."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    chunks = []
    size = 0
    try:
        async for chunk in request.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    except web.RequestPayloadError as exc:
        raise payload_error(exc) from None
    return b"".join(chunks)


def payload_error(exc: web.RequestPayloadError) -> ApiError:
    """The 400 of a request body aiohttp's server could not read (a ``Content-Encoding`` that does not
    decode, ...); ``close`` set: the rest of the body cannot be read either."""
    cause = exc.__cause__
    detail = getattr(cause, "message", None) or str(exc)
    return ApiError(400, f"the request body could not be read: {' '.join(str(detail).split())}", close=True)


HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "proxy-authenticate",
        "expect",
        "http2-settings",
    }
)
"""Lower-case names of the headers that concern one connection, never forwarded (RFC 9110 section
7.6.1, plus ``Expect``, which the router answers itself, and ``HTTP2-Settings``); so are the
headers a ``Connection`` header names."""

_NOT_FORWARDED = HOP_BY_HOP | {
    "host",
    "content-length",
    "accept-encoding",
    "content-encoding",  # the body goes upstream as read: decoded (read_body)
    REQUEST_ID_HEADER,
}


def forward_headers(request: web.Request) -> dict[str, str]:
    """The client's headers to send upstream, keyed by lower-case name: hop-by-hop ones dropped
    (:data:`HOP_BY_HOP` and those ``Connection`` names), the client's ``x-request-id`` dropped (the
    caller sets the router's), ``Content-Encoding`` dropped (the body forwarded is the one
    :func:`read_body` read, decoded), a JSON content type; repeated names joined into one comma-separated
    value. Lower-case keys let the caller's own ``x-request-id`` (and a tracer's ``traceparent``)
    replace the client's whatever case the client used: one of each reaches the engine."""
    hdrs = request.headers
    named = {t.strip().lower() for v in hdrs.getall("Connection", ()) for t in v.split(",")}
    out: dict[str, str] = {}
    for k, v in hdrs.items():
        low = k.lower()
        if low in _NOT_FORWARDED or low in named:
            continue
        out[low] = f"{out[low]}, {v}" if low in out else v
    out["content-type"] = JSON
    return out


async def expect_continue(request: web.Request) -> web.Response | None:
    """The router's own answer to a request's ``Expect`` header (aiohttp calls it before the
    handler): ``100 Continue`` for ``100-continue`` on HTTP/1.1 (``Expect`` is never forwarded: an
    engine's interim answer must not stand for its final one), a JSON 417 for any other
    expectation."""
    expect = request.headers.get("Expect", "")
    if request.version < (1, 1):
        return None  # HTTP/1.0 has no 100 Continue (RFC 9110 section 10.1.1): the body just follows
    if expect.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the answer's head has not been written yet
        return None
    return error_response(ApiError(417, EXPECT_ONLY))


def expect_continue_within(limit: int) -> Callable[[web.Request], Awaitable[web.Response | None]]:
    """:func:`expect_continue` for a route whose bodies are at most ``limit`` bytes: a request that
    announces a longer one (``Content-Length``) gets its 413 in place of the ``100 Continue``, and
    the connection is closed, so the client never sends a body that would be refused (RFC 9110
    section 10.1.1: a server may answer the final status instead)."""

    async def handler(request: web.Request) -> web.Response | None:
        size = request.content_length
        if size is not None and size > limit and request.version >= (1, 1):
            resp = error_response(body_too_large(limit))
            resp.force_close()
            return resp
        return await expect_continue(request)

    return handler


def usage_count(data: bytes, key: str, *path: str) -> int | None:
    """The non-negative integer ``usage[*path][key]`` from a JSON body or from the last SSE event of
    ``data`` (the tail of a stream) that names ``key``; None when absent or unparsable."""
    pos = data.rfind(b'"' + key.encode() + b'"')
    if pos < 0:
        return None
    start = data.rfind(b"\n", 0, pos) + 1
    end = data.find(b"\n", pos)
    line = data[start : end if end >= 0 else len(data)].strip()
    if line.startswith(b"data:"):
        line = line[5:].strip()
    try:
        obj = orjson.loads(line)["usage"]
        for part in path:
            obj = obj[part]
        value = obj[key]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def extract_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a JSON body or the last SSE event carrying
    usage in ``data`` (the tail of a stream); None when absent or unparsable."""
    return usage_count(data, "cached_tokens", "prompt_tokens_details")
