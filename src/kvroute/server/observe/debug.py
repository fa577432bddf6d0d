"""Debug endpoints behind the admin token (registered only with ``config.admin_token``, like the
admin API: without a token they do not exist, 404; a missing or wrong ``Authorization: Bearer TOKEN``
gets a 401 ``unauthorized``).

- ``GET /debug/decisions?limit=N``: ``{"object": "list", "kept": capacity, "total": ever recorded,
  "data": [record, ...]}``, the newest ``N`` decision records first (default 50; 1 ≤ N ≤ the ring
  buffer's size, else 400); a record's JSON is described in :mod:`kvroute.server.observe.decisions`.
- ``GET /debug/state?limit=N``: :func:`kvroute.server.observe.decisions.router_state` (backends' load and KV
  view mode, counters, the newest ``N`` decisions; default 20).
"""

from __future__ import annotations

import orjson
from aiohttp import web

from kvroute.server.observe.decisions import DecisionLog, record_json, router_state
from kvroute.server.state.router import RouterState
from kvroute.server.wire.auth import bearer_guard
from kvroute.server.wire.validate import ApiError

__all__ = ["add_debug_routes", "request_limit"]


def request_limit(request: web.Request, default: int, most: int) -> int:
    """The query's ``limit`` (``default`` when absent); an ApiError 400 unless 1 ≤ limit ≤ ``most``."""
    text = request.query.get("limit")
    if text is None:
        return min(default, most)
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise ApiError(400, f"'limit' must be an integer in 1..{most}, got {text!r}", "limit")
    return value


def add_debug_routes(app: web.Application, core: RouterState, log: DecisionLog, token: str) -> None:
    """Register the routes of the module docstring on ``app``."""

    async def decisions(request: web.Request) -> web.Response:
        limit = request_limit(request, 50, log.capacity)
        urls = core.backends
        data = [record_json(r, lambda i: urls[i].url) for r in log.latest(limit)]
        body = {"object": "list", "kept": log.capacity, "total": log.total, "data": data}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def state(request: web.Request) -> web.Response:
        body = router_state(core, log, request_limit(request, 20, log.capacity))
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    app.router.add_get("/debug/decisions", bearer_guard(token, decisions))
    app.router.add_get("/debug/state", bearer_guard(token, state))
