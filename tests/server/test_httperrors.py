"""Every answer of the router's own making is an OpenAI-style JSON error, over real sockets: aiohttp's
405/404/413, malformed HTTP (answered by the parser before any handler), a handler's bug (500), and
deep nesting; each logs one line at most (rate-limited), never a traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import orjson
import pytest

from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.wire.httperrors import RateLimitedLog
from kvroute.tokenizer import Tokenizer

from .fakes import FakeEngine

TOKEN = "s3cret"


@pytest.fixture
async def router(tokenizer: Tokenizer) -> AsyncIterator[tuple[RouterServer, int]]:
    engine = FakeEngine()
    url = await engine.start()
    cfg = RouterConfig(backends=(BackendSpec(url),), port=0, admin_token=TOKEN, max_body_bytes=4096)
    server = RouterServer(cfg, tokenizer=tokenizer)
    await server.start()
    port = int(server.url.rsplit(":", 1)[1])
    try:
        yield server, port
    finally:
        await server.stop()
        await engine.stop()


async def raw(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` as is on a fresh connection; the status, headers and body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(reader.readexactly(n), 5)
    finally:
        writer.close()
    return status, headers, body


def assert_json_error(status: int, headers: dict[str, str], body: bytes, want: int) -> dict[str, object]:
    assert status == want, (status, body)
    assert headers["content-type"].startswith("application/json"), headers
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return err  # type: ignore[no-any-return]


def request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE", "PATCH"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_wrong_method_on_post_routes_is_json_405(
    router: tuple[RouterServer, int], method: str, path: str
) -> None:
    _, port = router
    status, headers, body = await raw(port, request(method, path))
    err = assert_json_error(status, headers, body, 405)
    assert "POST" in headers["allow"] and method in str(err["message"])


async def test_unknown_path_and_admin_errors_are_json(router: tuple[RouterServer, int]) -> None:
    _, port = router
    assert_json_error(*await raw(port, request("GET", "/nope")), 404)
    assert_json_error(*await raw(port, request("POST", "/v1/models")), 405)
    auth = f"Authorization: Bearer {TOKEN}\r\n"
    assert_json_error(*await raw(port, request("GET", "/admin/backends/nope", extra=auth)), 404)
    assert_json_error(*await raw(port, request("PUT", "/admin/backends", extra=auth)), 405)
    big = b'{"url": "' + b"x" * 8000 + b'"}'
    assert_json_error(*await raw(port, request("POST", "/admin/backends", big, extra=auth)), 413)
    assert_json_error(*await raw(port, request("POST", "/v1/completions", big)), 413)


@pytest.mark.parametrize(
    "data",
    [
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x01b\r\n\r\n",  # a control character in a header
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",  # over 8190 bytes
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n{}",  # body after close
        b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 TLS hello\r\n\r\n",
    ],
    ids=["ctl-char", "long-header", "after-close", "neg-length", "bad-chunk", "tls"],
)
async def test_malformed_http_is_json_400_and_one_line(
    router: tuple[RouterServer, int], data: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    _, port = router
    caplog.set_level(logging.DEBUG)
    status, headers, body = await raw(port, data)
    assert 400 <= status < 500
    assert_json_error(status, headers, body, status)
    for rec in caplog.records:
        assert rec.exc_info is None, rec.getMessage()
        assert "Error handling request" not in rec.getMessage()


async def test_a_flood_of_bad_requests_logs_a_line_per_second(
    router: tuple[RouterServer, int], caplog: pytest.LogCaptureFixture
) -> None:
    _, port = router
    caplog.set_level(logging.DEBUG)
    for _ in range(30):
        status, _, _ = await raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Bad: a\x7fb\r\n\r\n")
        assert status == 400
    lines = [r for r in caplog.records if "bad HTTP request" in r.getMessage()]
    assert 1 <= len(lines) <= 3  # 30 requests in well under 3 s


async def test_a_handler_bug_is_json_500_logged_once_with_its_traceback(
    router: tuple[RouterServer, int], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, port = router

    async def broken(*args: object) -> object:
        raise KeyError("bug")

    monkeypatch.setattr(server.proxy, "handle", broken)
    caplog.set_level(logging.DEBUG)
    for _ in range(5):
        status, headers, body = await raw(port, request("POST", "/v1/completions", b'{"prompt": "x"}'))
        err = assert_json_error(status, headers, body, 500)
        assert "bug" not in str(err["message"])  # no internals to the client
    with_tb = [r for r in caplog.records if r.exc_info is not None]
    assert len(with_tb) == 1


@pytest.mark.parametrize("field", ["prompt", "messages"])
async def test_deep_nesting_is_a_json_400(router: tuple[RouterServer, int], field: str) -> None:
    _, port = router
    deep = b"[" * 990 + b"]" * 990
    if field == "prompt":
        body = b'{"prompt": ' + deep + b"}"
    else:
        body = b'{"messages": [{"role": "user", "content": ' + deep + b"}]}"
    path = "/v1/completions" if field == "prompt" else "/v1/chat/completions"
    err = assert_json_error(*await raw(port, request("POST", path, body)), 400)
    assert "nest" in str(err["message"])
    too_deep = b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}"  # beyond orjson's own limit
    assert_json_error(*await raw(port, request("POST", "/v1/completions", too_deep)), 400)


def test_rate_limited_log_counts_what_it_suppressed(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limiter = RateLimitedLog(logging.getLogger("test.rl"), 1.0, lambda: now[0])
    caplog.set_level(logging.INFO)
    assert limiter.emit("a", "first")
    assert not limiter.emit("a", "second")
    assert not limiter.emit("a", "third")
    assert limiter.emit("b", "other kind")
    now[0] = 1.5
    assert limiter.emit("a", "later")
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs == ["first", "other kind", "later (2 more suppressed in the last 1 s)"]
    assert limiter.suppressed_total == 2


async def test_a_connection_error_out_of_a_handler_is_a_debug_line_not_a_traceback(
    router: tuple[RouterServer, int], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that meets a broken client connection (ConnectionResetError) logs no traceback."""
    server, port = router

    async def gone(*args: object) -> object:
        raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(server.proxy, "handle", gone)
    caplog.set_level(logging.DEBUG)
    status, headers, body = await raw(port, request("POST", "/v1/completions", b'{"prompt": "x"}'))
    assert_json_error(status, headers, body, 500)
    assert not [r for r in caplog.records if r.exc_info is not None]
    assert [r for r in caplog.records if "went away" in r.getMessage() and r.levelno == logging.DEBUG]
