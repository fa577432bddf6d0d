"""The aiohttp side of the router: HTTP handlers, forwarding with retries, streaming pass-through.

Forwarding rules (see :meth:`Proxy.forward`):

- the body is sent unchanged to the backends in the plan's order; an attempt that fails *before the
  backend's first body byte* (connection error, or a 502/503/504 status) is retried on the next-best
  backend, at most ``max_retries`` times; a connection error also ejects the backend at once (the
  health checker re-admits it);
- nothing is sent to the client before the first upstream body byte; after it, a broken upstream
  stream ends with an SSE error event (``data: {"error": ...}`` then ``data: [DONE]``) for streamed
  requests, or a 502 JSON error for non-streamed ones (their body is buffered);
- a client that goes away cancels the handler, which aborts the upstream connection (the engine then
  cancels the request); counters are released in ``finally`` on every path.

Shutdown (driven by :meth:`kvroute.server.app.RouterServer.shutdown`): once :attr:`Proxy.refusing` is
set, new requests get a 503 ``service_unavailable`` JSON error with Retry-After (and the connection is
closed); :meth:`Proxy.wait_idle` waits for the requests in flight; :meth:`Proxy.abort_inflight` ends
them: a stream already started gets an SSE error event (``data: {"error": ...}`` then ``data: [DONE]``),
a request with nothing sent yet a 503 JSON error; both count as ``drained``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import orjson
from aiohttp import web

from kvroute.server.state.backends import ACTIVE, BackendState, Lease
from kvroute.prepare.chainmemo import Piece
from kvroute.server.observe.decisions import DecisionRecord
from kvroute.server.observe.observer import REQUEST_ID_HEADER, Observer, request_id
from kvroute.server.state.router import Plan, QuotaExceeded, RouterState
from kvroute.prepare.tokenize import Pending
from kvroute.server.wire.transport import Transport, UpstreamBrokenError, UpstreamConnectError, UpstreamResponse
from kvroute.server.wire.validate import ApiError, error_body, parse_request

__all__ = ["Proxy", "extract_cached_tokens"]

log = logging.getLogger("kvroute.server")

_RETRYABLE_STATUS = frozenset({502, 503, 504})
_TAIL_BYTES = 8192
_JSON = "application/json"


def error_response(err: ApiError, retry_after: int | None = None) -> web.Response:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.Response(status=err.status, body=error_body(err), content_type=_JSON, headers=headers)


def extract_cached_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a JSON body or the last SSE event carrying
    usage in ``data`` (the tail of a stream); None when absent or unparsable."""
    key = b'"cached_tokens"'
    pos = data.rfind(key)
    if pos < 0:
        return None
    start = data.rfind(b"\n", 0, pos) + 1
    end = data.find(b"\n", pos)
    line = data[start : end if end >= 0 else len(data)].strip()
    if line.startswith(b"data:"):
        line = line[5:].strip()
    try:
        obj = orjson.loads(line)
        cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None


DEFER_CHARS = 1024
"""With ``tokenize: defer``: a prompt with at least this many characters of text the router has not
tokenized before is routed before that text is tokenized (see ``RouterConfig.tokenize``)."""

OFFLOAD_CHARS = 65536
"""At least this many characters to tokenize (~16,000 tokens, a few ms even with the tiktoken
encoder) are tokenized off the event loop, on the worker thread (HF tokenizers and tiktoken release
the GIL). Below it, the hand-off to the thread and back costs more latency than it saves: on the
proxy benchmark (one run each) the mean tokenize stage fell from 1,116 µs with a threshold of 8,192
characters to 646 µs with this one."""


STAGES = ("parse", "split", "tokenize", "hash", "plan")
"""Stages of routing a request, timed on /metrics (``kvroute_routing_stage_seconds``)."""


TAIL_GRACE_S = 0.005
"""With ``tokenize: defer``: a routed request's new text is tokenized once its first byte has been
relayed to the client, or once it has waited this long (seconds) without one, whichever comes first.
A quick first token is not held up behind the router's own work; a long prefill gets its queued
prefill corrected while it waits."""


class _Tail:
    """The deferred tokenization of a routed request's new text.

    Until it is done the request travels on an estimate (``plan.prompt_tokens``, a chain of its known
    blocks only). It runs (:meth:`run`) after the first byte was relayed, or ``TAIL_GRACE_S`` after
    the request was sent (:meth:`arm`), whichever is first, on the event loop (on the worker thread
    from ``OFFLOAD_CHARS``); then every backend the request was sent to records the whole chain in the
    KV view, the live attempt's queued prefill is corrected while it still waits, and the token cache
    knows the text for the conversation's next turn."""

    __slots__ = (
        "_pending",
        "_pool",
        "_salt",
        "_timer",
        "chain",
        "core",
        "lease",
        "n_tokens",
        "plan",
        "routed",
    )

    def __init__(
        self,
        core: RouterState,
        plan: Plan,
        pool: ThreadPoolExecutor,
        pending: Pending,
        salt: str | bytes | None,
    ) -> None:
        self.state = core
        self.plan = plan
        self.chain: tuple[int, ...] | None = None  # the whole prompt's chain, once known
        self.n_tokens = 0  # the whole prompt's tokens, once known
        self.routed: list[int] = []  # backends the request was sent to so far
        self.lease: Lease | None = None  # the attempt in progress
        self._pool = pool
        self._pending: Pending | None = pending  # None once started
        self._salt = salt
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """The request was sent: run at the latest ``TAIL_GRACE_S`` from now."""
        if self._pending is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TAIL_GRACE_S, self.run)

    def run(self) -> None:
        """Tokenize the rest now (once; later calls do nothing); the chain is computed on the loop."""
        pending, self._pending = self._pending, None
        if self._timer is not None:
            self._timer.cancel()
        if pending is None:
            return
        salt = self._salt
        if pending.tail_chars >= OFFLOAD_CHARS:
            loop = asyncio.get_running_loop()
            try:
                fut = loop.run_in_executor(self._pool, self.state.tokenizer.finish_pieces, pending)
            except RuntimeError:  # the router is stopping (the thread pool is shut down)
                return
            fut.add_done_callback(lambda f: self._done(f, pending.suffix, salt))
        else:
            self._inline(pending, salt)

    def _inline(self, pending: Pending, salt: str | bytes | None) -> None:
        try:
            pieces = self.state.tokenizer.finish_pieces(pending)
            self._finish(*self.state.hashed(pieces, pending.suffix, salt))
        except Exception as exc:  # the request already went out on the estimate; only the view misses it
            log.warning("tokenizing a routed request's new text failed: %r", exc)

    def _done(
        self, fut: asyncio.Future[list[Piece]], suffix: Sequence[int], salt: str | bytes | None
    ) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            try:
                self._finish(*self.state.hashed(fut.result(), suffix, salt))
                return
            except Exception as err:
                exc = err
        log.warning("tokenizing a routed request's new text failed: %r", exc)

    def _finish(self, ids: list[int], chain: tuple[int, ...]) -> None:
        self.n_tokens, self.chain = len(ids), chain
        now = self.state.clock()
        for idx in self.routed:
            self.state.kv.on_routed(idx, self.chain, now)
        if self.lease is not None:
            self.lease.adjust(self.prefill(self.lease.backend.index))

    def prefill(self, idx: int) -> int:
        """The exact new prefill on backend ``idx`` (once the tail is tokenized)."""
        cached = min(self.plan.cached_blocks.get(idx, 0) * self.state.config.block_size, self.n_tokens)
        return self.n_tokens - cached


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def _shutting_down(detail: str) -> ApiError:
    return ApiError(503, f"the router is shutting down: {detail}", etype="service_unavailable")


class Proxy:
    """Forwards requests planned by a :class:`RouterState` through a :class:`Transport`; ``observer``
    records decisions and outcomes (:mod:`kvroute.server.observe.observer`; by default one on a registry of
    its own)."""

    def __init__(self, core: RouterState, transport: Transport, observer: Observer | None = None) -> None:
        self.state = core
        self.transport = transport
        if observer is None:
            from prometheus_client import CollectorRegistry

            observer = Observer(core, CollectorRegistry())
        self.observer = observer
        self.route_seconds_sum = 0.0  # time spent routing (parse + tokenize + plan), seconds
        self.route_count = 0
        # the same time by stage (seconds, wall, on the event loop; "tokenize" includes a wait for
        # the worker thread): parse, split (cache lookups), tokenize, hash, plan (match + policy)
        self.stage_seconds = dict.fromkeys(STAGES, 0.0)
        # Long prompts are tokenized on one worker thread (HF tokenizers releases the GIL), so the
        # event loop keeps relaying other streams meanwhile; threads start on first use.
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-tokenize")
        self.refusing = False  # shutting down: new requests get a 503
        self._aborting = False  # shutting down: the handlers in flight are being cancelled
        self._inflight: set[asyncio.Task[object]] = set()  # handler tasks of the requests in flight
        self._idle: asyncio.Event | None = None  # set when the last request in flight ends

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

    def close(self) -> None:
        """Stop the tokenizer thread (pending work is finished first)."""
        self._tokenize_pool.shutdown(wait=True)

    # ---- handlers ----------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False, path="/v1/completions")

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True, path="/v1/chat/completions")

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.state.config.max_body_bytes
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

    async def _handle(self, request: web.Request, chat: bool, path: str) -> web.StreamResponse:
        """Track the request while it is in flight; refuse it while shutting down."""
        if self.refusing:
            self.state.counters.unavailable += 1
            resp = error_response(_shutting_down("not accepting requests"), self.state.config.retry_after_s)
            resp.force_close()
            return resp
        task = asyncio.current_task()
        assert task is not None
        inflight = self._inflight
        inflight.add(task)
        try:
            return await self._route(request, chat, path)
        except asyncio.CancelledError:
            if not self._aborting:
                raise
            task.uncancel()  # ended by the drain before anything was sent: answer 503
            self.state.counters.drained += 1
            resp = error_response(
                _shutting_down("request not finished in time"), self.state.config.retry_after_s
            )
            resp.force_close()
            return resp
        finally:
            inflight.discard(task)
            if not inflight and self._idle is not None:
                self._idle.set()

    async def _route(self, request: web.Request, chat: bool, path: str) -> web.StreamResponse:
        counters = self.state.counters
        clock = time.perf_counter
        arrival = clock()
        rid = request_id(request.headers)
        try:
            raw = await self._read_body(request)
            stages = self.stage_seconds
            t0 = clock()
            parsed = parse_request(raw, chat)
            core = self.state
            key = core.extra_key(parsed)  # LoRA adapter and cache salt
            t1 = clock()
            pending = core.split(parsed)
            t2 = clock()
            stages["parse"] += t1 - t0
            stages["split"] += t2 - t1
            tail = None
            if pending.tail_chars >= DEFER_CHARS and core.defer_tokenize:
                est = core.tokenizer.estimate_tail(pending)
                known, chain = core.hashed(pending.known_pieces, (), key)
                plan = core.plan(parsed, known, request.headers, tail_tokens=est, hashes=chain)
                tail = _Tail(core, plan, self._tokenize_pool, pending, key)
                t3 = t4 = t2
            else:
                if pending.tail_chars >= OFFLOAD_CHARS:
                    loop = asyncio.get_running_loop()
                    pieces = await loop.run_in_executor(
                        self._tokenize_pool, core.tokenizer.finish_pieces, pending
                    )
                else:
                    pieces = core.tokenizer.finish_pieces(pending)
                t3 = clock()
                ids, chain = core.hashed(pieces, pending.suffix, key)
                t4 = clock()
                plan = core.plan(parsed, ids, request.headers, hashes=chain)
            t5 = clock()
            stages["tokenize"] += t3 - t2
            stages["hash"] += t4 - t3
            stages["plan"] += t5 - t4
            self.route_seconds_sum += t5 - t0
            self.route_count += 1
        except ApiError as err:
            if err.status == 503:
                counters.unavailable += 1
                resp = error_response(err, self.state.config.retry_after_s)
            elif isinstance(err, QuotaExceeded):  # 429 with Retry-After (token quota)
                counters.client_errors += 1
                if err.decision is not None:
                    self.observer.refused(rid, err.decision, path, arrival, 429)
                resp = error_response(err, err.retry_after)
            else:
                counters.client_errors += 1
                counters.rejected += 1
                resp = error_response(err)
            resp.headers[REQUEST_ID_HEADER] = rid
            return resp
        headers = _forward_headers(request)
        headers[REQUEST_ID_HEADER] = rid
        obs = self.observer
        rec = obs.planned(rid, plan, path, request.headers, arrival, t5 - t0)
        try:
            return await self.forward(request, plan, path, raw, headers, parsed.stream, tail, rec)
        finally:
            obs.finish(rec)

    # ---- forwarding --------------------------------------------------------------------------

    async def forward(
        self,
        request: web.Request,
        plan: Plan,
        path: str,
        body: bytes,
        headers: dict[str, str],
        stream: bool,
        tail: _Tail | None = None,
        rec: DecisionRecord | None = None,
    ) -> web.StreamResponse:
        """Try the plan's backends in order (see the module docstring); always returns a response.
        ``tail``: the request's deferred tokenization, if any; ``rec``: its decision record (attempts,
        first byte, status and cached tokens are written into it)."""
        core = self.state
        counters = core.counters
        attempts = plan.order[: 1 + core.config.max_retries]
        last_error = "no backend available"
        for n, idx in enumerate(attempts):
            backend = core.backends[idx]
            if backend.state != ACTIVE or (n and not backend.healthy):
                continue  # drained or removed since the plan (the first choice is tried even if ejected)
            if n:
                counters.retries += 1
            # A backend whose KV view is exact needs the routing history only as a fallback for a
            # later event gap, so it is recorded once the request is on its way, off the TTFT path.
            now = core.clock()
            late = core.kv.mode(idx, now) == "exact"
            blocks = -(-plan.prompt_tokens // core.config.block_size)  # its KV while it runs
            if tail is None:
                lease = Lease(backend, plan.new_prefill[idx], blocks)
                if not late:
                    core.kv.on_routed(idx, plan.chain, now)
            else:
                known = tail.chain is not None
                lease = Lease(backend, tail.prefill(idx) if known else plan.new_prefill[idx], blocks)
                if not late:
                    core.kv.on_routed(idx, tail.chain or plan.chain, now)
                tail.routed.append(idx)
                tail.lease = lease
            if rec is not None:
                self.observer.attempt(rec, idx, backend.url, n > 0, headers)
            try:
                up = await self.transport.send(backend.url, "POST", path, body, headers)
                if tail is not None:
                    tail.arm()
                if late:
                    core.kv.on_routed(idx, plan.chain if tail is None else (tail.chain or plan.chain), now)
            except UpstreamConnectError as exc:
                lease.release()
                self._eject(backend, f"{exc} (request {headers.get(REQUEST_ID_HEADER)})")
                last_error = f"backend {backend.url} unreachable"
                continue
            except BaseException:
                lease.release()
                raise
            if up.status in _RETRYABLE_STATUS and n + 1 < len(attempts):
                lease.release()
                up.abort()
                last_error = f"backend {backend.url} answered {up.status}"
                continue
            result = await self._relay(request, up, lease, plan, stream, tail, rec)
            if result is not None:
                return result
            last_error = f"backend {backend.url} failed before its first byte"
        counters.unavailable += 1
        resp = error_response(
            ApiError(503, last_error, etype="service_unavailable"), core.config.retry_after_s
        )
        if rec is not None:
            rec.status = 503
            resp.headers.update(self.observer.response_headers(rec))
        return resp

    def _eject(self, backend: BackendState, why: str) -> None:
        if backend.eject():
            log.warning("ejected backend %s: %s", backend.url, why)

    async def _relay(
        self,
        request: web.Request,
        up: UpstreamResponse,
        lease: Lease,
        plan: Plan,
        stream: bool,
        tail: _Tail | None,
        rec: DecisionRecord | None = None,
    ) -> web.StreamResponse | None:
        """Relay one upstream response; None when it broke before its first byte (retry)."""
        idx = lease.backend.index
        done = False
        chunks: AsyncIterator[bytes] = up.iter_chunks()
        try:
            try:
                first = await anext(chunks)
            except StopAsyncIteration:
                first = b""
            except UpstreamBrokenError as exc:
                self._eject(lease.backend, str(exc))
                return None
            lease.first_byte()
            extra = None
            if rec is not None:
                rec.first_byte = time.perf_counter()
                extra = self.observer.response_headers(rec)
            if not stream or up.status != 200:
                resp = await self._relay_buffered(up, first, chunks)
                done = True
                if tail is not None:
                    tail.run()
                cached = None
                if resp.status == 200 and isinstance(resp.body, bytes):
                    cached = self._learn(idx, plan, resp.body, tail)
                if rec is not None:
                    rec.status, rec.complete, rec.cached_real = resp.status, resp.status < 500, cached
                    resp.headers.update(extra or {})
                return resp
            out = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            if extra:
                out.headers.update(extra)
            out.enable_chunked_encoding()
            end = await self._relay_stream(request, out, first, chunks, None if tail is None else tail.run)
            done = end is not None
            if end is not None:
                cached = self._learn(idx, plan, end, tail)
                if rec is not None:
                    rec.complete, rec.cached_real = True, cached
            if rec is not None and out.prepared:
                rec.status = out.status
            return out
        finally:
            lease.release()
            if done:
                up.release()
            else:
                up.abort()

    async def _relay_buffered(
        self, up: UpstreamResponse, first: bytes, chunks: AsyncIterator[bytes]
    ) -> web.Response:
        parts = [first]
        try:
            async for chunk in chunks:
                parts.append(chunk)
        except UpstreamBrokenError as exc:
            self.state.counters.upstream_errors += 1
            return error_response(ApiError(502, f"backend response broke off: {exc}", etype="upstream_error"))
        body = b"".join(parts)
        if up.status < 400:
            self.state.counters.ok += 1
        elif up.status < 500:
            self.state.counters.client_errors += 1
        else:
            self.state.counters.upstream_errors += 1
        return web.Response(status=up.status, body=body, headers={"Content-Type": up.content_type})

    async def _relay_stream(
        self,
        request: web.Request,
        out: web.StreamResponse,
        first: bytes,
        chunks: AsyncIterator[bytes],
        after_first: Callable[[], None] | None = None,
    ) -> bytes | None:
        """Stream to the client; return the last bytes of the stream when it ended normally, None when
        the upstream broke (an error event was sent) or the client went away. ``after_first`` is
        called once the first bytes were written to the client."""
        counters = self.state.counters
        try:
            await _write(out, request, first, prepare=True)
            if after_first is not None:
                asyncio.get_running_loop().call_soon(after_first)
            tail = first
            try:
                async for chunk in chunks:
                    await _write(out, request, chunk)
                    tail = (tail + chunk)[-_TAIL_BYTES:] if len(chunk) < _TAIL_BYTES else chunk
            except UpstreamBrokenError as exc:
                counters.upstream_errors += 1
                err = ApiError(502, f"backend stream broke off: {exc}", etype="upstream_error")
                await _write(out, request, b"data: " + error_body(err) + b"\n\ndata: [DONE]\n\n")
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await out.write_eof()
                return None
            await out.write_eof()
        except _ClientGone:
            counters.cancelled += 1
            return None
        except asyncio.CancelledError:
            if not (self._aborting and out.prepared):
                counters.cancelled += 1
                raise
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            counters.drained += 1  # ended by the drain mid-stream: an SSE error event
            err = _shutting_down("stream not finished in time")
            with contextlib.suppress(_ClientGone, ConnectionError, RuntimeError):
                await _write(out, request, b"data: " + error_body(err) + b"\n\ndata: [DONE]\n\n")
                await out.write_eof()
            return None
        counters.ok += 1
        return tail

    def _learn(self, idx: int, plan: Plan, end: bytes, tail: _Tail | None) -> int | None:
        """Correct the approximate KV view from the ``cached_tokens`` in the response's ``end``;
        returns them (None when the response did not report them)."""
        cached = extract_cached_tokens(end)
        if cached is not None:
            chain = tail.chain if tail is not None and tail.chain is not None else plan.chain
            self.state.kv.on_usage(idx, chain, cached, plan.cached_blocks.get(idx, 0), self.state.clock())
        return cached


async def _write(out: web.StreamResponse, request: web.Request, data: bytes, prepare: bool = False) -> None:
    try:
        if prepare:
            await out.prepare(request)
        if data:
            await out.write(data)
    except (ConnectionError, RuntimeError) as exc:  # ClientConnectionResetError is a ConnectionError
        raise _ClientGone(str(exc)) from None


_HOP = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding", "upgrade"}
)


def _forward_headers(request: web.Request) -> dict[str, str]:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
    headers["Content-Type"] = _JSON
    return headers
