"""vllm-router's own P/D mode (``vllm-router --vllm-pd-disaggregation --prefill URL --decode URL``, the
PyPI package, unchanged) in front of kvroute's emulated NIXL prefill and decode engines: the emulator
speaks vLLM's P/D protocol well enough for vLLM's router. Skipped only when the binary is absent
(``pip install -e '.[bench]'``)."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvroute.emulator.pd import KVTransferSettings
from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine.cost import LinearCostModel
from kvroute.engine.types import EngineConfig
from kvroute.tokenizer import load_tokenizer


def vllm_router_binary() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


BINARY = vllm_router_binary()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="vllm-router is not installed (pip install -e '.[bench]')"
)

MODEL = "test-model"
COST = LinearCostModel("test-linear", decode_s_per_seq=0.01, prefill_s_per_token=2e-5)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def healthy(url: str, timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout:
            try:
                async with http.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


@pytest.fixture
async def pd_pair() -> AsyncIterator[tuple[str, EmulatorServer, EmulatorServer]]:
    tok = load_tokenizer()
    engines = []
    for role in ("kv_producer", "kv_consumer"):
        cfg = EngineConfig(num_kv_blocks=512, max_model_len=8192, report_tokens=True)
        st = EmulatorSettings(
            MODEL, cfg, 20.0, 8, kv_transfer=KVTransferSettings(role=role), kv_bytes_per_token=1e5
        )
        e = EmulatorServer(st, COST, tok)
        await e.start("127.0.0.1", 0)
        engines.append(e)
    p, d = engines
    port = free_port()
    assert BINARY is not None
    argv = [BINARY, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefill", f"http://127.0.0.1:{p.port}", "--decode", f"http://127.0.0.1:{d.port}"]
    argv += ["--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await healthy(f"http://127.0.0.1:{port}/health")
        yield f"http://127.0.0.1:{port}", p, d
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for e in engines:
            await e.stop()


async def test_vllm_router_pd_mode_runs_both_legs_on_the_emulator(pd_pair):
    base, p, d = pd_pair
    n = len(load_tokenizer().encode(PROMPT))
    async with aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
        async with http.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["finish_reason"] == "length"
        assert "___prefill_addr_" in out["id"]  # vllm-router's request id reached D (and P, see below)
        assert p.model.stats().prefix_query_tokens == n  # P prefilled the prompt
        assert d.model.stats().external_hit_tokens == n  # D read the prompt from P
        t0 = time.monotonic()
        while p.model.stats().held_requests and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.02)
        assert p.model.stats().held_requests == 0 and p.model.stats().used_blocks == 0  # D notified P
        msgs = [{"role": "user", "content": PROMPT}]
        body = {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(base + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            text = await r.text()
    chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]") and chunks[-1]["usage"]["completion_tokens"] == 4
    assert d.model.stats().external_query_tokens == n + chunks[-1]["usage"]["prompt_tokens"]
