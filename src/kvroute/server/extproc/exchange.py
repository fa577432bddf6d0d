"""One HTTP request through the endpoint picker: the gateway's events in, the stages' answers out.

No protobuf here: :mod:`.service` turns ext_proc messages into these calls, in this order:

1. :meth:`Exchange.route`: the request's whole body (the gateway streams it; the service collects
   it) through parse → prepare → decide → reserve (:mod:`kvroute.server.stages`, the proxy's stages).
   Returns a :class:`Route` (the endpoints to try, best first, as ``host:port``, and the headers to
   set on the upstream request) or an :class:`Immediate`: the answer the gateway gives the client
   itself, the router's own OpenAI-style JSON error with the proxy's status (400, 404, 413, 429 over
   quota, 503 with Retry-After when no backend is ready).
2. :meth:`Exchange.served`: the upstream's response status and the endpoint that served (None when
   the gateway does not say). When the gateway fell back to a later endpoint of the list, the lease
   moves there, the first endpoint is ejected (the gateway moves on only after a connection failure;
   the health checker re-admits it) and a retry is counted. Returns the headers to add to the
   client's response (``x-request-id``, the explanation when asked for).
3. :meth:`Exchange.body`: each response body chunk as it passes. The first marks the lease's first
   token (waiting → running); the stream's last ``TAIL_BYTES`` (a whole non-streamed body, up to
   ``KEEP_BYTES``) are kept, and at the end the ``cached_tokens`` of its usage correct the KV view
   in the settle stage, as on the proxy.
4. :meth:`Exchange.close`: the ext_proc stream ended, whichever way. A response that never reached
   its end is settled ``cancelled`` (the client went away, or the gateway reset the stream); the
   lease is released on every path, once.

Requests that are not inference (``GET /v1/models``, ``/health``, ...) go to a healthy backend
round robin (:meth:`Picker.plain`), with no lease and no record. With the router-side queue on, a
request waits in :meth:`Exchange.route` as on the proxy, except with a subset hint (decided at once
among the subset).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

from kvroute.server.observe.decisions import DecisionRecord
from kvroute.server.observe.observer import REQUEST_ID_HEADER, request_id
from kvroute.server.pipeline import Proxy
from kvroute.server.stages.decide import Plan, decide
from kvroute.server.stages.forward import Reservation, reserve, sent, takes
from kvroute.server.stages.prepare import Tail, prepare
from kvroute.server.stages.settle import refuse, settle, unavailable
from kvroute.server.state.backends import Lease
from kvroute.server.wire.http import error_response
from kvroute.server.wire.relay import CANCELLED, CLIENT_ERROR, OK, TAIL_BYTES, UPSTREAM_ERROR, Relayed
from kvroute.server.wire.validate import ApiError, body_too_large, parse_request

__all__ = [
    "ENGINE_PATHS",
    "INFERENCE_PATHS",
    "KEEP_BYTES",
    "MAX_HEADERS",
    "Exchange",
    "Immediate",
    "Picker",
    "Route",
    "endpoint_of",
]

log = logging.getLogger("kvroute.server")

INFERENCE_PATHS = {"/v1/chat/completions": True, "/v1/completions": False}
"""The paths routed through the stages, and whether each is a chat request."""

ENGINE_PATHS = ("/v1/", "/health", "/metrics", "/version", "/tokenize", "/detokenize")
"""Path prefixes of the engines' own endpoints, passed through to one of them; any other path is
answered 404 by the picker (as by the proxy: its own admin and debug routes are on its HTTP port)."""

MAX_HEADERS = 128
"""A request with more headers than this is answered 431 (engines built on aiohttp refuse it too)."""

KEEP_BYTES = 1 << 20
"""A non-streamed response body is kept up to this many bytes to read its usage (bytes)."""


def endpoint_of(url: str) -> str:
    """A backend's base URL as the gateway names its endpoint: ``host:port``."""
    return urlsplit(url).netloc


@dataclass(frozen=True, slots=True)
class Route:
    """Send the request to ``endpoints`` (``host:port``, best first: the gateway tries them in order),
    with ``headers`` set on the upstream request."""

    endpoints: tuple[str, ...]
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Immediate:
    """Answer the client at the gateway: HTTP ``status``, ``body``, ``headers``."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, resp: web.Response) -> Immediate:
        """The stages' answer (an aiohttp response, not sent) as an immediate response."""
        headers = tuple((k.lower(), v) for k, v in resp.headers.items() if k.lower() != "content-length")
        body = resp.body if isinstance(resp.body, bytes) else b""
        return cls(resp.status, body, headers)


class Picker:
    """The picker of one process: the proxy's state, observer, tokenizer thread and queue
    (``proxy``), shared with the process's other front doors. ``streams``: exchanges open now."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.state = proxy.state
        self.observer = proxy.observer
        self.streams = 0
        self._turn = itertools.count()

    def endpoints(self) -> dict[str, int]:
        """The live backends by endpoint (``host:port`` → backend index)."""
        return {endpoint_of(b.url): b.index for b in self.state.live_backends()}

    def exchange(self, path: str, headers: Mapping[str, str]) -> Exchange | None:
        """A new inference request's exchange, or None when ``path`` is not inference."""
        chat = INFERENCE_PATHS.get(path.partition("?")[0])
        return None if chat is None else Exchange(self, path.partition("?")[0], chat, headers)

    def plain(self, path: str, headers: Mapping[str, str]) -> Route | Immediate:
        """A request that is not inference: to a healthy backend, round robin (503 when none), when
        ``path`` is one of the engines' (:data:`ENGINE_PATHS`); else 404, as from the proxy."""
        state, obs = self.state, self.observer
        if not path.partition("?")[0].startswith(ENGINE_PATHS):  # as the proxy's 404: no request id
            state.counters.client_errors += 1
            return Immediate.of(error_response(ApiError(404, f"no such endpoint: {path[:200]}")))
        ready = [b for b in state.backends if b.routable]
        if not ready:
            err = ApiError(503, "no healthy backend", etype="service_unavailable")
            return Immediate.of(refuse(state, obs, err, request_id(headers), path, time.perf_counter()))
        return Route((endpoint_of(ready[next(self._turn) % len(ready)].url),))


class Exchange:
    """One inference request at the picker (module docstring). Use from one event loop."""

    def __init__(self, picker: Picker, path: str, chat: bool, headers: Mapping[str, str]) -> None:
        self.picker = picker
        self.path = path
        self.chat = chat
        self.headers = headers
        self.arrival = time.perf_counter()
        self.rid = request_id(headers)
        self.stream = False
        self.plan: Plan | None = None
        self.rec: DecisionRecord | None = None
        self.target: Reservation | None = None
        self.tail: Tail | None = None
        self.status: int | None = None
        self.first_byte = 0.0
        self.kept = b""
        self.closed = False
        picker.streams += 1

    async def route(self, body: bytes, subset: Collection[str] | None = None) -> Route | Immediate:
        """Route the request whose whole body is ``body``; ``subset``: the gateway's subset hint
        (endpoints), when given only these are candidates (503 when none of them is eligible)."""
        picker, proxy = self.picker, self.picker.proxy
        state, obs = picker.state, picker.observer
        clock = time.perf_counter
        hold: Lease | None = None
        try:
            limit = state.config.max_body_bytes
            if len(body) > limit:
                raise body_too_large(limit)
            t0 = clock()
            parsed = parse_request(body, self.chat)  # parse
            t1 = clock()
            prep = await prepare(state, parsed, proxy.tokenize_pool)  # prepare
            only = None
            if subset is not None:
                named = picker.endpoints()
                only = {named[e] for e in subset if e in named}
            if proxy.waiting is None or only is not None:
                plan = decide(state, parsed, prep, self.headers, only)  # decide
            else:
                plan, hold = await proxy.waiting.decide(parsed, prep, self.headers)  # decide, wait
            t5 = clock() - plan.decision.queued_s
        except ApiError as err:
            return self.refuse(err)
        try:  # nothing here awaits; should any of it raise, the wait stage's hold goes with it
            proxy.timed(t0, t1, prep, t5)
            self.stream = parsed.stream
            if prep.pending is not None:  # tokenize=defer: the new text is tokenized on the way
                self.tail = Tail(state, plan.cached_blocks, proxy.tokenize_pool, prep.pending, prep.key)
            rec = self.rec = obs.planned(
                self.rid, plan.decision, plan.shadow, self.path, self.headers, self.arrival, t5 - t0
            )
            self.plan = plan
            tries = plan.order[: 1 + state.config.max_retries]
            order = [i for n, i in enumerate(tries) if takes(state, i, retry=n > 0)]
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        if not order:
            if hold is not None:
                hold.release()
                proxy.release(None)
            self.closed = True
            resp = unavailable(state, obs, rec, "no backend available")
            obs.finish(rec)
            return Immediate.of(resp)
        target = self.target = reserve(state, plan, order[0], self.tail)  # reserve
        if hold is not None:  # the wait stage's hold, now the lease's
            hold.release()
        upstream = {REQUEST_ID_HEADER: self.rid}
        obs.attempt(rec, target.index, target.url, False, upstream)
        sent(state, plan, target, self.tail)
        backends = state.backends
        return Route(tuple(endpoint_of(backends[i].url) for i in order), tuple(upstream.items()))

    def refuse(self, err: ApiError) -> Immediate:
        """The request is refused before it was routed: the proxy's answer to ``err``, counted."""
        self.closed = True
        picker = self.picker
        return Immediate.of(refuse(picker.state, picker.observer, err, self.rid, self.path, self.arrival))

    def served(self, status: int, endpoint: str | None) -> dict[str, str]:
        """The upstream answered ``status`` from ``endpoint``; the headers to add to the response."""
        self.status = status
        rec, target, plan = self.rec, self.target, self.plan
        if rec is None or target is None or plan is None:
            return {}
        if endpoint is not None and endpoint != endpoint_of(target.url):
            idx = self.picker.endpoints().get(endpoint)
            if idx is not None:  # the gateway fell back to a later endpoint of the list
                state = self.picker.state
                self.picker.proxy.release(target.lease)
                if state.backends[target.index].eject():
                    log.warning(
                        "ejected backend %s: the gateway fell back to %s (request %s)",
                        target.url,
                        endpoint,
                        self.rid,
                    )
                state.counters.retries += 1
                target = self.target = reserve(state, plan, idx, self.tail)
                self.picker.observer.attempt(rec, idx, target.url, True, {})
                sent(state, plan, target, self.tail)
        return self.picker.observer.response_headers(rec)

    def body(self, chunk: bytes, end: bool) -> None:
        """A response body chunk passed (``end``: the last one)."""
        target = self.target
        if target is None or self.closed:
            return
        if not self.first_byte:
            self.first_byte = time.perf_counter()
            self.picker.proxy.first_byte(target.lease)()
            tail = self.tail
            if tail is not None:  # after this chunk went back to the gateway
                asyncio.get_running_loop().call_soon(tail.run)
        if self.stream and self.status == 200:
            self.kept = (self.kept + chunk)[-TAIL_BYTES:]
        elif len(self.kept) + len(chunk) <= KEEP_BYTES:
            self.kept += chunk
        if end:
            status = self.status or 200
            outcome = OK if status < 400 else CLIENT_ERROR if status < 500 else UPSTREAM_ERROR
            kept = self.kept if status == 200 else None
            self._settle(Relayed(outcome, None, status, status < 500, kept, self.first_byte))

    def close(self) -> None:
        """The ext_proc stream ended: settle as cancelled unless the response ended (module docstring)."""
        self.picker.streams -= 1
        if not self.closed:
            self._settle(Relayed(CANCELLED, None, None, False, None, self.first_byte))

    def _settle(self, relayed: Relayed) -> None:
        self.closed = True
        target, plan, rec = self.target, self.plan, self.rec
        if target is None or plan is None or rec is None:
            return
        self.picker.proxy.release(target.lease)
        settle(self.picker.state, plan, target.index, relayed, self.tail, rec)
        self.picker.observer.finish(rec)
