"""Backends that come and go over real sockets: the admin API (auth, add, drain, delete) and discovery
(DNS, a watched file) in front of real emulated engines on free loopback ports.

Emulated engines run at ``time_scale=0.1`` where a test needs a slow stream: about 50 ms of wall time
per decoded token."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvroute.commands.settings import backends_from_text
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig
from kvroute.server.observe.exporter import render_metrics
from kvroute.server.state.backends import REMOVED
from kvroute.server.state.loadtable import url_digest
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster, eventually

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SLOW = 0.1
SHORT = {"model": "emu", "prompt": "hello there", "max_tokens": 2}


@pytest.fixture
async def cluster() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def call(
    method: str, url: str, body: object = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, url, json=body, headers=headers if headers is not None else AUTH) as r,
    ):
        raw = await r.read()
        return r.status, orjson.loads(raw) if r.content_type == "application/json" else raw


def engine_requests(eng: Any) -> int:
    """Prompt tokens the emulated engine was asked about: grows with each request it serves."""
    return int(eng.model.stats().prefix_query_tokens)


async def test_admin_api_is_off_without_a_token(cluster: Cluster, tokenizer: Tokenizer) -> None:
    await cluster.add_engine(tokenizer, events=False)
    url = await cluster.start_router(tokenizer)
    assert (await call("GET", url + "/admin/backends"))[0] == 404
    assert (await call("POST", url + "/admin/backends", {"url": "http://127.0.0.1:1"}))[0] == 404


async def test_admin_needs_the_bearer_token_and_leaks_nothing(cluster: Cluster, tokenizer: Tokenizer) -> None:
    await cluster.add_engine(tokenizer, events=False)
    url = await cluster.start_router(tokenizer, admin_token=TOKEN)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        for method, path in (("GET", "/admin/backends"), ("DELETE", "/admin/backends/x")):
            status, body = await call(method, url + path, headers=headers)
            assert status == 401
            assert body == {
                "error": {"message": "unauthorized", "type": "unauthorized", "param": None, "code": 401}
            }
    status, body = await call("GET", url + "/admin/backends")
    assert status == 200
    [b] = body["data"]
    assert b["id"] == url_digest(cluster.specs[0].url) and b["url"] == cluster.specs[0].url
    assert b["state"] == "active" and b["healthy"] and b["kv_mode"] == "approx"


async def test_admin_add_takes_traffic_and_delete_drains_then_removes(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    first = await cluster.add_engine(tokenizer, events=False, time_scale=SLOW)
    url = await cluster.start_router(tokenizer, admin_token=TOKEN, policy="round-robin")
    router = cluster.router
    assert router is not None
    second = await cluster.add_engine(tokenizer, events=True, time_scale=SLOW)
    spec = cluster.specs[1]
    admin = url + "/admin/backends"

    # add: 400 for a bad body, 201, then 409 for the same URL again
    status, err = await call("POST", admin, {"url": spec.url + "/v1"})
    assert status == 400 and err["error"]["param"] == "url"
    status, added = await call("POST", admin, {"url": spec.url, "kv_events": spec.kv_events})
    assert status == 201 and added["state"] == "active" and added["kv_mode"] == "exact"
    assert (await call("POST", admin, {"url": spec.url}))[0] == 409
    bid = added["id"]
    assert await eventually(lambda: router.state.backends[1].routable)  # admitted by a health check
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(url + "/v1/completions", json=SHORT) as r:
                assert r.status == 200
    assert engine_requests(second) > 0 and router.state.backends[1].requests_total >= 2

    # a slow stream on the new backend (the first one drained meanwhile), then DELETE it
    first_id = url_digest(cluster.specs[0].url)
    status, held = await call("POST", f"{admin}/{first_id}/drain")
    assert status == 202 and held["state"] == "draining" and not held["removing"]
    async with aiohttp.ClientSession() as s:
        body = {**SHORT, "max_tokens": 30, "stream": True}
        async with s.post(url + "/v1/completions", json=body) as stream:
            assert (await stream.content.readline()).startswith(b"data: ")
            status, gone = await call("DELETE", f"{admin}/{bid}")
            assert status == 202 and gone["state"] == "draining" and gone["removing"]
            assert gone["waiting"] + gone["running"] == 1
            assert (await call("POST", f"{admin}/{first_id}/undrain"))[0] == 202
            before = router.state.backends[1].requests_total
            first_before = engine_requests(first)
            async with s.post(url + "/v1/completions", json=SHORT) as r:
                assert r.status == 200
            assert router.state.backends[1].requests_total == before  # no new request on it
            assert engine_requests(first) > first_before
            assert (await call("GET", f"{admin}/{bid}"))[1]["state"] == "draining"
            rest = await stream.content.read()
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
    b = router.state.backends[1]
    assert await eventually(lambda: b.state == REMOVED)
    assert b.waiting == b.running == b.queued_prefill == b.blocks == 0
    status, listed = await call("GET", admin)
    assert [x["url"] for x in listed["data"]] == [cluster.specs[0].url]
    assert (await call("GET", f"{admin}/{bid}"))[1]["state"] == "removed"
    assert spec.url not in render_metrics(router.registry).decode()
    assert not router.subscribers  # its KV event subscriber stopped
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/completions", json=SHORT) as r:
                assert r.status == 200
    assert b.requests_total == before


async def test_dns_discovery_adds_the_backends_a_name_resolves_to(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    """``localhost`` with the engine's port; then an injected resolver that answers two addresses
    with different ports (two engines), then one."""
    eng = await cluster.add_engine(tokenizer, events=False)
    port = int(cluster.specs[0].url.rsplit(":", 1)[1])
    cfg = RouterConfig(
        backends=(),
        port=0,
        health_interval_s=0.2,
        discover=(f"dns://localhost:{port}",),
        discover_interval_s=0.2,
    )
    cluster.router = RouterServer(cfg, tokenizer=tokenizer)
    url = await cluster.router.start()
    core = cluster.router.state
    want = f"http://127.0.0.1:{port}"
    assert await eventually(lambda: any(b.url == want and b.routable for b in core.backends))
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=SHORT) as r:
        assert r.status == 200
    assert engine_requests(eng) > 0


async def test_dns_discovery_follows_the_answers(cluster: Cluster, tokenizer: Tokenizer) -> None:
    await cluster.add_engine(tokenizer, events=False)
    await cluster.add_engine(tokenizer, events=False)
    ports = [int(s.url.rsplit(":", 1)[1]) for s in cluster.specs]
    answers = [("127.0.0.1", p) for p in ports]

    async def resolve(name: str, port: int) -> list[tuple[str, int]]:
        assert name == "engines.default.svc"
        return list(answers)

    cfg = RouterConfig(
        backends=(),
        port=0,
        health_interval_s=0.2,
        discover=("dns://engines.default.svc:8000",),
        discover_interval_s=0.1,
    )
    cluster.router = RouterServer(cfg, tokenizer=tokenizer, resolve=resolve)
    await cluster.router.start()
    core = cluster.router.state
    urls = [s.url for s in cluster.specs]
    assert await eventually(lambda: [b.url for b in core.backends if b.routable] == urls)
    answers.pop()
    assert await eventually(lambda: [b.url for b in core.live_backends()] == urls[:1])
    assert core.backends[1].state == REMOVED


async def test_file_discovery_follows_the_file(
    cluster: Cluster, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    a = await cluster.add_engine(tokenizer, events=False)
    b = await cluster.add_engine(tokenizer, events=False)
    path = tmp_path / "backends.yaml"
    path.write_text(f"- {cluster.specs[0].url}\n")
    cfg = RouterConfig(
        backends=(), port=0, health_interval_s=0.2, discover=(f"file://{path}",), discover_interval_s=0.1
    )
    cluster.router = RouterServer(cfg, tokenizer=tokenizer, parse_backends=backends_from_text)
    url = await cluster.router.start()
    core = cluster.router.state
    assert await eventually(lambda: [x.url for x in core.backends if x.routable] == [cluster.specs[0].url])
    path.write_text(f"backends:\n  - url: {cluster.specs[1].url}\n")
    os.utime(path, ns=(1, 10**18))  # a new mtime even on a coarse-grained file system
    assert await eventually(lambda: [x.url for x in core.backends if x.routable] == [cluster.specs[1].url])
    assert core.backends[0].state == REMOVED
    before = engine_requests(a)
    async with aiohttp.ClientSession() as s:
        for _ in range(2):
            async with s.post(url + "/v1/completions", json=SHORT) as r:
                assert r.status == 200
    assert engine_requests(a) == before and engine_requests(b) > 0
