"""The emulated engine echoes ``X-Request-Id`` on every response, as vLLM does with
``--enable-request-id-headers``: a router tells a stray response from its answer by it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import aiohttp

from .conftest import MODEL


async def test_every_response_echoes_the_request_id(start_server: Callable[..., Any]) -> None:
    server = await start_server()
    base = f"http://127.0.0.1:{server.port}"
    calls = [
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, 200),
        ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}, 200),
        ("POST", "/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400),
        ("GET", "/v1/models", None, 200),
        ("GET", "/no-such-path", None, 404),
    ]
    async with aiohttp.ClientSession() as s:
        for i, (method, path, body, status) in enumerate(calls):
            rid = f"echo-{i}"
            async with s.request(method, base + path, json=body, headers={"X-Request-Id": rid}) as r:
                await r.read()
                assert r.status == status, path
                assert r.headers.getall("X-Request-Id") == [rid], path
        async with s.get(base + "/v1/models") as r:  # none sent: a random one, as vLLM's
            assert re.fullmatch("[0-9a-f]{32}", r.headers["X-Request-Id"])
