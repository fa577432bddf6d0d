"""Seeing decisions over real sockets: explanation headers, request ids, /debug/decisions, the
latency and cached-token-error metrics, shadow metrics, the access log, retries as a reason, and
OpenTelemetry spans (in-memory exporter) with the traceparent the backend received."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.observe.exporter import render_metrics
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster, eventually

DEFAULT_POLICY = RouterConfig(backends=()).policy  # what serve/up route with by default

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SYSTEM = "You are a meticulous assistant who answers in full sentences. " * 30


class HeaderEngine:
    """A tiny OpenAI-style backend on a real socket that records each request's headers and answers
    a completion whose usage reports ``cached`` cached tokens (``status``: its HTTP status)."""

    def __init__(self, cached: int = 0, status: int = 200) -> None:
        self.cached = cached
        self.status = status
        self.headers: list[dict[str, str]] = []
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def complete(self, request: web.Request) -> web.Response:
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        body = await request.json()
        if self.status != 200:
            return web.json_response({"error": {"message": "busy"}}, status=self.status)
        usage = {
            "prompt_tokens": 100,
            "completion_tokens": body.get("max_tokens", 1),
            "total_tokens": 101,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        }
        return web.json_response({"id": "x", "object": "text_completion", "choices": [], "usage": usage})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def _router(specs: tuple[BackendSpec, ...], tokenizer: Tokenizer, **kw: Any) -> RouterServer:
    cfg = RouterConfig(backends=specs, port=0, health_interval_s=0.2, **kw)
    router = RouterServer(cfg, tokenizer=tokenizer)
    await router.start()
    await eventually(lambda: all(b.healthy for b in router.state.backends))
    return router


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of the sample ``name{labels...}`` (labels matched as a subset); 0 when absent."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_explanations_decisions_metrics_and_shadows(cluster: Cluster, tokenizer: Tokenizer) -> None:
    for _ in range(2):
        await cluster.add_engine(tokenizer, events=True)
    url = await cluster.start_router(
        tokenizer, admin_token=TOKEN, shadow=("vllm", "round-robin", DEFAULT_POLICY), decisions_kept=8
    )
    router = cluster.router
    assert router is not None
    engines = {s.url for s in cluster.specs}
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me about KV caches."}]
    body = {"model": "emu", "messages": msgs, "max_tokens": 4}
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions", json=body) as r:  # no explanation asked
            assert r.status == 200
            assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
            assert "x-kvroute-backend" not in r.headers
        await eventually(lambda: any(sub.batches for sub in router.subscribers))
        await asyncio.sleep(0.1)  # the first turn's BlockStored events reach the KV view
        msgs2 = [
            *msgs,
            {"role": "assistant", "content": "They hold keys."},
            {"role": "user", "content": "More?"},
        ]
        ask = {"x-kvroute-explain": "1", "x-request-id": "turn-2"}
        async with s.post(url + "/v1/chat/completions", json={**body, "messages": msgs2}, headers=ask) as r:
            assert r.status == 200
            h = r.headers
            assert h["x-request-id"] == "turn-2"
            assert h["x-kvroute-backend"] in engines
            assert h["x-kvroute-policy"] == DEFAULT_POLICY and h["x-kvroute-reason"] == "policy"
            assert float(h["x-kvroute-score"]) >= 0 and h["x-kvroute-retries"] == "0"
            expected = int(h["x-kvroute-cached-tokens"])
            assert expected >= len(SYSTEM) // 8  # the system prompt's blocks were predicted cached
            data = await r.json()
        real = data["usage"]["prompt_tokens_details"]["cached_tokens"]

        # /debug/decisions: admin token only, bounded, newest first
        async with s.get(url + "/debug/decisions") as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        async with s.get(url + "/debug/decisions", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 401
        for bad in ("0", "abc", "9"):
            async with s.get(url + f"/debug/decisions?limit={bad}", headers=AUTH) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "limit"
        async with s.get(url + "/debug/decisions?limit=2", headers=AUTH) as r:
            listed = await r.json()
    assert listed["kept"] == 8 and listed["total"] == 2
    latest, first = listed["data"]
    assert latest["request_id"] == "turn-2" and first["request_id"] != "turn-2"
    assert latest["reason"] == latest["decision_reason"] == "policy" and latest["retries"] == 0
    assert latest["backend"] == latest["winner"] and latest["backend"]["backend"] == h["x-kvroute-backend"]
    assert latest["expected_cached_tokens"] == expected
    assert {c["backend"] for c in latest["candidates"]} == engines
    for c in latest["candidates"]:
        assert c["p_token"] == latest["prompt_tokens"] - c["cached_tokens"] + c["queued_prefill_tokens"]
        assert set(c) == {
            "index",
            "backend",
            "cached_tokens",
            "p_token",
            "queued_prefill_tokens",
            "bs",
            "score",
        }
    out = latest["outcome"]
    assert out["status"] == 200 and out["complete"] and out["cached_tokens"] == real
    assert out["cached_error"] == real - expected
    assert 0 < out["added_ttfb_ms"] <= out["ttft_ms"] <= out["e2e_ms"]
    shadows = {p["policy"]: p for p in latest["shadow"]}
    assert set(shadows) == {"vllm", "round-robin", DEFAULT_POLICY}
    assert shadows[DEFAULT_POLICY]["agree"] and shadows[DEFAULT_POLICY]["score_diff"] == 0

    text = render_metrics(router.registry).decode()
    used = h["x-kvroute-backend"]
    assert _metric(text, "kvroute_request_e2e_seconds_count", backend=used, policy=DEFAULT_POLICY) >= 1
    assert _metric(text, "kvroute_request_routing_seconds_count", policy=DEFAULT_POLICY) >= 1
    assert _metric(text, "kvroute_request_added_ttfb_seconds_count", backend=used) >= 1
    assert _metric(text, "kvroute_request_ttft_seconds_count", backend=used) >= 1
    assert _metric(text, "kvroute_cached_tokens_error_bucket", backend=used, le="+Inf") >= 1
    assert _metric(text, "kvroute_cached_tokens_real_total", backend=used) >= real
    assert _metric(text, "kvroute_shadow_decisions_total", shadow="vllm") == 2
    assert _metric(text, "kvroute_shadow_agreements_total", shadow=DEFAULT_POLICY) == 2
    assert _metric(text, "kvroute_shadow_mean_score_diff", shadow=DEFAULT_POLICY) == 0


async def test_debug_routes_need_a_token_and_explain_flag(tokenizer: Tokenizer, tmp_path: Path) -> None:
    eng = HeaderEngine(cached=0)
    await eng.start()
    log_path = tmp_path / "access.jsonl"
    router = await _router((BackendSpec(eng.url),), tokenizer, explain=True, access_log=str(log_path))
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(router.url + "/debug/decisions") as r:
                assert r.status == 404  # no admin token: the debug routes do not exist
            async with s.post(router.url + "/v1/completions", json={"model": "m", "prompt": "hi"}) as r:
                assert r.status == 200 and r.headers["x-kvroute-backend"] == eng.url
                rid = r.headers["x-request-id"]
            async with s.post(router.url + "/v1/completions", json={"model": "m"}) as r:
                assert r.status == 400 and r.headers["x-request-id"]  # ids on errors too
    finally:
        await router.stop()
        await eng.stop()
    assert eng.headers[0]["x-request-id"] == rid  # the backend got the same id
    (line,) = [orjson.loads(x) for x in log_path.read_text().splitlines()]
    assert line["request_id"] == rid and line["status"] == 200 and line["backend"] == eng.url
    assert line["cached_tokens"] == 0 and line["e2e_ms"] >= line["ttft_ms"] > 0


async def test_wrong_kv_view_shows_as_prediction_error(tokenizer: Tokenizer) -> None:
    """An engine that never reuses its cache while the router's approximate view expects it to: the
    error histogram's sum goes negative on that backend."""
    eng = HeaderEngine(cached=0)
    await eng.start()
    router = await _router((BackendSpec(eng.url),), tokenizer)
    prompt = {"model": "m", "prompt": SYSTEM, "max_tokens": 1}
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(router.url + "/v1/completions", json=prompt) as r:
                    assert r.status == 200
        text = render_metrics(router.registry).decode()
    finally:
        await router.stop()
        await eng.stop()
    # signed buckets: no _sum/_count (Prometheus' rule); the count is the +Inf bucket, the sum is
    # real_total - expected_total
    assert _metric(text, "kvroute_cached_tokens_error_bucket", backend=eng.url, le="+Inf") == 2
    assert _metric(text, "kvroute_cached_tokens_error_bucket", backend=eng.url, le="0.0") == 2
    assert _metric(text, "kvroute_cached_tokens_expected_total", backend=eng.url) > 16
    assert _metric(text, "kvroute_cached_tokens_real_total", backend=eng.url) == 0
    assert _metric(text, "kvroute_cached_tokens_error_bucket", backend=eng.url, le="-16.0") == 1


async def test_retry_is_a_reason(tokenizer: Tokenizer) -> None:
    busy, ok = HeaderEngine(status=503), HeaderEngine(cached=0)
    for e in (busy, ok):
        await e.start()
    router = await _router((BackendSpec(busy.url), BackendSpec(ok.url)), tokenizer, admin_token=TOKEN)
    try:
        async with aiohttp.ClientSession() as s:
            hdr = {"x-kvroute-explain": "yes"}
            async with s.post(
                router.url + "/v1/completions", json={"model": "m", "prompt": "x"}, headers=hdr
            ) as r:
                assert r.status == 200
                assert r.headers["x-kvroute-reason"] == "retry" and r.headers["x-kvroute-backend"] == ok.url
                assert r.headers["x-kvroute-retries"] == "1"
            async with s.get(router.url + "/debug/decisions?limit=1", headers=AUTH) as r:
                (rec,) = (await r.json())["data"]
    finally:
        await router.stop()
        for e in (busy, ok):
            await e.stop()
    assert rec["reason"] == "retry" and rec["decision_reason"] == "policy"
    assert rec["winner"]["backend"] == busy.url and rec["backend"]["backend"] == ok.url
    assert len(busy.headers) == len(ok.headers) == 1


async def test_otel_spans_and_traceparent(tokenizer: Tokenizer) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the otel extra (opentelemetry-sdk) is not installed")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    eng = HeaderEngine(cached=0)
    await eng.start()
    cfg = RouterConfig(backends=(BackendSpec(eng.url),), port=0, health_interval_s=0.2)
    router = RouterServer(cfg, tokenizer=tokenizer, tracer_provider=provider)
    await router.start()
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    client_span = "00f067aa0ba902b7"
    try:
        await eventually(lambda: router.state.backends[0].healthy)
        async with aiohttp.ClientSession() as s:
            hdr = {"traceparent": f"00-{client_trace}-{client_span}-01", "x-request-id": "traced"}
            async with s.post(
                router.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers=hdr
            ) as r:
                assert r.status == 200
    finally:
        await router.stop()
        await eng.stop()
    spans = {s.kind: s for s in exporter.get_finished_spans()}
    server, upstream = spans[SpanKind.SERVER], spans[SpanKind.CLIENT]
    assert f"{server.context.trace_id:032x}" == client_trace
    assert server.parent is not None and f"{server.parent.span_id:016x}" == client_span
    assert upstream.parent is not None and upstream.parent.span_id == server.context.span_id
    attrs = dict(server.attributes or {})
    assert attrs["kvroute.backend"] == eng.url and attrs["kvroute.policy"] == DEFAULT_POLICY
    assert attrs["kvroute.reason"] == "policy" and attrs["kvroute.request_id"] == "traced"
    assert attrs["kvroute.cached_tokens_expected"] == 0 and attrs["kvroute.prompt_tokens"] > 0
    assert attrs["kvroute.cached_tokens"] == 0 and attrs["http.response.status_code"] == 200
    sent = eng.headers[0]["traceparent"]
    assert sent == f"00-{client_trace}-{upstream.context.span_id:016x}-01"
