"""The admin token's guard, shared by the admin API, ``/debug`` and the dashboard's data.

A route behind :func:`bearer_guard` answers a JSON 401 (``WWW-Authenticate: Bearer``) unless the
request carries ``Authorization: Bearer TOKEN``, compared in constant time on bytes. Any header value
is compared, however it is encoded: aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so
a value that is not UTF-8 is encoded back with ``surrogatepass`` (it never raises) and never matches.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvroute.server.wire.http import error_response
from kvroute.server.wire.validate import ApiError

__all__ = ["Handler", "bearer_guard"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_UNAUTHORIZED = ApiError(401, "unauthorized", etype="unauthorized")


def _bytes(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def bearer_guard(token: str, handler: Handler) -> Handler:
    """``handler`` behind ``Authorization: Bearer token`` (module docstring); an ApiError raised by
    ``handler`` becomes its JSON error."""
    expected = _bytes(f"Bearer {token}")

    async def guarded(request: web.Request) -> web.StreamResponse:
        given = _bytes(request.headers.get("Authorization", ""))
        if not hmac.compare_digest(given, expected):
            resp = error_response(_UNAUTHORIZED)
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        try:
            return await handler(request)
        except ApiError as err:
            return error_response(err)

    return guarded
