"""kvroute's P/D mode in front of a real vLLM P/D pair: vLLM 0.32's CPU build with the NIXL connector
(``--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'``),
NIXL from PyPI (``pip install --target DIR nixl==1.5.1 nixl-cu12==1.5.1``: its UCX backend runs on
the CPU), the tiny Qwen3 model.

Runs only where ``KVROUTE_VLLM_VENV`` (a vLLM CPU virtualenv), ``KVROUTE_VLLM_MODEL`` (a model folder)
and ``KVROUTE_NIXL_PATH`` (the folder NIXL was installed into, put on the servers' PYTHONPATH; empty if
the venv has NIXL itself) are set; skipped with that reason elsewhere. Slow: two servers take minutes
to start on a loaded machine and about 2.5 GiB each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvroute.engine.cost import get_profile
from kvroute.engine.transfer import TransferModel
from kvroute.server.pd import PDBackend, PDConfig, PDServer
from kvroute.tokenizer import load_tokenizer

VENV, MODEL, NIXL = (
    os.environ.get(k) for k in ("KVROUTE_VLLM_VENV", "KVROUTE_VLLM_MODEL", "KVROUTE_NIXL_PATH")
)
pytestmark = pytest.mark.skipif(
    not (VENV and MODEL and NIXL is not None and (Path(VENV) / "bin" / "vllm").is_file()),
    reason="KVROUTE_VLLM_VENV, KVROUTE_VLLM_MODEL and KVROUTE_NIXL_PATH are not set (a vLLM CPU venv, "
    "a model folder, NIXL's pip --target folder)",
)
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_vllm(port: int, side: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
        UCX_RCACHE_MAX_UNRELEASED="1024",
    )
    if NIXL:
        env["PYTHONPATH"] = NIXL + os.pathsep + env.get("PYTHONPATH", "")
    kt = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    argv = [f"{VENV}/bin/vllm", "serve", str(MODEL), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--enable-prefix-caching", "--enable-prompt-tokens-details", "--block-size", str(BLOCK)]
    argv += ["--num-gpu-blocks-override", "512", "--kv-cache-memory-bytes", str(64 << 20)]
    argv += ["--max-model-len", "4096", "--enforce-eager", "--kv-transfer-config", json.dumps(kt)]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


async def healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 900.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - t0 < timeout:
            assert proc.poll() is None, f"vllm serve for {url} exited with {proc.returncode}"
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(1.0)
    raise AssertionError(f"{url} did not start in {timeout:.0f} s")


def metric(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
async def vllm_pair() -> AsyncIterator[tuple[str, str]]:
    ports = [free_port(), free_port()]
    procs = [start_vllm(p, free_port()) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        for u, p in zip(urls, procs, strict=True):
            await healthy(u, p)
        yield urls[0], urls[1]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


async def test_kvroute_pd_mode_in_front_of_real_vllm_nixl(vllm_pair):
    p_url, d_url = vllm_pair
    profile = get_profile()
    cfg = PDConfig((PDBackend(p_url),), (PDBackend(d_url),), block_size=BLOCK, conditional=False)
    router = PDServer(cfg, load_tokenizer(str(MODEL)), profile.cost, TransferModel(1e5, 25e9))
    await router.start("127.0.0.1", 0)
    base = f"http://127.0.0.1:{router.port}"
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                first, h = await r.json(), r.headers
            assert h["x-kvroute-pd"] == "disaggregated" and first["usage"]["completion_tokens"] == 5
            async with http.get(d_url + "/metrics") as r:
                dm = await r.text()
            n = first["usage"]["prompt_tokens"]
            assert metric(dm, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') == n
            assert metric(dm, "vllm:nixl_bytes_transferred_sum") > 0  # the KV really moved
            # the same prompt streamed again: P's prefix cache hit is what the router reports
            body = {
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            async with http.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                text = await r.text()
            chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
            use = chunks[-1]["usage"]
            assert use["completion_tokens"] == 4
            assert use["prompt_tokens_details"]["cached_tokens"] == BLOCK * ((n - 1) // BLOCK) > 0
    finally:
        await router.stop()
