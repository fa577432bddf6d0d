"""`kvroute up --gateway envoy`: a real Envoy on the port, kvroute as its endpoint picker; the openai
client, `kvroute bench` and the dashboard work through it, and Ctrl-C (SIGTERM) stops Envoy too."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import sys
from pathlib import Path

import aiohttp
import openai
import pytest

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="the gateway extra is not installed"
)

from tests.server.extproc.harness import envoy_or_skip

from kvroute.server.cluster import free_port


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_up_with_envoy_serves_openai_bench_and_dashboard(tmp_path: Path) -> None:
    envoy_or_skip()
    port = free_port()
    argv = [sys.executable, "-m", "kvroute.cli", "up", "--instances", "2", "--port", str(port)]
    argv += ["--gateway", "envoy", "--explain", "--drain-grace", "0", "--time-scale", "20"]
    token = "gateway-test-token"  # up prints a token it made only to a terminal: give it one
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        env={**os.environ, "KVROUTE_ADMIN_TOKEN": token},
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 120)
        assert line.decode().strip() == f"router: http://127.0.0.1:{port}/v1", line
        err = b""
        while b"dashboard: " not in err:  # printed before the router line, so already there
            err += await asyncio.wait_for(proc.stderr.readline(), 10)
        assert b"envoy http://127.0.0.1:" in err and b"kvroute epp" in err
        page = re.search(rb"dashboard: (\S+)", err)
        assert page is not None
        dash = page.group(1).decode().partition("#")[0]
        url = f"http://127.0.0.1:{port}"
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        try:
            system = {"role": "system", "content": "You answer in one word. " * 60}
            msgs = [system, {"role": "user", "content": "Hello?"}]
            raw = await client.chat.completions.with_raw_response.create(
                model="kvroute-emulated",
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=4,
            )
            first = raw.parse()
            holder = raw.headers["x-kvroute-backend"]
            await asyncio.sleep(0.5)  # the engine's KV events reach the picker
            msgs += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "Again?"},
            ]
            raw = await client.chat.completions.with_raw_response.create(
                model="kvroute-emulated",
                messages=msgs,  # type: ignore[arg-type]
                max_tokens=4,
            )
            second = raw.parse()
            assert raw.headers["x-kvroute-backend"] == holder
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            assert (second.usage.prompt_tokens_details.cached_tokens or 0) >= 256
        finally:
            await client.close()
        out = tmp_path / "bench.json"
        bench = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvroute.cli",
            "bench",
            "--url",
            url,
            "--workload",
            "chatbot",
            "--duration",
            "2",
            "--json",
            str(out),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, bench_err = await asyncio.wait_for(bench.communicate(), 240)
        assert bench.returncode == 0, bench_err.decode()[-2000:]
        result = json.loads(out.read_text())
        assert result["requests"] > 0 and result["unfinished"] == 0
        async with aiohttp.ClientSession() as http:
            async with http.get(dash) as r:
                assert r.status == 200 and "text/html" in r.headers["Content-Type"]
            async with http.get(
                dash.replace("/dashboard", "/debug/decisions"), headers={"Authorization": f"Bearer {token}"}
            ) as r:
                assert r.status == 200
                assert (await r.json())["total"] == 2 + result[
                    "requests"
                ]  # every request decided by the picker
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0
    assert not _listening(port)  # Envoy went with it
