"""A misbehaving OpenAI-compatible upstream: a real asyncio HTTP/1.1 server on a TCP port.

It serves what a router needs of an engine (``GET /health``, ``GET /v1/models``, ``GET /metrics``
in vLLM's Prometheus names, ``POST /v1/completions`` and ``/v1/chat/completions``, plain and
streamed) and answers every request with the request's own id (``cmpl-<X-Request-Id>``).

A request picks how the answer misbehaves with a marker anywhere in its body,
``conformance-fault=<name>`` (one of :data:`kvroute.conformance.faults.FAULTS`), so it passes through
any front door untouched. Like uvicorn (and so vLLM), it answers ``Expect: 100-continue`` with an
interim ``100 Continue`` before the final response.

Every request it receives is kept (:class:`Received`: the path and the header lines as they came;
:meth:`MisbehavingUpstream.received_for` finds them by request id),
so a suite can check what a front door forwarded. Requests on one connection are answered in order.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
from dataclasses import dataclass

import httptools
import orjson

from kvroute.conformance.faults import CLOSE, FAULTS, Answer, Step

__all__ = ["MisbehavingUpstream", "Received"]

_MARKER = re.compile(rb"conformance-fault=([a-z0-9-]+)")
_STREAM = re.compile(rb'"stream"\s*:\s*true')


@dataclass(frozen=True, slots=True)
class Received:
    """One request as the upstream received it: ``headers`` as (name, value) pairs decoded as
    latin-1, in order, names as sent; ``fault``: the marker's fault ('' when none)."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    fault: str

    def values(self, name: str) -> list[str]:
        """Every value of header ``name`` (case-insensitive)."""
        low = name.lower()
        return [v for k, v in self.headers if k.lower() == low]

    @property
    def request_id(self) -> str:
        """The last ``X-Request-Id`` received ('' when none)."""
        ids = self.values("x-request-id")
        return ids[-1] if ids else ""


@dataclass(frozen=True, slots=True)
class _Request:
    received: Received
    body: bytes


class _Conn(asyncio.Protocol):
    """One server connection: parses requests and answers them one at a time, in order."""

    def __init__(self, server: MisbehavingUpstream) -> None:
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.queue: asyncio.Queue[_Request | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self._headers: list[tuple[str, str]] = []
        self._body: list[bytes] = []
        self._url = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.task = asyncio.get_running_loop().create_task(self._serve())
        self.server.conns.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.queue.put_nowait(None)
        self.server.conns.discard(self)

    def on_message_begin(self) -> None:
        self._headers, self._body, self._url = [], [], b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        m = _MARKER.search(body)
        method = self.parser.get_method().decode("latin-1")
        rec = Received(
            method, self._url.decode("latin-1"), tuple(self._headers), m.group(1).decode() if m else ""
        )
        self.server.keep(rec)
        self.queue.put_nowait(_Request(rec, body))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _serve(self) -> None:
        while True:
            req = await self.queue.get()
            if req is None or self.transport is None or self.transport.is_closing():
                return
            for step in self.server.plan(req):
                if step is CLOSE:
                    self.close()
                    return
                if isinstance(step, float):
                    await asyncio.sleep(step)
                elif isinstance(step, bytes) and not self.transport.is_closing():
                    self.transport.write(step)


class MisbehavingUpstream:
    """The server (module docstring). ``model``: the one model it serves; ``kept``: how many
    received requests :attr:`received` keeps (oldest dropped first)."""

    def __init__(self, model: str = "faulty", kept: int = 100_000) -> None:
        self.model = model
        self.received: collections.deque[Received] = collections.deque(maxlen=kept)
        self._by_id: dict[str, list[Received]] = {}  # X-Request-Id value -> its requests
        self._kept = kept
        self.conns: set[_Conn] = set()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Conn(self), host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for conn in list(self.conns):
                conn.close()
                if conn.task is not None:
                    conn.task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await conn.task
            await self._server.wait_closed()
            self._server = None

    def keep(self, rec: Received) -> None:
        """Keep ``rec`` (the oldest ones go beyond ``kept``)."""
        self.received.append(rec)
        for rid in set(rec.values("x-request-id")):
            self._by_id.setdefault(rid, []).append(rec)
        while len(self._by_id) > self._kept:
            del self._by_id[next(iter(self._by_id))]

    def received_for(self, rid: str) -> list[Received]:
        """The requests received with ``rid`` among their ``X-Request-Id`` values (safe to call
        from another thread than the server's)."""
        return list(self._by_id.get(rid, ()))

    def plan(self, req: _Request) -> tuple[Step, ...]:
        """The steps that answer ``req``."""
        rec = req.received
        path = rec.path.split("?", 1)[0]
        continue_ = (
            b"HTTP/1.1 100 Continue\r\n\r\n"
            if any(v.lower() == "100-continue" for v in rec.values("expect"))
            else b""
        )
        if rec.method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            answer = Answer(
                rec.request_id, path.endswith("chat/completions"), bool(_STREAM.search(req.body)), self.model
            )
            fault = FAULTS.get(rec.fault, FAULTS["none"])
            steps = fault.plan(answer)
            if continue_ and steps and isinstance(steps[0], bytes):
                return (continue_ + steps[0], *steps[1:])
            return steps
        if rec.method == "GET" and path == "/health":
            return (continue_ + _simple(200, b"{}"),)
        if rec.method == "GET" and path == "/v1/models":
            card = {
                "id": self.model,
                "object": "model",
                "owned_by": "kvroute-conformance",
                "max_model_len": 32768,
            }
            return (continue_ + _simple(200, orjson.dumps({"object": "list", "data": [card]})),)
        if rec.method == "GET" and path == "/metrics":
            return (continue_ + _simple(200, self._metrics(), b"text/plain; version=0.0.4"),)
        return (continue_ + _simple(404, b'{"error": {"message": "not found", "type": "not_found"}}'),)

    def _metrics(self) -> bytes:
        busy = sum(1 for c in self.conns if not c.queue.empty())
        labels = f'{{model_name="{self.model}"}}'
        return (
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {busy}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} 0\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} 0.0\n"
        ).encode()


def _simple(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    reason = {200: b"OK", 404: b"Not Found"}[status]
    return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        reason,
        ctype,
        len(body),
        body,
    )
