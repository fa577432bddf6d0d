"""A request body with a ``Content-Encoding``, end to end over real sockets: aiohttp's server decodes
gzip and deflate bodies before the router reads them, so a body that does not decode is the client's
400 (JSON, one log line, never a traceback, nothing sent upstream), and a body that does is forwarded
decoded, without the ``Content-Encoding`` that no longer describes it."""

from __future__ import annotations

import gzip
import logging
import zlib

import orjson
import pytest

from kvroute.tokenizer import Tokenizer

from .test_wire_e2e import final_answer, port_of, raw_exchange, recording_upstream, start_router

BODY = orjson.dumps({"model": "emu", "prompt": "hello", "max_tokens": 4})


def encoded_post(body: bytes, encoding: str) -> bytes:
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Encoding: {encoding}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


def posts(up: object) -> list:  # type: ignore[type-arg]
    return [r for r in up.requests if r.head.startswith(b"POST")]  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_is_a_json_400_without_a_traceback(
    tokenizer: Tokenizer, encoding: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            raw = await raw_exchange(port_of(router), encoded_post(BODY, encoding))
            status, _, data = final_answer(raw)
            assert status == 400, raw
            err = orjson.loads(data)["error"]
            assert err["type"] == "invalid_request_error" and encoding in err["message"], err
            assert posts(up) == []
            assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
            assert router.proxy.inflight == 0 and len(router.proxy.ids) == 0
            backend = router.state.backends[0]
            assert (backend.waiting, backend.running, backend.healthy) == (0, 0, True)
        finally:
            await router.stop()


@pytest.mark.parametrize(("encoding", "encode"), [("gzip", gzip.compress), ("deflate", zlib.compress)])
async def test_a_decoded_body_goes_upstream_without_its_content_encoding(
    tokenizer: Tokenizer, encoding: str, encode: object
) -> None:
    async with recording_upstream() as up:
        router = await start_router(tokenizer, up.url)
        try:
            raw = await raw_exchange(port_of(router), encoded_post(encode(BODY), encoding))  # type: ignore[operator]
            assert final_answer(raw)[0] == 200, raw
            (sent,) = posts(up)
            assert sent.body == BODY  # what the router read and validated
            assert sent.values("content-encoding") == []
        finally:
            await router.stop()
