"""One request's trip through the live router, as its stages: parse → prepare → decide → reserve →
forward → relay → settle (:meth:`Proxy.handle` reads top to bottom that way).

- **parse** (:mod:`.stages.parse`): the body, bounded (size, time) and checked, off the event loop
  when large; the prompt capped (:func:`~.stages.prepare.prompt_cap`);
- **prepare** (:mod:`.stages.prepare`): token ids and block chain (tokenized now, on the worker thread,
  or deferred);
- **decide** (:mod:`.stages.decide`): the routing core's decision as a frozen plan (the retry order);
- **wait** (:mod:`.stages.wait`, with ``router_queue`` on): until the plan's first backend can take
  the request (late binding; the plan is made again then);
- **reserve** (:mod:`.stages.forward`): a lease on the next backend of the plan;
- **forward** (:mod:`.stages.forward`): the body, unchanged, through the transport;
- **relay** (:mod:`.wire.relay`): the answer to the client, streamed or buffered;
- **settle** (:mod:`.stages.settle`): the outcome into the KV view, the counters and the decision record.

Each stage is a function of the frozen objects the earlier ones made; none calls back into an
earlier one. Forwarding rules: an attempt that fails *before the backend's first body byte*
(connection error, or a 502/503/504 status) is retried on the plan's next backend, at most
``max_retries`` times; a connection error (or a response broken before its first byte) also ejects
the backend at once (the health checker re-admits it). A request the backend took but answered
no head for within ``upstream_timeout_s`` (a long non-streamed generation: the request's doing,
not the backend's) is answered a 504 JSON error, its upstream connection closed (the engine
cancels it), neither retried nor ejecting the backend; the same for a first body byte that does not
come in time (:mod:`kvroute.server.wire.relay`). After the first byte, see
:mod:`kvroute.server.wire.relay`. A client that goes away cancels the handler, which aborts the
upstream connection (the engine then cancels the request); leases are released on every path.

Request ids: the client's valid ``X-Request-Id`` is the request's id, sent to the engine (a
vLLM-style engine names its completion ``cmpl-<id>``), else the router makes a random one. An id
already in flight on this router process is refused with a 409 ``invalid_request_error`` naming the
header, before the body is read (:mod:`.stages.ids`, which says what holds across processes).

Shutdown (driven by :meth:`kvroute.server.app.RouterServer.shutdown`): once :attr:`Proxy.refusing` is
set, new requests get a 503 ``service_unavailable`` JSON error with Retry-After (and the connection is
closed); :meth:`Proxy.wait_idle` waits for the requests in flight; :meth:`Proxy.abort_inflight` ends
them: a stream already started gets an SSE error event (``data: {"error": ...}`` then ``data: [DONE]``),
a request with nothing sent yet a 503 JSON error; both count as ``drained``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from kvroute.server.observe.observer import REQUEST_ID_HEADER, Observer, request_id
from kvroute.server.observe.recording import TrafficRecording
from kvroute.server.stages.decide import decide
from kvroute.server.stages.forward import forward, reserve, sent, takes
from kvroute.server.stages.ids import InFlightIds, in_flight
from kvroute.server.stages.parse import BodyParser
from kvroute.server.stages.prepare import Prepared, Tail, prepare, prompt_cap
from kvroute.server.stages.settle import late, refuse, settle, unavailable
from kvroute.server.stages.wait import WaitingRoom
from kvroute.server.state.backends import BackendState, Lease
from kvroute.server.state.router import RouterState
from kvroute.server.wire.http import error_response, forward_headers
from kvroute.server.wire.limits import read_body_within
from kvroute.server.wire.relay import BROKEN, relay, shutting_down
from kvroute.server.wire.transport import Transport, UpstreamConnectError, UpstreamTimeoutError
from kvroute.server.wire.validate import ApiError

__all__ = ["STAGES", "Proxy"]

log = logging.getLogger("kvroute.server")

RETRYABLE_STATUS = frozenset({502, 503, 504})

STAGES = ("parse", "split", "tokenize", "hash", "plan")
"""Steps of routing a request, timed on /metrics (``kvroute_routing_stage_seconds``): parse; the
prepare stage's split (cache lookups), tokenize and hash; plan (the decide stage: match + policy)."""


class Proxy:
    """The router's request handlers: each request through the stages (module docstring), against
    ``state``, through ``transport``; ``observer`` records decisions and outcomes
    (:mod:`kvroute.server.observe.observer`; by default one on a registry of its own). Tracks the
    requests in flight for the shutdown."""

    def __init__(
        self,
        state: RouterState,
        transport: Transport,
        observer: Observer | None = None,
        recording: TrafficRecording | None = None,
    ) -> None:
        self.state = state
        self.recording = recording  # --record FILE: every routed request into a trace
        self.transport = transport
        if observer is None:
            from prometheus_client import CollectorRegistry

            observer = Observer(state, CollectorRegistry())
        self.observer = observer
        self.route_seconds_sum = 0.0  # time spent routing (parse + prepare + decide), seconds
        self.route_count = 0
        # the same time by step (seconds, wall, on the event loop; "tokenize" includes a wait for
        # the worker thread): see STAGES
        self.stage_seconds = dict.fromkeys(STAGES, 0.0)
        # Long prompts are tokenized on one worker thread (HF tokenizers releases the GIL), so the
        # event loop keeps relaying other streams meanwhile; threads start on first use.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")
        # large bodies are parsed (and long token-id prompts hashed) off the loop (stages.parse)
        self.parser = BodyParser(state.config.parse_offload, state.config.parse_offload_bytes)
        self.refusing = False  # shutting down: new requests get a 503
        self._aborting = False  # shutting down: the handlers in flight are being cancelled
        self._inflight: set[asyncio.Task[object]] = set()  # handler tasks of the requests in flight
        self.ids = InFlightIds()  # the request ids in flight (module docstring)
        self._idle: asyncio.Event | None = None  # set when the last request in flight ends
        qcfg = state.config.router_queue
        self.waiting = WaitingRoom(state, qcfg) if qcfg is not None else None  # the router-side queue
        observer.waiting = self.waiting

    @property
    def tokenize_pool(self) -> ThreadPoolExecutor:
        """The worker thread that tokenizes long prompts (shared by every front door of the process)."""
        return self._tokenize_pool

    @property
    def inflight(self) -> int:
        """Requests in flight (being read, routed, forwarded or relayed)."""
        return len(self._inflight)

    async def wait_idle(self, timeout_s: float, hurry: asyncio.Event | None = None) -> bool:
        """Wait up to ``timeout_s`` seconds (less if ``hurry`` is set meanwhile) until no request is in
        flight; True if none is."""
        if not self._inflight:
            return True
        self._idle = asyncio.Event()
        waits = [asyncio.ensure_future(self._idle.wait())]
        if hurry is not None:
            waits.append(asyncio.ensure_future(hurry.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return not self._inflight

    def abort_inflight(self) -> int:
        """End every request in flight (see the module docstring); returns how many there were."""
        self._aborting = True
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        return len(tasks)

    def _draining(self) -> bool:
        return self._aborting

    def close(self) -> None:
        """Stop the tokenizer thread (pending work is finished first) and the parse worker."""
        self._tokenize_pool.shutdown(wait=True)
        self.parser.close()

    # ---- handlers ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._track(request, chat=False, path="/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._track(request, chat=True, path="/v1/chat/completions")

    async def _track(self, request: web.Request, chat: bool, path: str) -> web.StreamResponse:
        """Track the request while it is in flight; refuse it while shutting down."""
        if self.refusing:
            self.state.counters.unavailable += 1
            resp = error_response(shutting_down("not accepting requests"), self.state.config.retry_after_s)
            resp.force_close()
            return resp
        task = asyncio.current_task()
        assert task is not None
        inflight = self._inflight
        inflight.add(task)
        try:
            return await self.handle(request, chat, path)
        except asyncio.CancelledError:
            if not self._aborting:
                raise
            task.uncancel()  # ended by the drain before anything was sent: answer 503
            self.state.counters.drained += 1
            resp = error_response(
                shutting_down("request not finished in time"), self.state.config.retry_after_s
            )
            resp.force_close()
            return resp
        finally:
            inflight.discard(task)
            if not inflight and self._idle is not None:
                self._idle.set()

    async def handle(self, request: web.Request, chat: bool, path: str) -> web.StreamResponse:
        """One request, stage by stage (module docstring); always returns the client's answer. Its
        id is held from here to the end: one already held is refused (409)."""
        arrival = time.perf_counter()
        rid = request_id(request.headers)
        ids = self.ids
        if not ids.claim(rid):
            return refuse(self.state, self.observer, in_flight(rid), rid, path, arrival)
        try:
            return await self._handle(request, chat, path, rid, arrival)
        finally:
            ids.release(rid)

    async def _handle(
        self, request: web.Request, chat: bool, path: str, rid: str, arrival: float
    ) -> web.StreamResponse:
        state, obs = self.state, self.observer
        clock = time.perf_counter
        try:
            cfg = state.config
            raw = await read_body_within(request, cfg.max_body_bytes, cfg.body_timeout_s)
            t0 = clock()
            cap = prompt_cap(state)
            body = await self.parser.parse(
                raw, chat, cap, cfg.block_size, lambda: state.pools.adapters
            )  # parse
            parsed = body.request
            t1 = clock()
            prep = await prepare(state, parsed, self._tokenize_pool, cap, body.chain)  # prepare
            waiting = self.waiting
            hold = None
            if waiting is None:
                plan = decide(state, parsed, prep, request.headers)  # decide
            else:
                plan, hold = await waiting.decide(parsed, prep, request.headers)  # decide, wait
            t5 = clock() - plan.decision.queued_s  # routing time without the wait
        except ApiError as err:
            resp = refuse(state, obs, err, rid, path, arrival)
            if err.close:  # the rest of the request is never read: the connection cannot go on
                resp.force_close()
            return resp
        try:  # nothing here awaits; should any of it raise, the wait stage's hold goes with it
            self.timed(t0, t1, prep, t5)
            tail = None
            if prep.pending is not None:  # tokenize=defer: the new text is tokenized on the way
                tail = Tail(state, plan.cached_blocks, self._tokenize_pool, prep.pending, prep.key)
            headers = forward_headers(request)
            headers[REQUEST_ID_HEADER] = rid
            rec = obs.planned(rid, plan.decision, plan.shadow, path, request.headers, arrival, t5 - t0)
            recording = self.recording
            ticket = recording.begin(arrival) if recording is not None else 0
        except BaseException:
            if hold is not None:
                hold.release()
            raise
        end: bytes | None = None
        try:
            attempts = plan.order[: 1 + state.config.max_retries]
            last_error = "no backend available"
            for n, idx in enumerate(attempts):
                if not takes(state, idx, retry=n > 0):
                    continue
                if n:
                    state.counters.retries += 1
                target = reserve(state, plan, idx, tail)  # reserve
                if hold is not None:  # the wait stage's hold, now the lease's
                    hold.release()
                    hold = None
                obs.attempt(rec, idx, target.url, n > 0, headers)
                lease = target.lease
                try:
                    up = await forward(self.transport, target, path, raw, headers)  # forward
                    sent(state, plan, target, tail)
                except UpstreamTimeoutError as exc:  # the backend has it and is slow: not its failure
                    self.release(lease)
                    return late(state, obs, rec, str(exc))
                except UpstreamConnectError as exc:
                    self.release(lease)
                    self._eject(state.backends[idx], f"{exc} (request {rid})")
                    last_error = f"backend {target.url} unreachable"
                    continue
                except BaseException:
                    self.release(lease)
                    raise
                if up.status in RETRYABLE_STATUS and n + 1 < len(attempts):
                    self.release(lease)
                    up.abort()
                    last_error = f"backend {target.url} answered {up.status}"
                    continue
                after = None if tail is None else tail.run
                try:  # relay
                    out = await relay(
                        request,
                        up,
                        parsed.stream,
                        obs.response_headers(rec),
                        self.first_byte(lease),
                        after,
                        self._draining,
                        state.config.write_timeout_s,
                        state.config.max_response_bytes,
                    )
                finally:
                    self.release(lease)
                if out.outcome == BROKEN:
                    self._eject(state.backends[idx], out.error)
                    last_error = f"backend {target.url} failed before its first byte"
                    continue
                settle(state, plan, idx, out, tail, rec)  # settle
                end = out.end
                if out.cancelled:  # the client left (or the drain ended it): the cancellation goes on
                    raise asyncio.CancelledError
                assert out.response is not None
                return out.response
            return unavailable(state, obs, rec, last_error)
        finally:
            if hold is not None:  # no attempt was made
                hold.release()
                self.release(None)
            obs.finish(rec)
            if recording is not None:
                chain = tail.chain if tail is not None and tail.chain is not None else plan.chain
                prompt = plan.decision.prompt_tokens
                recording.end(ticket, arrival, parsed, chain, prompt, request.headers, rec.status, end)

    def release(self, lease: Lease | None) -> None:
        """End ``lease``; with the router-side queue, the freed room may let a waiting request go."""
        if lease is not None:
            lease.release()
        if self.waiting is not None:
            self.waiting.poke()

    def first_byte(self, lease: Lease) -> Callable[[], None]:
        """What to call at ``lease``'s first byte: it turns running (with the router-side queue, the
        freed room may let a waiting request go)."""
        if self.waiting is None:
            return lease.first_byte
        return self._first_byte(lease)

    def _first_byte(self, lease: Lease) -> Callable[[], None]:
        waiting = self.waiting
        assert waiting is not None

        def first_byte() -> None:
            lease.first_byte()
            waiting.poke()

        return first_byte

    def timed(self, t0: float, t1: float, prep: Prepared, t5: float) -> None:
        """Add one request's routing time (seconds) to the totals by step."""
        stages = self.stage_seconds
        stages["parse"] += t1 - t0
        stages["split"] += prep.split_at - t1
        stages["tokenize"] += prep.tokenized_at - prep.split_at
        stages["hash"] += prep.hashed_at - prep.tokenized_at
        stages["plan"] += t5 - prep.hashed_at
        self.route_seconds_sum += t5 - t0
        self.route_count += 1

    @staticmethod
    def _eject(backend: BackendState, why: str) -> None:
        if backend.eject():
            log.warning("ejected backend %s: %s", backend.url, why)
