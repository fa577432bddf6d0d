"""The picker's gRPC services: Envoy's ``ExternalProcessor`` and ``grpc.health.v1.Health``.

One ext_proc stream is one HTTP request (FULL_DUPLEX_STREAMED bodies, request and response):

- request headers: kept; a request that is not inference is routed at once (:meth:`Picker.plain`);
- request body chunks: collected until the last (or the request trailers); then the exchange routes
  it and the picker answers the headers (destination header and ``envoy.lb`` metadata) and hands the
  body back, or answers with an immediate response (the router's JSON error). A body past
  ``max_body_bytes`` is answered 413 at once;
- response headers: the served endpoint and status go to the exchange; its headers are added;
- response body chunks: handed back unchanged, each told to the exchange;
- the stream's end, however it comes (the response's end, Envoy's reset when the client went away,
  an error): the exchange is closed.

While the process shuts down (:attr:`ExtProc.refusing`), a new request is answered 503.

Health (the protocol's services, :class:`Health`): ``liveness`` is SERVING while the process
answers; ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and the overall ``""`` are
SERVING while a backend is routable and the picker is not shutting down, checked every
``HEALTH_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from multidict import CIMultiDict

from kvroute.server.extproc import messages as m
from kvroute.server.extproc.exchange import MAX_HEADERS, Exchange, Immediate, Picker, Route
from kvroute.server.wire.http import error_response
from kvroute.server.wire.relay import shutting_down
from kvroute.server.wire.validate import ApiError, body_too_large

__all__ = ["HEALTH_EVERY_S", "READY_SERVICES", "ExtProc", "Health"]

HEALTH_EVERY_S = 1.0
"""Seconds between readiness checks."""

READY_SERVICES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def _answer(
    result: Route | Immediate, metadata_only: bool, drop: list[str] | None = None
) -> list[pb.ProcessingResponse]:
    if isinstance(result, Immediate):
        return [m.immediate(result.status, result.body, result.headers)]
    return [m.route_headers(result.endpoints, result.headers, metadata_only, drop)]


class _Stream:
    """One ext_proc stream's state (module docstring)."""

    def __init__(self, service: ExtProc) -> None:
        self.service = service
        self.exchange: Exchange | None = None
        self.subset: list[str] | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.routed = False
        self.done = False  # answered with an immediate response
        self.drop: list[str] = []  # hop-by-hop headers to remove from the upstream request

    async def on(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        kind = req.WhichOneof("request")
        if self.done:
            return []
        if kind == "request_headers":
            return self._headers(req)
        if kind == "request_body":
            return await self._body(req.request_body.body, req.request_body.end_of_stream)
        if kind == "request_trailers":
            out = [] if self.routed else await self._route()
            return [*out, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            pairs = m.headers_of(req.response_headers)
            status = m.status_of(pairs)
            if status < 200:  # an interim answer (or a switch) as the final one: never relayed
                return self._interim(status, m.served_endpoint(req))
            add = {}
            if self.exchange is not None:
                add = self.exchange.served(status, m.served_endpoint(req))
                if req.response_headers.end_of_stream:
                    self.exchange.body(b"", True)
            return [m.continue_headers(True, add)]
        if kind == "response_body":
            chunk, end = req.response_body.body, req.response_body.end_of_stream
            if self.exchange is not None:
                self.exchange.body(chunk, end)
            return [m.streamed_body(chunk, end, True)]
        if kind == "response_trailers":
            if self.exchange is not None:
                self.exchange.body(b"", True)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _headers(self, req: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        service = self.service
        if service.refusing:
            self.done = True
            picker = service.picker
            picker.state.counters.unavailable += 1
            retry = picker.state.config.retry_after_s
            return _answer(
                Immediate.of(error_response(shutting_down("not accepting requests"), retry)), False
            )
        pairs = m.first_request_id(m.headers_of(req.request_headers))
        self.drop = m.hop_by_hop(pairs)
        headers = CIMultiDict(pairs)
        self.subset = m.subset_hint(req)
        method = headers.get(":method", "GET")
        path = headers.get(":path", "/")
        if sum(not k.startswith(":") for k, _ in pairs) > MAX_HEADERS:
            err = ApiError(
                431, f"more than {MAX_HEADERS} request headers", code="request_header_fields_too_large"
            )
            return self._finish(Immediate.of(error_response(err)))
        if method == "POST":
            self.exchange = service.picker.exchange(path, headers)
        if self.exchange is None:  # not inference: routed now, the body passes through
            self.routed = True
            return self._finish(service.picker.plain(path, headers))
        if req.request_headers.end_of_stream:  # an inference request with no body
            return self._finish(self.exchange.refuse(ApiError(400, "the request has no body")))
        return []

    async def _body(self, chunk: bytes, end: bool) -> list[pb.ProcessingResponse]:
        if self.routed:
            return [m.streamed_body(chunk, end, False)]
        self.parts.append(chunk)
        self.size += len(chunk)
        limit = self.service.picker.state.config.max_body_bytes
        if self.size > limit:
            assert self.exchange is not None
            return self._finish(self.exchange.refuse(body_too_large(limit)))
        if not end:
            return []
        return await self._route()

    async def _route(self) -> list[pb.ProcessingResponse]:
        self.routed = True
        assert self.exchange is not None
        body = b"".join(self.parts)
        self.parts.clear()
        result = await self.exchange.route(body, self.subset)
        out = self._finish(result)
        if not self.done:
            out.extend(m.body_pieces(body))
        return out

    def _finish(self, result: Route | Immediate) -> list[pb.ProcessingResponse]:
        self.done = isinstance(result, Immediate)
        return _answer(result, self.service.metadata_only, self.drop)

    def _interim(self, status: int, served: str | None) -> list[pb.ProcessingResponse]:
        """The upstream's final answer was a 1xx: the client gets a 502 JSON error instead."""
        self.done = True
        if self.exchange is not None:
            self.exchange.served(502, served)
            self.exchange.body(b"", True)
        err = ApiError(502, f"the backend answered {status} instead of a response", etype="upstream_error")
        return _answer(Immediate.of(error_response(err)), False)

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()


class ExtProc(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service over ``picker``; ``metadata_only``: the destination goes only into the
    ``envoy.lb`` metadata (the header is removed), for an Envoy that routes by the metadata alone."""

    def __init__(self, picker: Picker, metadata_only: bool = False) -> None:
        self.picker = picker
        self.metadata_only = metadata_only
        self.refusing = False

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream(self)
        try:
            async for req in request_iterator:
                for out in await stream.on(req):
                    yield out
        finally:
            stream.close()


class Health:
    """The gRPC health services (module docstring); ``ready()`` says whether the picker can route."""

    def __init__(self, ready: Callable[[], bool]) -> None:
        self.ready = ready
        self.servicer = health_aio.HealthServicer()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self._check()
        self._task = asyncio.create_task(self._loop())

    async def _check(self) -> None:
        status = health_pb2.HealthCheckResponse
        now = status.SERVING if self.ready() else status.NOT_SERVING
        for name in READY_SERVICES:
            await self.servicer.set(name, now)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_EVERY_S)
            await self._check()

    async def stop(self) -> None:
        """Every service NOT_SERVING, the checks stopped."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.servicer.enter_graceful_shutdown()
