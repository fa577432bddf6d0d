"""SIGHUP reload of a real ``kvroute serve --config FILE`` process in front of real emulated engines on
free loopback ports: a new backend takes traffic, a broken file is rejected while the router keeps
serving the old config, and a stream in flight survives the reloads."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster, eventually
from .test_shutdown import RouterProc, health, stream_body

SLOW = 0.1  # engine time scale: ~50 ms per token


@pytest.fixture
async def engines() -> AsyncIterator[Cluster]:
    c = Cluster()
    yield c
    await c.close()


async def active_backends(url: str) -> int:
    return int((await health(url))[1]["backends"])  # type: ignore[call-overload]


async def until(cond_async, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if await cond_async():
            return True
        await asyncio.sleep(0.05)
    return False


async def test_sighup_reloads_backends_rejects_a_broken_file_and_keeps_streams(
    engines: Cluster, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    first = await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    second = await engines.add_engine(tokenizer, events=False, time_scale=SLOW)
    a, b = (s.url for s in engines.specs)
    config = tmp_path / "router.yaml"
    config.write_text(f"backends: [{a}]\npolicy: lmetric\n")
    # --policy on the command line wins over the file, at start and on every reload
    router = RouterProc(a, "--config", str(config), "--policy", "round-robin")
    try:
        await router.start()
        assert await active_backends(router.url) == 1
        async with aiohttp.ClientSession() as s:
            async with s.post(router.url + "/v1/completions", json=stream_body(40)) as stream:
                assert (await stream.content.readline()).startswith(b"data: ")
                # add a backend: it takes traffic
                config.write_text(f"backends: [{a}, {{url: {b}}}]\npolicy: lmetric\n")
                router.signal(signal.SIGHUP)

                async def two() -> bool:
                    return (
                        await active_backends(router.url) == 2
                        and (await health(router.url))[1]["healthy_backends"] == 2
                    )

                assert await until(two)
                for _ in range(4):
                    async with s.post(
                        router.url + "/v1/completions", json={**stream_body(2), "stream": False}
                    ) as r:
                        assert r.status == 200
                assert await eventually(lambda: second.model.stats().prefix_query_tokens > 0)
                # a broken file: rejected, the old config stays
                config.write_text("backends: [http://x:1\npolicy: [")
                router.signal(signal.SIGHUP)
                await asyncio.sleep(0.5)
                assert router.proc is not None and router.proc.returncode is None
                status, body = await health(router.url)
                assert status == 200 and body["backends"] == 2 and body["policy"] == "round-robin"
                async with s.post(
                    router.url + "/v1/completions", json={**stream_body(2), "stream": False}
                ) as r:
                    assert r.status == 200
                rest = await stream.content.read()
            assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
        assert first.model.stats().prefix_query_tokens > 0
        router.signal(signal.SIGTERM)
        code, err = await router.exit_status()
        assert code == 0, err
        assert f"SIGHUP: reloaded {config}: backends: +{b}" in err
        assert f"SIGHUP: {config} rejected, keeping the old config:" in err and "invalid YAML" in err
        assert "Traceback" not in err
    finally:
        await router.close()
