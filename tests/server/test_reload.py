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


async def test_a_backend_deleted_through_the_admin_api_stays_deleted_across_sighup(
    engines: Cluster, tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Regression: a SIGHUP reload of an unchanged file brought back a backend deleted through the
    admin API, on the worker that reloaded, so workers and replicas disagreed. Two workers here: the
    deletion reaches one, the journal the other; SIGHUP reaches both; neither lists it again until the
    file's entry for it changes. Each reload also adds or removes a third backend, so that the test
    waits until both workers have applied it rather than for a fixed time (a reload that took over a
    second on a loaded machine let the next write overtake it)."""
    from kvroute.server.state.loadtable import url_digest

    from .test_workers import until_all_listen

    for _ in range(3):
        await engines.add_engine(tokenizer, events=False)
    a, b, c = (s.url for s in engines.specs)
    config = tmp_path / "router.yaml"
    config.write_text(f"backends: [{a}, {b}]\n")
    router = RouterProc(a, "--config", str(config), "--workers", "2", "--admin-token", "t")
    auth = {"Authorization": "Bearer t"}

    async def listed() -> set[frozenset[str]]:
        """What each of a dozen fresh connections (spread over the workers) sees as active."""
        seen = set()
        for _ in range(12):
            connector = aiohttp.TCPConnector(force_close=True)
            async with (
                aiohttp.ClientSession(connector=connector) as s,
                s.get(router.url + "/admin/backends", headers=auth) as r,
            ):
                data = (await r.json())["data"]
            seen.add(frozenset(d["url"] for d in data if d["state"] == "active"))
        return seen

    try:
        await router.start(timeout_s=180)  # two workers, each importing the whole router
        await until_all_listen(router)  # a SIGHUP to a worker still starting waits for it anyway
        assert await until(lambda: _eq(listed(), {frozenset((a, b))}), 30), await listed()
        async with (
            aiohttp.ClientSession() as s,
            s.delete(f"{router.url}/admin/backends/{url_digest(b)}", headers=auth) as r,
        ):
            assert r.status == 202
        assert await until(lambda: _eq(listed(), {frozenset((a,))}), 30), await listed()
        config.write_text(f"backends: [{a}, {b}, {c}]\n")  # b's entry as it was; c added
        router.signal(signal.SIGHUP)
        assert await until(lambda: _eq(listed(), {frozenset((a, c))}), 60), await listed()
        config.write_text(f"backends: [{a}]\n")  # the operator takes b off the file (and c) ...
        router.signal(signal.SIGHUP)
        assert await until(lambda: _eq(listed(), {frozenset((a,))}), 60), await listed()
        config.write_text(f"backends: [{a}, {b}]\n")  # ... and lists it again: it is back
        router.signal(signal.SIGHUP)
        assert await until(lambda: _eq(listed(), {frozenset((a, b))}), 60), await listed()
        router.signal(signal.SIGTERM)
        code, err = await router.exit_status()
        assert code == 0, err
        assert "Traceback" not in err
    except BaseException:
        if router.proc is not None and router.proc.returncode is None:
            router.proc.kill()
            print((await router.proc.communicate())[1].decode()[-4000:])  # the router's side of it
        raise
    finally:
        await router.close()


async def _eq(got, want) -> bool:  # type: ignore[no-untyped-def]
    return await got == want
