"""The admin API: list, add, drain and delete backends at runtime (registered only with a token).

Every route needs ``Authorization: Bearer TOKEN`` (``config.admin_token``, from ``--admin-token`` or
``KVROUTE_ADMIN_TOKEN``), compared in constant time; a missing or wrong token gets a 401 whose JSON
error says only ``unauthorized``. Without a token the routes do not exist (404).

A backend's ``id`` is :func:`~kvroute.server.state.loadtable.url_digest` of its URL: 12 hex digits, stable
across restarts and router replicas (the same URL has the same id everywhere). A URL removed and added
again keeps its id; the id always names the newest backend with that URL.

- ``GET /admin/backends``: ``{"object": "list", "data": [backend, ...]}`` of the active and draining
  backends (``?all=1``: the removed ones too), by index.
- ``GET /admin/backends/{id}``: one backend (404 when unknown).
- ``POST /admin/backends`` with ``{"url": "http://host:port", "kv_events": "tcp://host:port"}``
  (``kv_events``, ``kv_replay``, ``tags``, ``models``, ``lora_adapters``, ``engine`` optional): 201 with the backend; it starts unhealthy and
  takes traffic once a health check admits it (see :mod:`kvroute.server.sync.fleet`). 400 naming the field
  for a bad body, 409 when the URL is already listed.
- ``DELETE /admin/backends/{id}``: drains it (no new requests), then removes it once its requests in
  flight end: 202 with the backend (``state`` ``draining``, or ``removed`` when it was idle).
- ``POST /admin/backends/{id}/drain``: no new requests, but it stays listed (``state: draining``)
  until deleted or undrained; ``POST /admin/backends/{id}/undrain``: takes requests again. 202.

A backend's JSON: ``id``, ``index``, ``url``, ``state`` (``active``, ``draining``, ``removed``),
``removing`` (draining to be removed), ``healthy``, ``kv_events``, ``kv_replay``, ``kv_mode``
(``exact``, ``approx``, ``recovering``, or null once removed), ``tags``, ``engine`` (declared, or
null), ``models`` (what it serves, declared or read from its /v1/models), ``waiting`` and ``running``
(this process's requests in flight), ``requests_total`` (attempts sent).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlparse

import orjson
from aiohttp import web

from kvroute.server.config import BackendSpec, netloc, url_text_ok
from kvroute.server.state.backends import REMOVED, BackendState
from kvroute.server.state.loadtable import url_digest
from kvroute.server.sync.fleet import ADMIN, Fleet
from kvroute.server.sync.journal import AdminJournal
from kvroute.server.wire.auth import Handler, bearer_guard
from kvroute.server.wire.validate import ApiError

__all__ = ["add_admin_routes", "apply_journal_line", "backend_json", "spec_from_body"]


def add_admin_routes(
    app: web.Application, fleet: Fleet, token: str, journal: AdminJournal | None = None
) -> None:
    """Register the admin routes on ``app`` (module docstring), guarded by ``token``; with ``journal``
    (``--workers N``) every change is also recorded for the sibling workers."""
    api = _Admin(fleet, token, journal)
    app.router.add_get("/admin/backends", api.guard(api.list))
    app.router.add_post("/admin/backends", api.guard(api.add))
    app.router.add_get("/admin/backends/{id}", api.guard(api.get))
    app.router.add_delete("/admin/backends/{id}", api.guard(api.delete))
    app.router.add_post("/admin/backends/{id}/drain", api.guard(api.drain))
    app.router.add_post("/admin/backends/{id}/undrain", api.guard(api.undrain))


def backend_json(fleet: Fleet, b: BackendState) -> dict[str, Any]:
    """The admin API's view of backend ``b`` (module docstring)."""
    core = fleet.state
    spec = core.specs[b.index]
    waiting, running = (0, 0) if b.state == REMOVED else (b.waiting, b.running)
    return {
        "id": url_digest(b.url),
        "index": b.index,
        "url": b.url,
        "state": b.state,
        "removing": fleet.removing(b.index),
        "healthy": b.healthy,
        "kv_events": spec.kv_events,
        "kv_replay": spec.kv_replay,
        "kv_mode": None if b.state == REMOVED else core.kv.mode(b.index, core.clock()),
        "tags": list(spec.tags),
        "engine": spec.engine,
        "models": core.pools.served([b.index]),
        "waiting": waiting,
        "running": running,
        "requests_total": b.requests_total,
    }


def _host_port(value: object, field: str, schemes: tuple[str, ...]) -> str:
    """``value`` as ``scheme://host:port`` in lower case (the form the 409 check compares) if it is
    ``SCHEME://host:port`` (nothing after the port but one ``/``; printable ASCII without spaces; a
    host name or address; a port in 1..65535); else a 400 naming ``field``."""
    want = f"{schemes[0]}://host:port"
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'{field}' must be a string like {want}", field)
    if not url_text_ok(value):
        raise ApiError(400, f"'{field}' must be printable ASCII without spaces, like {want}", field)
    try:
        u = urlparse(value)
        port = u.port
    except ValueError:
        raise ApiError(400, f"'{field}' must look like {want}", field) from None
    rest = u.path not in ("", "/") or "?" in value or "#" in value or u.params
    host = u.hostname or ""
    if (
        u.scheme not in schemes
        or not _HOST.fullmatch(host)
        or port is None
        or not 0 < port < 65536
        or u.username is not None
        or rest
    ):
        raise ApiError(400, f"'{field}' must look like {want}, without a path", field)
    return f"{u.scheme}://{netloc(host, port)}"


_HOST = re.compile(r"[a-z0-9]([a-z0-9.-]*[a-z0-9])?|[0-9a-f:.]*:[0-9a-f:.]*")
"""A host name or IPv4 address (letters, digits, dots, hyphens), or an IPv6 address (brackets removed)."""


def spec_from_body(raw: bytes) -> BackendSpec:
    """The :class:`BackendSpec` of a POST body; ApiError(400) naming the bad field."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "the body must be a JSON object") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    unknown = sorted(
        set(body) - {"url", "kv_events", "kv_replay", "tags", "models", "lora_adapters", "engine"}
    )
    if unknown:
        raise ApiError(400, f"unknown field '{unknown[0]}'", unknown[0])
    url = _host_port(body.get("url"), "url", ("http", "https"))
    events = replay = None
    if body.get("kv_events") is not None:
        events = _host_port(body["kv_events"], "kv_events", ("tcp",))
    if body.get("kv_replay") is not None:
        replay = _host_port(body["kv_replay"], "kv_replay", ("tcp",))
    lists = {}
    for name in ("tags", "models", "lora_adapters"):
        val = body.get(name, [])
        if not isinstance(val, list) or not all(isinstance(t, str) and t for t in val):
            raise ApiError(400, f"'{name}' must be a list of strings", name)
        lists[name] = tuple(val)
    engine = body.get("engine")
    if engine is not None and engine not in ("vllm", "sglang"):
        raise ApiError(400, "'engine' must be 'vllm' or 'sglang'", "engine")
    return BackendSpec(
        url, events, replay, lists["tags"], lists["models"], lists["lora_adapters"], engine=engine
    )


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


# ---- the changes, by URL: what a request does here and what a sibling worker replays --------------


def add_backend(fleet: Fleet, spec: BackendSpec) -> BackendState:
    """Add ``spec`` as an admin backend (409 when its URL is already listed)."""
    if fleet.state.find(spec.url) is not None:
        raise ApiError(409, f"backend {spec.url} is already listed", "url", etype="conflict")
    fleet.sources[ADMIN] = (*fleet.sources[ADMIN], spec)
    fleet.reconcile(fleet.desired())
    state = fleet.state.find(spec.url)
    assert state is not None
    return state


def delete_backend(fleet: Fleet, b: BackendState) -> None:
    """Take ``b`` off every source, drain it and remove it once idle."""
    if b.state != REMOVED:
        fleet.forget(b.url)
        fleet.drain(b.index, remove=True)


def drain_backend(fleet: Fleet, b: BackendState) -> None:
    if b.state == REMOVED:
        raise ApiError(409, f"backend {b.url} is removed", etype="conflict")
    fleet.drain(b.index, remove=False)


def undrain_backend(fleet: Fleet, b: BackendState) -> None:
    if b.state == REMOVED or fleet.removing(b.index):
        raise ApiError(409, f"backend {b.url} is being removed", etype="conflict")
    fleet.undrain(b.index)


def apply_journal_line(fleet: Fleet, line: dict[str, Any]) -> None:
    """Replay one change a sibling worker made (:mod:`kvroute.server.sync.journal`); a change that no
    longer applies here (already listed, unknown URL) is skipped."""
    op, url = line.get("op"), line.get("url")
    if op == "add":
        spec = spec_from_body(orjson.dumps(line.get("spec")))
        if fleet.state.find(spec.url) is None:
            add_backend(fleet, spec)
        return
    b = fleet.state.find(url) if isinstance(url, str) else None
    if b is None:
        return
    if op == "delete":
        delete_backend(fleet, b)
    elif op == "drain" and b.state != REMOVED:
        drain_backend(fleet, b)
    elif op == "undrain" and b.state != REMOVED and not fleet.removing(b.index):
        undrain_backend(fleet, b)
    else:
        raise ValueError(f"unknown admin change {op!r}")


class _Admin:
    def __init__(self, fleet: Fleet, token: str, journal: AdminJournal | None) -> None:
        self.fleet = fleet
        self.journal = journal
        self._token = token

    def _record(self, op: str, url: str, spec: BackendSpec | None = None) -> None:
        if self.journal is not None:
            fields: dict[str, Any] | None = None
            if spec is not None:
                fields = {"url": spec.url, "kv_events": spec.kv_events, "kv_replay": spec.kv_replay}
                for name in ("tags", "models", "lora_adapters"):
                    if getattr(spec, name):
                        fields[name] = list(getattr(spec, name))
                if spec.engine is not None:
                    fields["engine"] = spec.engine
            self.journal.append(op, url, fields)

    def guard(self, handler: Handler) -> Handler:
        return bearer_guard(self._token, handler)

    def _find(self, request: web.Request) -> BackendState:
        """The newest backend whose id is the path's ``{id}``; 404 when none."""
        wanted = request.match_info["id"]
        for b in reversed(self.fleet.state.backends):
            if url_digest(b.url) == wanted:
                return b
        raise ApiError(404, f"no backend with id {wanted!r}", etype="not_found_error")

    async def list(self, request: web.Request) -> web.Response:
        every = request.query.get("all", "") in ("1", "true", "yes")
        data = [backend_json(self.fleet, b) for b in self.fleet.state.backends if every or b.state != REMOVED]
        return _json({"object": "list", "data": data})

    async def get(self, request: web.Request) -> web.Response:
        return _json(backend_json(self.fleet, self._find(request)))

    async def add(self, request: web.Request) -> web.Response:
        spec = spec_from_body(await request.read())
        state = add_backend(self.fleet, spec)
        self._record("add", spec.url, spec)
        return _json(backend_json(self.fleet, state), 201)

    async def delete(self, request: web.Request) -> web.Response:
        b = self._find(request)
        if b.state != REMOVED:
            delete_backend(self.fleet, b)
            self._record("delete", b.url)
        return _json(backend_json(self.fleet, b), 202)

    async def drain(self, request: web.Request) -> web.Response:
        b = self._find(request)
        drain_backend(self.fleet, b)
        self._record("drain", b.url)
        return _json(backend_json(self.fleet, b), 202)

    async def undrain(self, request: web.Request) -> web.Response:
        b = self._find(request)
        undrain_backend(self.fleet, b)
        self._record("undrain", b.url)
        return _json(backend_json(self.fleet, b), 202)
