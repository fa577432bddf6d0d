"""`kvroute up --engine vllm` on vLLM's CPU build: one command brings up a real vLLM server and the
router in front of it, and Ctrl-C takes both down."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson

from kvroute.integrations.vllm_launch import free_port

from .harness import MODEL, VENV, real_vllm, words

pytestmark = real_vllm

ROOT = Path(__file__).resolve().parents[2]


def post(url: str, body: dict[str, object]) -> tuple[dict[str, object], dict[str, str]]:
    req = urllib.request.Request(
        url, data=orjson.dumps(body), headers={"content-type": "application/json", "x-kvroute-explain": "1"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return orjson.loads(r.read()), dict(r.headers)


def test_up_engine_vllm_routes_and_stops(tmp_path: Path) -> None:
    port = free_port()
    logs = tmp_path / "logs"
    argv = [sys.executable, "-m", "kvroute.cli", "up", "--engine", "vllm", "--model", str(MODEL)]
    argv += ["--vllm", str(VENV), "--instances", "1", "--port", str(port), "--engine-block-size", "32"]
    argv += ["--kv-blocks", "256", "--max-model-len", "4096", "--engine-log-dir", str(logs)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err = (tmp_path / "up.err").open("wb")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, env=env, start_new_session=True)
    try:
        line = b""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if line.startswith(b"router: "):
                    break
        assert line.startswith(b"router: "), (proc.poll(), (tmp_path / "up.err").read_text())
        base = line.split()[1].decode()
        assert base == f"http://127.0.0.1:{port}/v1"
        body = {
            "model": MODEL.name,
            "messages": [{"role": "user", "content": words(2000, 300)}],
            "max_tokens": 3,
        }
        post(base + "/chat/completions", body)
        time.sleep(0.5)
        again, h2 = post(base + "/chat/completions", body)
        usage = again["usage"]
        assert isinstance(usage, dict)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached == 32 * ((usage["prompt_tokens"] - 1) // 32) > 0
        assert int(h2["x-kvroute-cached-tokens"]) == cached  # the exact view, from vLLM's events
        assert int(h2["x-kvroute-prompt-tokens"]) == usage["prompt_tokens"]
        vllm_logs = list(logs.glob("vllm-*.log"))
        assert len(vllm_logs) == 1
        vllm_url = "http://127.0.0.1:" + vllm_logs[0].stem.split("-")[1]
        with urllib.request.urlopen(vllm_url + "/health", timeout=5) as r:
            assert r.status == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        err.close()
    assert proc.returncode == 0, (tmp_path / "up.err").read_text()
    try:
        urllib.request.urlopen(vllm_url + "/health", timeout=2)
        raise AssertionError("vllm serve still answers after kvroute up stopped")
    except OSError:
        pass
