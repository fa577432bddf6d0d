"""Test doubles for the router: an in-memory transport and a tiny aiohttp engine.

``FakeEngine`` is a *stand-in* for the emulated engine (``kvroute engine``): it speaks just enough of
vLLM's API (completions/chat, SSE streaming with usage, /health, /metrics, /v1/models) and reports
``cached_tokens`` from the prompt prefixes it has seen, so routing can be observed over real sockets.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from kvroute.server.wire.transport import UpstreamBrokenError, UpstreamConnectError, UpstreamResponse

# ---- in-memory transport -------------------------------------------------------------------------


@dataclass
class Scripted:
    """One scripted upstream answer: ``status``, body ``chunks``; ``break_after`` chunks then a
    broken stream (None: no break); ``connect_error``: raise before any response."""

    status: int = 200
    chunks: list[bytes] = field(default_factory=lambda: [b"data: {}\n\n", b"data: [DONE]\n\n"])
    break_after: int | None = None
    connect_error: bool = False
    gate: asyncio.Event | None = None  # the first chunk waits for it
    tells_end: bool = True  # the response says it ended with its last chunk (``ended``)


class FakeResponse:
    def __init__(self, script: Scripted) -> None:
        self.status = script.status
        self.content_type = "text/event-stream" if script.status == 200 else "application/json"
        self.script = script
        self.released = False
        self.aborted = False
        self.ended = False  # set with the last chunk of a stream that does not break

    async def read(self) -> bytes:
        return b"".join([c async for c in self.iter_chunks()])

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        s = self.script
        if s.gate is not None:
            await s.gate.wait()
        for i, chunk in enumerate(s.chunks):
            if s.break_after is not None and i >= s.break_after:
                raise UpstreamBrokenError("scripted break")
            self.ended = s.tells_end and i + 1 == len(s.chunks) and s.break_after is None
            yield chunk
            await asyncio.sleep(0)
        if s.break_after is not None and s.break_after >= len(s.chunks):
            raise UpstreamBrokenError("scripted break")

    def release(self) -> None:
        self.released = True

    def abort(self) -> None:
        if not self.released:
            self.aborted = True


class FakeTransport:
    """Answers from ``scripts[url]`` (a list consumed in order, the last one repeats); records calls."""

    def __init__(self, scripts: Mapping[str, list[Scripted]]) -> None:
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: list[tuple[str, str, str]] = []
        self.responses: list[FakeResponse] = []

    async def send(
        self,
        base_url: str,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        self.calls.append((base_url, method, path))
        queue = self.scripts[base_url]
        script = queue.pop(0) if len(queue) > 1 else queue[0]
        if script.connect_error:
            raise UpstreamConnectError(f"{base_url}: refused")
        resp = FakeResponse(script)
        self.responses.append(resp)
        return resp

    async def close(self) -> None:
        return None


# ---- a tiny engine over real sockets ---------------------------------------------------------------


class FakeEngine:
    """Stand-in for ``kvroute engine``: generates ``max_tokens`` tokens ``tok``, ``delay_s`` apart.

    Prompt caching: a prompt's cached tokens are the longest prefix (in characters, counted as tokens
    of the rendered prompt text, in 16-"token" blocks of characters) shared with an earlier prompt seen
    by *this* engine. ``die_after`` (tokens) closes the connection abruptly mid-stream once.
    """

    def __init__(self, name: str = "fake", delay_s: float = 0.0) -> None:
        self.name = name
        self.delay_s = delay_s
        self.seen: list[str] = []
        self.active = 0
        self.cancelled = 0
        self.die_after: int | None = None
        self.requests = 0
        self.metrics_queries: list[str] = []  # query strings of the /metrics requests, in order
        self._runner: web.AppRunner | None = None
        self.url = ""
        self.on_request: Callable[[dict[str, object]], None] | None = None

    def _cached(self, text: str) -> int:
        best = 0
        for old in self.seen:
            n = 0
            for a, b in zip(old, text, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        self.seen.append(text)
        return best // 16 * 16

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner = runner
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def metrics(self, request: web.Request) -> web.Response:
        self.metrics_queries.append(request.query_string)  # the filter is ignored: the whole page
        text = (
            f'vllm:num_requests_running{{model_name="{self.name}"}} {self.active}\n'
            f'vllm:num_requests_waiting{{model_name="{self.name}"}} 0\n'
            f'vllm:kv_cache_usage_perc{{model_name="{self.name}"}} 0.0\n'
        )
        return web.Response(text=text)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if self.on_request is not None:
            self.on_request(body)
        chat = "messages" in body
        text = orjson.dumps(body["messages"]).decode() if chat else str(body["prompt"])
        cached = self._cached(text)
        n = int(body.get("max_tokens") or 4)
        usage = {
            "prompt_tokens": len(text),
            "completion_tokens": n,
            "total_tokens": len(text) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            await asyncio.sleep(self.delay_s * n)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update(
                {"message": {"role": "assistant", "content": "x" * n}} if chat else {"text": "x" * n}
            )
            return web.json_response(
                {"id": "1", "object": obj, "model": self.name, "choices": [choice], "usage": usage}
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.active += 1
        try:
            for i in range(n):
                await asyncio.sleep(self.delay_s)
                if self.die_after is not None and i >= self.die_after:
                    self.die_after = None
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                delta = {"delta": {"content": "x"}} if chat else {"text": "x"}
                chunk = {
                    "id": "1",
                    "object": obj + ".chunk",
                    "model": self.name,
                    "choices": [{"index": 0, **delta}],
                }
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                last = {
                    "id": "1",
                    "object": obj + ".chunk",
                    "model": self.name,
                    "choices": [],
                    "usage": usage,
                }
                await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
        return resp
