"""Graceful shutdown: a real ``kvroute serve`` process under SIGTERM/SIGHUP, and
``RouterServer.shutdown`` in process, in front of real emulated engines on free loopback ports.

Emulated engines run at ``time_scale=0.1``: about 50 ms of wall time per decoded token, so a stream of
60 tokens takes about 3 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

import kvroute
from kvroute.server.cluster import free_port
from kvroute.server.observe.exporter import render_metrics
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster, counters_zero, eventually

SLOW = 0.1  # engine time scale: ~50 ms per token
SRC = str(Path(kvroute.__file__).resolve().parents[1])  # the kvroute under test, for the subprocess


@pytest.fixture
async def engines() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


def stream_body(max_tokens: int) -> dict[str, object]:
    return {"model": "emu", "prompt": "hello " * 20, "max_tokens": max_tokens, "stream": True}


class RouterProc:
    """``kvroute serve`` as a subprocess on a free port; :meth:`close` kills it if it still runs."""

    def __init__(self, backend: str, *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            sys.executable,
            *("-m", "kvroute.cli", "serve", "--backend", backend, "--port", str(self.port)),
            *("--health-interval", "0.2", *flags),
        ]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, timeout_s: float = 60.0) -> None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
        }
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
        )
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < deadline:
                assert self.proc.returncode is None, "kvroute serve exited early"
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("kvroute serve did not become healthy")

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    async def exit_status(self, timeout_s: float = 30.0) -> tuple[int, str]:
        """Wait for the process to exit; its status and stderr."""
        assert self.proc is not None
        _, err = await asyncio.wait_for(self.proc.communicate(), timeout_s)
        assert self.proc.returncode is not None
        return self.proc.returncode, err.decode()

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.communicate()


async def health(url: str) -> tuple[int, dict[str, object]]:
    async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
        return r.status, orjson.loads(await r.read())


async def until_draining(url: str, timeout_s: float = 30.0) -> dict[str, object]:
    """/health once it answers 503 (the signal is handled asynchronously); fails after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = await health(url)
        if status == 503 or time.monotonic() > deadline:
            assert status == 503, body
            return body
        await asyncio.sleep(0.02)


async def until_refused(url: str, timeout_s: float = 8.0) -> None:
    """Return once a new connection to ``url`` is refused; fails after ``timeout_s`` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not await refused(url):
        assert time.monotonic() < deadline, f"{url} still accepts connections"
        await asyncio.sleep(0.05)


async def refused(url: str) -> bool:
    """True if a new connection to ``url`` is refused."""
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            await r.read()
    except aiohttp.ClientConnectorError:
        return True
    return False


async def test_sigterm_during_a_stream_completes_it_and_exits_0(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    """SIGHUP without --config reloads nothing; SIGTERM: /health 503 at once, new connections refused after the grace, the
    stream in flight completes normally, exit status 0."""
    await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    router = RouterProc(engines.specs[0].url, "--drain-grace", "0.5", "--drain-timeout", "30")
    try:
        await router.start()
        router.signal(signal.SIGHUP)
        await asyncio.sleep(0.3)
        assert router.proc is not None and router.proc.returncode is None
        assert (await health(router.url))[0] == 200
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=stream_body(200)) as r,
        ):
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: ")
            router.signal(signal.SIGTERM)
            body = await until_draining(router.url)
            assert body["status"] == "draining"
            # past the grace the listening socket is closed (polled: a loaded machine may take a
            # while; the stream lasts ~10 s at SLOW, so it is still running then)
            await until_refused(router.url)
            assert router.proc.returncode is None  # ... while the stream still runs
            rest = await r.content.read()
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
        status, err = await router.exit_status()
        assert status == 0, err
        assert "SIGHUP: no --config file: nothing to reload" in err and "Traceback" not in err
    finally:
        await router.close()


async def test_sigterm_drain_timeout_ends_a_long_stream_with_an_error_event(
    engines: Cluster, tokenizer: Tokenizer
) -> None:
    eng = await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    router = RouterProc(engines.specs[0].url, "--drain-grace", "0", "--drain-timeout", "0.5")
    try:
        await router.start()
        async with (
            aiohttp.ClientSession() as s,
            s.post(router.url + "/v1/completions", json=stream_body(2000)) as r,
        ):
            assert (await r.content.readline()).startswith(b"data: ")
            router.signal(signal.SIGTERM)
            rest = await asyncio.wait_for(r.content.read(), 60)  # a hang guard, not a speed claim
        lines = [ln for ln in rest.split(b"\n") if ln.startswith(b"data: ")]
        assert len(lines) < 2000  # cut short: the 2,000-token stream did not run to its end
        assert lines[-1] == b"data: [DONE]"
        error = orjson.loads(lines[-2][len(b"data: ") :])["error"]
        assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
        status, err = await router.exit_status()
        assert status == 0, err
        # the router aborted the upstream request: the engine cancels it
        assert await eventually(lambda: eng.model.stats().running == 0 and eng.model.stats().waiting == 0)
    finally:
        await router.close()


async def test_shutdown_in_process_grace_refusal_and_drain(engines: Cluster, tokenizer: Tokenizer) -> None:
    """Within the grace a new request is served; after it, a request on an open connection gets a 503
    JSON error and a new connection is refused; at the drain timeout a stream gets an SSE error event
    and a request with nothing sent yet a 503 JSON error; counters back to zero, both counted drained."""
    await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    url = await engines.start_router(tokenizer, drain_grace_s=0.5, drain_timeout_s=1.0)
    router = engines.router
    assert router is not None
    async with aiohttp.ClientSession() as s, aiohttp.ClientSession() as kept:
        short = {"model": "emu", "prompt": "hi", "max_tokens": 1}
        async with kept.post(url + "/v1/completions", json=short) as r:  # opens a kept-alive connection
            assert r.status == 200
        stream = await s.post(url + "/v1/completions", json=stream_body(2000))
        assert (await stream.content.readline()).startswith(b"data: ")

        async def unstreamed() -> tuple[int, bytes]:
            async with aiohttp.ClientSession() as s2:
                body = {**stream_body(2000), "stream": False}
                async with s2.post(url + "/v1/completions", json=body) as r:
                    return r.status, await r.read()

        buffered = asyncio.create_task(unstreamed())
        assert await eventually(lambda: router.proxy.inflight == 2)
        shutdown = asyncio.create_task(router.shutdown())
        await asyncio.sleep(0)
        status, body = await health(url)
        assert status == 503 and body["status"] == "draining"
        async with kept.post(url + "/v1/completions", json=short) as r:  # within the grace: served
            assert r.status == 200
        await asyncio.sleep(0.6)
        async with kept.post(url + "/v1/completions", json=short) as r:  # after it: refused
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["type"] == "service_unavailable"
        assert await refused(url)
        rest = await asyncio.wait_for(stream.content.read(), 10)
        stream.release()
        assert rest.rstrip().endswith(b"data: [DONE]") and b'"service_unavailable"' in rest
        status, raw = await asyncio.wait_for(buffered, 10)
        assert status == 503 and orjson.loads(raw)["error"]["type"] == "service_unavailable"
        assert await asyncio.wait_for(shutdown, 10) == 2
    engines.router = None  # stopped by the shutdown
    assert counters_zero(router) and router.proxy.inflight == 0
    c = router.state.counters
    assert (c.drained, c.cancelled, c.ok, c.unavailable) == (2, 0, 2, 1)
    assert 'kvroute_requests_total{outcome="drained"} 2.0' in render_metrics(router.registry).decode()


async def test_second_signal_ends_the_drain_at_once(engines: Cluster, tokenizer: Tokenizer) -> None:
    await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    url = await engines.start_router(tokenizer, drain_grace_s=30.0, drain_timeout_s=30.0)
    router = engines.router
    assert router is not None
    hurry = asyncio.Event()
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=stream_body(2000)) as r:
        assert (await r.content.readline()).startswith(b"data: ")
        shutdown = asyncio.create_task(router.shutdown(hurry))
        await asyncio.sleep(0.2)
        assert not shutdown.done()
        hurry.set()
        assert await asyncio.wait_for(shutdown, 60) == 1  # a hang guard, not a speed claim
        rest = await r.content.read()
        assert rest.count(b"data: ") < 2000  # cut short by the hurry, not drained to its end
    engines.router = None
    assert rest.rstrip().endswith(b"data: [DONE]") and b'"service_unavailable"' in rest
    assert counters_zero(router) and router.state.counters.drained == 1
