"""The live router's P/D mode: ``kvroute serve --prefill URL … --decode URL …`` (vllm-router's flags).

Each request takes the one P/D routing step (:class:`kvroute.routing.pd.PDRouter`, also the
simulator's) and then, as vLLM's NIXL proxy does (``tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py``; vllm-project/router ``src/routers/http/vllm_pd_router.rs``):

1. **P leg** (unless the conditional skip says D prefills): the client's body with
   ``kv_transfer_params = {do_remote_decode: true, do_remote_prefill: false, remote_*: null}``,
   ``stream: false``, ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when given), without
   ``stream_options`` and ``min_tokens``; sent with the request's ``X-Request-Id``. P answers with
   its ``kv_transfer_params``. P failing before it answers (connection refused or reset, a 5xx) →
   the next P by the policy; no P left → D prefills itself (``reason`` ``prefill_failed``).
2. **D leg**: the original body plus P's ``kv_transfer_params``, the same ``X-Request-Id``; D's answer
   (stream or not) is relayed, with ``usage.prompt_tokens_details.cached_tokens`` replaced by P's (D
   counts the transferred tokens as cached). D failing before its first byte → the next D by load
   (P's blocks are still leased, the next D reads them); D taking the request and giving no head in
   time (the transport's read timeout: a long non-streamed generation) → the client's 504
   ``timeout_error``, D's request cancelled (its connection closed), no other D tried.
3. A client that disconnects aborts the leg in progress (its upstream connection is dropped, which
   makes a vLLM engine abort the request; D still notifies P). Between the legs, P's lease expires.

A client's ``X-Request-Id`` already in flight on this router process is a 409 before either leg
(:mod:`kvroute.server.stages.ids`): both legs carry the id, so two requests under it could meet at P.

Modules: this one is the app and one request's trip (decide both, the P leg, the D leg);
:mod:`kvroute.server.state.pdpools` keeps each instance's bookkeeping, :mod:`kvroute.server.wire.pdrelay`
relays D's answer with P's cached tokens, :mod:`kvroute.routing.pd` decides.

Load views are the router's own bookkeeping (requests routed and not answered per instance: BS; the
new prefill tokens of those not started: queued prefill) plus the KV usage scraped from each engine's
``/metrics``. KV views: exact from an instance's KV events when given, else routing history.

Explanation headers (every response): ``x-request-id``, ``x-kvroute-pd`` (the reason),
``x-kvroute-prefill`` (P's URL, empty when skipped), ``x-kvroute-decode`` (D's URL, also
``x-kvroute-backend``), ``x-kvroute-policy``, ``x-kvroute-prompt-tokens``, ``x-kvroute-cached-tokens``
(P's predicted hit), ``x-kvroute-decode-cached-tokens``, ``x-kvroute-local-prefill-ms``,
``x-kvroute-transfer-ms``, ``x-kvroute-retries``. Records of the last decisions (both choices, every
candidate's terms) are at ``GET /debug/decisions``; ``GET /dashboard`` shows them as a table.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import zmq.asyncio
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvroute.blocks import extra_key, hash_blocks
from kvroute.chat_template import ChatTemplateError
from kvroute.engine.transfer import TransferModel
from kvroute.engine.types import CostModel
from kvroute.policies.registry import make_policy
from kvroute.prepare.events import EventSubscriber
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.core import Decision, RouteRequest, RoutingCore
from kvroute.routing.kvview import KVView
from kvroute.routing.pd import PDDecision, PDRouter
from kvroute.server.observe.exporter import StrayCollector
from kvroute.server.observe.observer import request_id
from kvroute.server.stages.ids import InFlightIds, in_flight
from kvroute.server.state.backends import parse_vllm_metrics
from kvroute.server.state.pdpools import ROLES, PDBackend, PDChanges, PDInstance, PDMembership
from kvroute.server.sync.discovery import ParseBackends, Resolver, Source, make_source
from kvroute.server.wire.h1 import H1Transport
from kvroute.server.wire.http import expect_continue_within
from kvroute.server.wire.httperrors import RateLimitedLog, json_errors
from kvroute.server.wire.limits import ClientLimits, LimitedRunner, read_body_within
from kvroute.server.wire.pdrelay import LegFailed, relay_stream, relay_whole
from kvroute.server.wire.pruning import prune_every, pruner
from kvroute.server.wire.relay import timed_out
from kvroute.server.wire.transport import (
    Transport,
    UpstreamBrokenError,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamTimeoutError,
    read_capped,
)
from kvroute.server.wire.validate import ApiError, ParsedRequest, error_body, parse_request, too_long
from kvroute.tokenizer import Tokenizer

__all__ = ["PDBackend", "PDConfig", "PDServer"]  # PDBackend lives in state/pdpools, re-exported here

log = logging.getLogger("kvroute.server.pd")

P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass(frozen=True, slots=True)
class PDConfig:
    """The P/D router. ``conditional``: allow the conditional skip of P; ``max_retries``: further
    attempts per leg; ``decisions_kept``: decision records served by ``/debug/decisions``;
    ``scrape_interval``: seconds between ``/metrics`` scrapes (KV usage). ``discover``: discovery
    sources as (role, source): role ``"prefill"``/``"decode"`` with ``dns://NAME:PORT`` or
    ``file://PATH``, or None with ``file://PATH`` whose backends carry their ``role``; checked every
    ``discover_interval_s`` s; ``discover_kv_events``: a DNS-discovered instance's KV event endpoint
    (``{host}`` template; None: approximate view). ``limits``: the client connections' cap and
    timeouts, as in colocated mode (:mod:`kvroute.server.wire.limits`); ``max_prompt_tokens``: a
    longer prompt is a 400, checked before it is hashed; ``upstream_keepalive_s``: a pooled
    connection to an instance idle for longer is closed (as ``RouterConfig.upstream_keepalive_s``);
    ``max_response_bytes``: the largest answer of an instance read whole (P's, D's when not
    streamed), as ``RouterConfig.max_response_bytes``: beyond it the leg fails."""

    prefill: tuple[PDBackend, ...]
    decode: tuple[PDBackend, ...]
    policy: str = "lmetric"
    block_size: int = 16
    conditional: bool = True
    max_retries: int = 2
    decisions_kept: int = 1000
    scrape_interval: float = 0.5
    connect_timeout_s: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024
    max_response_bytes: int = 256 * 1024 * 1024
    discover: tuple[tuple[str | None, str], ...] = ()
    discover_interval_s: float = 5.0
    discover_kv_events: str | None = None
    limits: ClientLimits = field(
        default_factory=ClientLimits
    )  # client connections: cap and timeouts (wire.limits)
    max_prompt_tokens: int = 262144  # the longest prompt routed (tokens); beyond it a 400
    upstream_keepalive_s: float = 15.0  # an idle pooled upstream connection is closed after this

    def check(self) -> None:
        if not self.decode and not any(role in (None, "decode") for role, _ in self.discover):
            raise ValueError("P/D mode needs at least one --decode instance (or a decode discovery source)")
        for role, src in self.discover:
            if role is None and not src.startswith("file://"):
                raise ValueError(
                    f"discovery source {src}: in P/D mode a DNS source needs a role (decode={src})"
                )
            if role not in (None, *ROLES):
                raise ValueError(f"discovery source {src}: role must be prefill or decode, not {role!r}")
        if self.discover_interval_s <= 0:
            raise ValueError("the discovery interval must be positive")
        urls = [b.url for b in (*self.prefill, *self.decode)]
        if len(set(urls)) != len(urls):
            raise ValueError("an instance may be listed once, as --prefill or as --decode")
        lim = self.limits
        timeouts = (
            lim.header_timeout_s,
            lim.body_timeout_s,
            lim.keepalive_timeout_s,
            lim.write_timeout_s,
            self.upstream_keepalive_s,
        )
        if (
            lim.max_connections < 1
            or self.max_prompt_tokens < 1
            or not all(0 < t < float("inf") for t in timeouts)
        ):
            raise ValueError("max_connections, max_prompt_tokens and the timeouts must be positive")
        if self.block_size <= 0 or self.max_retries < 0 or self.scrape_interval <= 0:
            raise ValueError("block size and scrape interval must be positive, max retries >= 0")


def _json_error(err: ApiError, headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=err.status, body=error_body(err), content_type="application/json", headers=headers
    )


class PDServer:
    """The P/D router's aiohttp app. ``await start(host, port)`` → the bound port; ``await stop()``.
    Single event loop; ``router`` (the P/D routing step) and ``decisions`` are exposed for tests."""

    def __init__(
        self,
        config: PDConfig,
        tokenizer: Tokenizer,
        cost: CostModel,
        transfer: TransferModel,
        *,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_num_batched_tokens: int = 4096,
        resolve: Resolver | None = None,
        parse: ParseBackends | None = None,
    ) -> None:
        config.check()
        self.config = config
        self.tokenizer = RequestTokenizer(tokenizer)
        self.clock = clock
        self.transport = transport or H1Transport(
            connect_timeout_s=config.connect_timeout_s, keepalive_s=config.upstream_keepalive_s, clock=clock
        )
        cores = {}
        for role in ROLES:
            kv = KVView(0, config.block_size, capacity_blocks=16384, ttl_s=None, recovery_s=0.0)
            cores[role] = RoutingCore(make_policy(config.policy), kv)
        self.cores = cores
        # role -> index -> instance; discovery adds and removes (indices are never reused)
        self.members = PDMembership(
            {"prefill": config.prefill, "decode": config.decode}, {r: c.kv for r, c in cores.items()}
        )
        self.pools = self.members.pools
        self.sources: list[tuple[str | None, Source]] = [
            (role, make_source(src, config.discover_kv_events, resolve, parse))
            for role, src in config.discover
        ]
        self._subscribers: dict[tuple[str, int], asyncio.Task[None]] = {}
        self.router = PDRouter(
            cores["prefill"], cores["decode"], cost, transfer, max_num_batched_tokens, config.conditional
        )
        self.decisions: deque[dict[str, Any]] = deque(maxlen=config.decisions_kept)
        self.ids = InFlightIds()  # the request ids in flight: one already held is a 409
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvroute_pd_requests", "P/D requests by routing outcome", ["reason"], registry=self.registry
        )
        self._retries = Counter("kvroute_pd_retries", "P/D leg retries", ["leg"], registry=self.registry)
        self.registry.register(StrayCollector(self.transport))
        self._tasks: list[asyncio.Task[Any]] = []
        self._seq = 0
        self._zmq: zmq.asyncio.Context | None = None
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.port: int | None = None
        self.bad_requests = RateLimitedLog()  # one line a second per kind of bad request

    # -- lifecycle ----------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        expect_ok = expect_continue_within(self.config.max_body_bytes)
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[json_errors(self.bad_requests)]
        )
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect_ok)
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=expect_ok)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/debug/decisions", self.debug_decisions)
        app.router.add_get("/dashboard", self.dashboard)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        runner = LimitedRunner(
            self.make_app(), self.config.limits, self.bad_requests, handler_cancellation=True, access_log=None
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        addrs = runner.addresses
        self.port = int(addrs[0][1]) if addrs else port
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._scrape_loop()))
        prune = pruner(self.transport)
        if prune is not None:  # instances gone, connections idle too long (kvroute.server.wire.pruning)
            self._tasks.append(loop.create_task(prune_every(prune, self._listed)))
        for pool in ROLES:
            for inst in self.pools[pool].values():
                self._subscribe(pool, inst)
        for role, source in self.sources:
            await self._poll(role, source)  # the first look before serving
            self._tasks.append(loop.create_task(self._watch(role, source)))
        return self.port

    def _listed(self) -> set[str]:
        """The base URLs of the instances listed now, in either role."""
        return {*self.members.urls("prefill"), *self.members.urls("decode")}

    def _subscribe(self, role: str, inst: PDInstance) -> None:
        """Follow ``inst``'s KV events into its role's view (nothing without an endpoint)."""
        if not inst.backend.kv_events:
            return
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        sub = EventSubscriber(
            self._zmq, inst.index, inst.backend.kv_events, None, self.cores[role].kv, self.clock
        )
        self._subscribers[(role, inst.index)] = asyncio.get_running_loop().create_task(sub.run())

    def apply(self, changes: PDChanges) -> None:
        """Start and stop KV event subscriptions for the instances that joined and left; the pooled
        connections of an instance that left (and did not join again) are closed."""
        back = {inst.backend.url for _, inst in changes.joined}
        for role, inst in changes.left:
            task = self._subscribers.pop((role, inst.index), None)
            if task is not None:
                task.cancel()
            if isinstance(self.transport, H1Transport) and inst.backend.url not in back:
                self.transport.forget(inst.backend.url)
        for role, inst in changes.joined:
            self._subscribe(role, inst)

    async def _poll(self, role: str | None, source: Source) -> None:
        """Check ``source`` once; a changed list replaces that source's instances (per role)."""
        specs = await source.poll()
        if specs is None:
            return
        listed: dict[str, list[PDBackend]] = {r: [] for r in ROLES}
        for spec in specs:
            r = role or spec.role
            if r is None:
                log.warning("discovery %s: %s has no role (prefill or decode): ignored", source.key, spec.url)
                continue
            listed[r].append(PDBackend(spec.url, spec.kv_events))
        changes = self.members.set_source(source.key, {r: tuple(v) for r, v in listed.items()})
        for conflict in self.members.conflicts:
            log.warning("discovery %s: %s", source.key, conflict)
        if changes:
            log.warning("discovery %s: %s", source.key, changes.describe())
            self.apply(changes)

    async def _watch(self, role: str | None, source: Source) -> None:
        while True:
            await asyncio.sleep(self.config.discover_interval_s)
            await self._poll(role, source)

    async def stop(self) -> None:
        self._tasks.extend(self._subscribers.values())
        self._subscribers.clear()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._http is not None:
            await self._http.close()
        await self.transport.close()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    async def _scrape_loop(self) -> None:
        """Every ``scrape_interval`` s: each engine's ``/metrics`` (KV usage, pool size)."""
        while True:
            for inst in [*self.pools["prefill"].values(), *self.pools["decode"].values()]:
                assert self._http is not None
                began = self.clock()  # the scrape's time: requests routed before it settle
                try:
                    async with self._http.get(inst.backend.url + "/metrics") as r:
                        if r.status == 200:
                            got = parse_vllm_metrics(await r.read(), began)
                            if got is not None:
                                inst.scrape(got)
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
            await asyncio.sleep(self.config.scrape_interval)

    # -- small endpoints ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "prefill": self.members.urls("prefill"), "decode": self.members.urls("decode")}
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        for inst in list(self.pools["decode"].values()):
            try:
                resp = await self.transport.send(inst.backend.url, "GET", "/v1/models", timeout_s=5.0)
            except UpstreamConnectError:
                continue
            try:
                body = await read_capped(resp.iter_chunks(), self.config.max_response_bytes)
            except UpstreamBrokenError:
                resp.abort()
                continue
            resp.release()
            if resp.status == 200:
                return web.Response(body=body, content_type="application/json")
        return _json_error(ApiError(503, "no decode instance answers /v1/models"), {})

    async def debug_decisions(self, request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(list(self.decisions)), content_type="application/json")

    async def dashboard(self, request: web.Request) -> web.Response:
        """The last decisions, newest first: both choices and why."""
        rows = []
        for d in reversed(self.decisions):
            rows.append(
                "<tr>"
                + "".join(
                    f"<td>{html.escape(str(x))}</td>"
                    for x in (
                        d["request_id"],
                        d["reason"],
                        d["prefill"] or "—",
                        d["decode"],
                        d["prompt_tokens"],
                        d["decode_cached_tokens"],
                        f"{d['local_prefill_ms']:.2f}",
                        f"{d['transfer_ms']:.2f}",
                        d["cached_tokens"],
                        d["retries"],
                    )
                )
                + "</tr>"
            )
        head = (
            "request id", "why", "prefill (P)", "decode (D)", "prompt tokens", "D cached", "D prefill ms",
            "transfer ms", "cached tokens (P)", "retries",
        )  # fmt: skip
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>kvroute P/D</title></head><body>"
            f"<h1>kvroute P/D: {len(self.pools['prefill'])} prefill, {len(self.pools['decode'])} decode, "
            f"policy {html.escape(self.config.policy)}</h1><table border='1'><tr>"
            + "".join(f"<th>{h}</th>" for h in head)
            + "</tr>"
            + "".join(rows)
            + "</table></body></html>"
        )
        return web.Response(text=page, content_type="text/html")

    # -- requests -----------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False, path="/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True, path="/v1/chat/completions")

    def _prepare(self, raw: bytes, chat: bool) -> tuple[ParsedRequest, dict[str, Any], list[int]]:
        cap = self.config.max_prompt_tokens
        parsed = parse_request(raw, chat, cap)
        body = orjson.loads(raw)
        try:
            if chat:
                assert parsed.messages is not None
                ids = list(self.tokenizer.chat(parsed.messages, options=parsed.chat_options))
            else:
                assert parsed.prompt is not None
                ids = list(self.tokenizer.prompt(parsed.prompt))
        except ChatTemplateError as exc:
            raise ApiError(400, exc.message, "messages") from None
        except (TypeError, ValueError, KeyError) as exc:
            raise ApiError(400, f"cannot tokenize the request: {exc}") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        if len(ids) > cap:
            raise too_long(len(ids), cap)
        return parsed, body, ids

    async def _handle(self, request: web.Request, chat: bool, path: str) -> web.StreamResponse:
        rid = request_id(request.headers)
        headers = {"x-request-id": rid}
        ids = self.ids
        if not ids.claim(rid):  # one id, both legs: never two requests in flight under it
            return _json_error(in_flight(rid), headers)
        try:
            return await self._route(request, chat, path, rid, headers)
        finally:
            ids.release(rid)

    async def _route(
        self, request: web.Request, chat: bool, path: str, rid: str, headers: dict[str, str]
    ) -> web.StreamResponse:
        try:
            limits = self.config.limits
            raw = await read_body_within(request, self.config.max_body_bytes, limits.body_timeout_s)
            parsed, body, ids = self._prepare(raw, chat)
            chain = tuple(hash_blocks(ids, self.config.block_size, extra_key(None, parsed.cache_salt)))
        except ApiError as err:
            resp = _json_error(err, headers)
            if err.close:
                resp.force_close()
            return resp
        rr = RouteRequest(chain, len(ids), parsed.max_tokens, user=parsed.user)
        if not self.pools["decode"]:
            return _json_error(ApiError(503, "no decode instance is known yet"), headers)
        now = self.clock()
        bs = self.config.block_size
        d_views = [i.view(bs) for i in self.pools["decode"].values()]
        p_views = [i.view(bs) for i in self.pools["prefill"].values()]
        dec = self.router.route(rr, p_views, d_views, now)
        self._seq += 1
        record: dict[str, Any] = {
            "key": f"{rid}#{self._seq}",  # the bookkeeping's key: client ids may repeat
            "request_id": rid,
            "time": time.time(),
            "policy": self.config.policy,
            "prompt_tokens": len(ids),
            "decode_cached_tokens": dec.decode_cached_tokens,
            "local_prefill_ms": dec.local_prefill_s * 1e3,
            "transfer_ms": dec.transfer_s * 1e3,
            "retries": 0,
            "cached_tokens": None,
            "explain": dec.to_dict(),
        }
        try:
            return await self._serve(request, path, rid, rr, body, dec, record, headers)
        finally:
            self._requests.labels(record.get("reason", dec.reason)).inc()
            self.decisions.append(record)

    async def _serve(
        self,
        request: web.Request,
        path: str,
        rid: str,
        rr: RouteRequest,
        body: dict[str, Any],
        dec: PDDecision,
        record: dict[str, Any],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        reason = dec.reason
        kv_params: dict[str, Any] | None = None
        p_cached: int | None = None
        p_url = ""
        if dec.prefill is not None and dec.prefill.instance is not None:
            got = await self._prefill_leg(path, rid, rr, body, dec.prefill, record)
            if got is None:
                reason = "prefill_failed"
            else:
                p_url, kv_params, p_cached, err = got
                if err is not None:
                    record["reason"] = "prefill_error"
                    record["prefill"], record["decode"] = p_url, ""
                    return err
        record["reason"] = reason
        record["prefill"] = p_url
        record["cached_tokens"] = p_cached
        d_body = dict(body)
        if kv_params is not None:
            d_body["kv_transfer_params"] = kv_params
        assert dec.decode.instance is not None
        headers.update(
            {
                "x-kvroute-pd": reason,
                "x-kvroute-prefill": p_url,
                "x-kvroute-policy": self.config.policy,
                "x-kvroute-prompt-tokens": str(rr.prompt_tokens),
                "x-kvroute-cached-tokens": str(dec.prefill.cached_on(dec.prefill.instance))
                if dec.prefill is not None and dec.prefill.instance is not None
                else "0",
                "x-kvroute-decode-cached-tokens": str(dec.decode_cached_tokens),
                "x-kvroute-local-prefill-ms": f"{dec.local_prefill_s * 1e3:.3f}",
                "x-kvroute-transfer-ms": f"{dec.transfer_s * 1e3:.3f}",
            }
        )
        local = kv_params is None
        new_tokens = rr.prompt_tokens - dec.decode_cached_tokens if local else 1
        return await self._decode_leg(
            request, path, rid, rr, d_body, dec.decode, new_tokens, p_cached, record, headers
        )

    def _order(self, pool: str, first: Decision, rr: RouteRequest, tried: set[int]) -> int | None:
        """The next instance of ``pool`` to try: ``first``'s choice, then the policy's choice among
        those not tried yet (the load term for D)."""
        if not tried and first.instance in self.pools[pool]:
            return first.instance
        left = [i.view(self.config.block_size) for i in self.pools[pool].values() if i.index not in tried]
        if not left:
            return None
        core = self.cores[pool]
        req = rr if pool == "prefill" else RouteRequest((), 1, rr.max_tokens, user=rr.user)
        return core.route(req, left, self.clock()).instance

    async def _prefill_leg(
        self,
        path: str,
        rid: str,
        rr: RouteRequest,
        body: dict[str, Any],
        decision: Decision,
        record: dict[str, Any],
    ) -> tuple[str, dict[str, Any] | None, int | None, web.Response | None] | None:
        """Run the P leg with retries: (P's URL, its kv_transfer_params, its cached tokens, an error
        response to relay (a 4xx) or None); None when every P failed."""
        p_body = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
        p_body.update(kv_transfer_params=dict(P_PARAMS), stream=False, max_tokens=1)
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        raw = orjson.dumps(p_body)
        tried: set[int] = set()
        while len(tried) <= self.config.max_retries:
            idx = self._order("prefill", decision, rr, tried)
            if idx is None:
                return None
            tried.add(idx)
            inst = self.pools["prefill"][idx]
            key = record["key"]
            new = decision.new_prefill(idx) if idx == decision.instance else rr.prompt_tokens
            inst.add(key, new, -(-rr.prompt_tokens // self.config.block_size), self.clock())
            self.cores["prefill"].kv.on_routed(idx, rr.chain, self.clock())
            try:
                resp = await self._send(inst.backend.url, path, raw, rid)
                whole = False
                try:
                    data = await read_capped(resp.iter_chunks(), self.config.max_response_bytes)
                    whole = 200 <= resp.status < 500
                finally:
                    if whole:
                        resp.release()
                    else:  # a 5xx, a broken body, or the client gone: drop the connection (P aborts)
                        resp.abort()
                if not 200 <= resp.status < 500:  # a 5xx, or no final answer (a 101)
                    raise LegFailed(f"HTTP {resp.status}")
            except (
                LegFailed,
                UpstreamConnectError,
                UpstreamBrokenError,
                aiohttp.ClientError,
                OSError,
            ) as exc:
                log.warning("prefill %s failed for %s: %s", inst.backend.url, rid, exc)
                record["retries"] += 1
                self._retries.labels("prefill").inc()
                continue
            finally:
                inst.done(key)
            if resp.status != 200:
                return (
                    inst.backend.url,
                    None,
                    None,
                    web.Response(status=resp.status, body=data, content_type="application/json"),
                )
            try:
                obj = orjson.loads(data)
                params = obj.get("kv_transfer_params")
                cached = int(
                    ((obj.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                )
            except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                params, cached = None, 0
            return inst.backend.url, params if isinstance(params, dict) else None, cached, None
        return None

    async def _send(self, url: str, path: str, raw: bytes, rid: str) -> UpstreamResponse:
        return await self.transport.send(
            url,
            "POST",
            path,
            raw,
            {"Content-Type": "application/json", "X-Request-Id": rid},
            timeout_s=None,
        )

    async def _decode_leg(
        self,
        request: web.Request,
        path: str,
        rid: str,
        rr: RouteRequest,
        d_body: dict[str, Any],
        decision: Decision,
        new_tokens: int,
        p_cached: int | None,
        record: dict[str, Any],
        headers: dict[str, str],
    ) -> web.StreamResponse:
        raw = orjson.dumps(d_body)
        stream = bool(d_body.get("stream"))
        tried: set[int] = set()
        while len(tried) <= self.config.max_retries:
            idx = self._order("decode", decision, rr, tried)
            if idx is None:
                break
            tried.add(idx)
            inst = self.pools["decode"][idx]
            url = inst.backend.url
            key = record["key"]
            inst.add(key, new_tokens, -(-rr.prompt_tokens // self.config.block_size), self.clock())
            self.cores["decode"].kv.on_routed(idx, rr.chain, self.clock())
            record["decode"] = url
            headers.update({"x-kvroute-decode": url, "x-kvroute-backend": url})
            resp: UpstreamResponse | None = None
            try:
                try:
                    resp = await self._send(url, path, raw, rid)
                except UpstreamTimeoutError as exc:  # D has it and is slow: this client's 504
                    log.info("decode %s gave no answer in time for %s", url, rid)
                    return _json_error(timed_out(str(exc)), headers)
                except (UpstreamConnectError, aiohttp.ClientError, OSError) as exc:
                    raise LegFailed(str(exc)) from None
                if not 200 <= resp.status < 500:  # a 5xx, or no final answer (a 101)
                    resp.abort()
                    raise LegFailed(f"HTTP {resp.status}")
                inst.start(key)
                headers["x-kvroute-retries"] = str(record["retries"])
                if resp.status != 200 or not stream:
                    return await relay_whole(resp, p_cached, headers, self.config.max_response_bytes)
                return await relay_stream(
                    request, resp, p_cached, headers, self.config.limits.write_timeout_s
                )
            except LegFailed as exc:
                log.warning("decode %s failed for %s: %s", url, rid, exc)
                record["retries"] += 1
                self._retries.labels("decode").inc()
                continue
            finally:
                inst.done(key)
                if resp is not None:
                    resp.abort()  # idempotent after release; drops the connection when cut short
        record["reason"] = "decode_failed"
        return _json_error(ApiError(502, "no decode instance answered"), headers)
