"""Bad input → vLLM-shaped errors; /metrics parsed with prometheus-client; disconnects free blocks."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import pytest
from orjson import dumps as orjson_dumps
from prometheus_client.parser import text_string_to_metric_families

from kvroute.emulator.server import EmulatorServer

from .conftest import MODEL

MSG = [{"role": "user", "content": "hi"}]

BAD_CHAT: list[tuple[Any, int, str | None]] = [
    ({"model": MODEL}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "no role"}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({"messages": MSG, "n": 2}, 400, "n"),
    ({"messages": MSG, "n": "1"}, 400, "n"),
    ({"messages": MSG, "max_tokens": "10"}, 400, "max_tokens"),
    ({"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": MSG, "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ({"messages": MSG, "stream": "yes"}, 400, "stream"),
    ({"messages": MSG, "temperature": "hot"}, 400, "temperature"),
    ({"messages": MSG, "temperature": -1}, 400, "temperature"),
    ({"messages": MSG, "ignore_eos": 1}, 400, "ignore_eos"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"messages": MSG, "model": 7}, 400, "model"),
    ({"messages": MSG, "model": "gpt-4"}, 404, "model"),
    ([1, 2, 3], 400, None),
]

BAD_COMPLETION: list[tuple[Any, int, str | None]] = [
    ({"model": MODEL}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, "a"]}, 400, "prompt"),
    ({"prompt": [10**9]}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": "x", "n": 3}, 400, "n"),
    ({"prompt": "x", "echo": True}, 400, "echo"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
]


def check_error(body: dict[str, Any], status: int, param: str | None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param
    assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert isinstance(err["message"], str) and err["message"]


async def post(server: EmulatorServer, path: str, body: Any = None, raw: bytes | None = None):
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{server.port}{path}"
        kw: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with s.post(url, **kw) as r:
            return r.status, await r.json(content_type=None)


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT)
async def test_bad_chat(server: EmulatorServer, body, status, param):
    got, data = await post(server, "/v1/chat/completions", body)
    assert got == status
    check_error(data, status, param)


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETION)
async def test_bad_completion(server: EmulatorServer, body, status, param):
    got, data = await post(server, "/v1/completions", body)
    assert got == status
    check_error(data, status, param)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
async def test_invalid_json(server: EmulatorServer, path):
    got, data = await post(server, path, raw=b"{not json")
    assert got == 400
    check_error(data, 400, None)
    assert "Invalid JSON" in data["error"]["message"]


async def test_bad_tokenize_and_detokenize(server: EmulatorServer):
    got, data = await post(server, "/tokenize", {"prompt": 3})
    assert got == 400
    check_error(data, 400, "prompt")
    got, data = await post(server, "/detokenize", {"tokens": [1, "x"]})
    assert got == 400
    check_error(data, 400, "tokens")
    got, data = await post(server, "/detokenize", {"tokens": [10**9]})
    assert got == 400
    check_error(data, 400, "tokens")


async def test_context_length_errors_as_vllm_words_them(server: EmulatorServer):
    got, data = await post(server, "/v1/completions", {"prompt": [1] * 4000, "max_tokens": 200})
    assert got == 400
    assert data["error"]["message"] == (
        "This model's maximum context length is 4096 tokens. However, you requested 4200 tokens "
        "(4000 in the messages, 200 in the completion). Please reduce the length of the messages or completion."
    )
    got, data = await post(server, "/v1/completions", {"prompt": [1] * 4096, "max_tokens": 1})
    assert got == 400 and "4096 input tokens" in data["error"]["message"]
    assert server.model.stats().running == 0 and server.model.stats().waiting == 0


def metrics_of(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if (
                s.labels.get("model_name") == MODEL
                and "le" not in s.labels
                and "finished_reason" not in s.labels
            ):
                out[s.name] = s.value
    return out


async def get_metrics(server: EmulatorServer) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{server.port}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        return metrics_of(await r.text())


async def test_metrics(server: EmulatorServer):
    idle = await get_metrics(server)
    assert idle["vllm:num_requests_running"] == 0 and idle["vllm:kv_cache_usage_perc"] == 0
    prompt = list(range(1000, 1100))  # 100 tokens
    for _ in range(3):
        status, _ = await post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4})
        assert status == 200
    m = await get_metrics(server)
    assert m["vllm:time_to_first_token_seconds_count"] == 3
    assert m["vllm:e2e_request_latency_seconds_count"] == 3
    assert m["vllm:inter_token_latency_seconds_count"] == 9  # 3 gaps per 4-token request
    assert m["vllm:time_per_output_token_seconds_count"] == 9
    assert m["vllm:prompt_tokens_total"] == 300 and m["vllm:generation_tokens_total"] == 12
    assert m["vllm:prefix_cache_queries_total"] == 300
    assert m["vllm:prefix_cache_hits_total"] == 2 * 96  # 6 full blocks of the 100-token prompt, twice
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0 == m["vllm:gpu_cache_usage_perc"]
    # model seconds: each decode step of one sequence costs 10 ms in the test cost model
    assert m["vllm:inter_token_latency_seconds_sum"] == pytest.approx(9 * 0.01)


async def wait_idle(server: EmulatorServer) -> None:
    for _ in range(500):
        s = server.model.stats()
        if s.running == 0 and s.waiting == 0 and s.used_blocks == 0 and server.driver.active == 0:
            return
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False])
async def test_disconnect_aborts_and_frees_blocks(start_server, stream):
    server = await start_server(time_scale=1.0)  # real time: a 2000-token answer takes 20 s
    body = {"model": MODEL, "prompt": list(range(500, 900)), "max_tokens": 2000, "stream": stream}
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        if stream:
            r = await s.post(url, json=body)
            first = await r.content.readline()
            assert first.startswith(b"data: {")
        else:  # the response only starts when generation ends: cancel the pending request
            task = asyncio.get_running_loop().create_task(s.post(url, json=body))
            for _ in range(500):
                if server.model.stats().running == 1:
                    break
                await asyncio.sleep(0.01)
        for _ in range(500):  # let the prefill finish, so the prompt's blocks are cached
            if server.model.stats().cached_blocks == 400 // 16:
                break
            await asyncio.sleep(0.01)
        busy = server.model.stats()
        assert busy.running == 1 and busy.used_blocks > 0
        if stream:
            r.close()  # the client goes away mid-stream
        else:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    await wait_idle(server)
    idle = server.model.stats()
    assert (idle.running, idle.waiting, idle.used_blocks, idle.kv_usage) == (0, 0, 0, 0.0)
    assert server.driver.active == 0
    assert idle.cached_blocks == 400 // 16  # the prompt's blocks stay cached, unreferenced


async def test_metrics_name_filter_ignored_by_default_as_vllm_0_32(server: EmulatorServer):
    """vLLM 0.32 ignores ``/metrics?name[]=``: every scrape renders the whole page. So does the
    emulator by default."""
    from kvroute.server.state.backends import SCRAPE_PATH

    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s, s.get(base + SCRAPE_PATH) as r:
        part = await r.read()
    names = {fam.name for fam in text_string_to_metric_families(part.decode())}
    assert "vllm:time_to_first_token_seconds" in names and "vllm:cache_config_info" in names


async def test_metrics_name_filter_serves_only_the_named_samples(start_server):
    """With ``metrics_name_filter`` (``--metrics-name-filter``), ``/metrics?name[]=...``
    (prometheus_client's filter) serves only those samples, and what the router parses from them
    equals what it parses from the whole page."""
    from kvroute.server.state.backends import SCRAPE_PATH, parse_vllm_metrics

    server: EmulatorServer = await start_server(metrics_name_filter=True)
    status, _ = await post(server, "/v1/completions", {"prompt": list(range(1000, 1100)), "max_tokens": 4})
    assert status == 200
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.get(base + SCRAPE_PATH) as r:
            assert r.status == 200
            part = await r.read()
        async with s.get(base + "/metrics") as r:
            whole = await r.read()
    names = {s.name for fam in text_string_to_metric_families(part.decode()) for s in fam.samples}
    assert names == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:cache_config_info",
    }
    assert len(part) < len(whole) // 5
    assert parse_vllm_metrics(part, 1.0) == parse_vllm_metrics(whole, 1.0)
    assert parse_vllm_metrics(part, 1.0) is not None


async def test_clients_that_leave_mid_stream_are_counted_without_a_traceback(start_server, caplog):
    """Regression: each client disconnect used to log aiohttp's "Error handling request" traceback."""
    import socket
    import struct

    server = await start_server(time_scale=5.0)  # ~2 ms a token: each stream would last ~6 s
    caplog.set_level("DEBUG")
    body = orjson_dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 3000, "stream": True})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    n = 12
    for i in range(n):
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(head + body)
        await reader.readuntil(b"data: ")  # the stream has started
        await asyncio.sleep(0.002 * i)  # leave at different points
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        writer.close()
    await wait_idle(server)
    for _ in range(300):
        if server.disconnects >= n:
            break
        await asyncio.sleep(0.01)
    assert server.disconnects == n
    assert server.driver.active == 0
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks
