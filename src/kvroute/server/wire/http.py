"""HTTP of the router's own making: a bounded request body, error answers as OpenAI-style JSON, the
headers forwarded upstream, and the cached tokens a response reports. No routing state here."""

from __future__ import annotations

import orjson
from aiohttp import web

from kvroute.server.wire.validate import ApiError, error_body

__all__ = ["JSON", "error_response", "extract_cached_tokens", "forward_headers", "read_body", "usage_count"]

JSON = "application/json"


def error_response(err: ApiError, retry_after: int | None = None) -> web.Response:
    """``err`` as an OpenAI-style JSON error answer (``Retry-After``: seconds, when given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(status=err.status, body=error_body(err), content_type=JSON, headers=headers)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The whole request body; ApiError(413) once it is over ``limit`` bytes (by its
    Content-Length, or while it is read)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body is larger than {limit} bytes")
    chunks = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


_HOP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "upgrade"}
)


def forward_headers(request: web.Request) -> dict[str, str]:
    """The client's headers to send upstream: hop-by-hop ones dropped, a JSON content type."""
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    headers["Content-Type"] = JSON
    return headers


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
