"""The live dashboard: a static page served by the router, polling one JSON endpoint.

Routes (registered only with ``config.admin_token``, like the admin API and ``/debug``: without a
token they do not exist, 404):

- ``GET /dashboard``: the page (``static/dashboard.html``, plain HTML + JS + CSS shipped in the
  package, no build step, no third-party code); ``/dashboard/`` redirects to it;
  ``GET /dashboard/static/NAME``: its script and style sheet. Public (static, no data), served with a
  strict Content-Security-Policy (scripts and requests to this origin only, no inline code) and
  ``Cache-Control: no-cache``.
- ``GET /debug/dashboard?limit=N``: :func:`kvroute.server.observe.dashstate.dashboard_state` (default 20
  decisions; 1 ≤ N ≤ ``decisions_kept``, else 400), behind ``Authorization: Bearer TOKEN`` (401).

Authentication: the page holds no data; it asks for the admin token, keeps it in the tab's
``sessionStorage`` (gone when the tab closes; never in a cookie, so no cross-site request carries
it) and sends it as a bearer header. ``kvroute up`` prints ``/dashboard#token=…``: the fragment never
leaves the browser (not sent to the server, not in access logs), and the page moves it into
``sessionStorage`` and off the address bar. The page polls every 1.5 s while visible (a hidden tab
stops), so the JSON is built only while someone watches.
"""

from __future__ import annotations

from importlib import resources

import orjson
from aiohttp import web

from kvroute.server.observe.dashstate import dashboard_state
from kvroute.server.observe.debug import request_limit
from kvroute.server.observe.observer import Observer
from kvroute.server.wire.auth import bearer_guard

__all__ = ["STATIC_FILES", "add_dashboard_routes"]

STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
"""The page's assets under ``/dashboard/static/`` and their content types."""

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)

_HEADERS = {
    "Content-Security-Policy": CSP,
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _read(name: str) -> bytes:
    return resources.files("kvroute.server.observe").joinpath("static", name).read_bytes()


def add_dashboard_routes(app: web.Application, obs: Observer, token: str) -> None:
    """Register the routes of the module docstring on ``app`` (the static files are read now, once)."""
    page = _read("dashboard.html")
    assets = {name: (_read(name), ctype) for name, ctype in STATIC_FILES.items()}

    async def index(request: web.Request) -> web.Response:
        return web.Response(body=page, content_type="text/html", charset="utf-8", headers=_HEADERS)

    async def slash(request: web.Request) -> web.Response:
        raise web.HTTPMovedPermanently("../dashboard")

    async def asset(request: web.Request) -> web.Response:
        found = assets.get(request.match_info["name"])
        if found is None:
            raise web.HTTPNotFound()
        body, ctype = found
        return web.Response(body=body, content_type=ctype, charset="utf-8", headers=_HEADERS)

    async def state(request: web.Request) -> web.Response:
        body = dashboard_state(obs, request_limit(request, 20, obs.log.capacity))
        return web.Response(
            body=orjson.dumps(body),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    app.router.add_get("/dashboard", index)
    app.router.add_get("/dashboard/", slash)
    app.router.add_get("/dashboard/static/{name}", asset)
    app.router.add_get("/debug/dashboard", bearer_guard(token, state))
