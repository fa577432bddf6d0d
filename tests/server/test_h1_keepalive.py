"""The router closes a pooled upstream connection that stayed idle longer than ``upstream_keepalive_s``
(:meth:`H1Transport.prune`, which the router's fleet calls every 50 ms; and the pool itself before
it would hand the connection out), so an engine without an idle timeout of its own does not hold it
for ever. Real sockets on loopback: a raw keep-alive upstream that never closes an idle connection
(:mod:`tests.server.rawupstream`) counts the connections the router closed (``ended``). The unit test
moves an injected clock (no sleeping); the router test waits, bounded, for the upstream to see EOF
(a hang guard, no speed claim)."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable

import aiohttp

from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.observe.exporter import StrayCollector
from kvroute.server.wire.h1 import H1Transport
from kvroute.tokenizer import Tokenizer

from .rawupstream import RawUpstream
from .test_backend_churn import engine  # a keep-alive engine: models, metrics, health, completions

WAIT_S = 30.0


async def until(cond: Callable[[], bool], what: str) -> None:
    """Wait until ``cond()`` holds (AssertionError after ``WAIT_S``: a hang guard)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not cond():
        assert loop.time() < deadline, what
        await asyncio.sleep(0.01)


def gauge(t: H1Transport) -> dict[str, float]:
    """``kvroute_upstream_connections{backend}`` as the exporter reports it for ``t``."""
    (fam,) = [f for f in StrayCollector(t).collect() if f.name == "kvroute_upstream_connections"]
    return {s.labels["backend"]: s.value for s in fam.samples}


async def get(t: H1Transport, url: str) -> None:
    resp = await t.send(url, "GET", "/health", timeout_s=10)
    await resp.read()
    resp.release()


async def test_an_idle_connection_past_the_limit_is_closed_by_the_injected_clock() -> None:
    now = [1000.0]
    t = H1Transport(connect_timeout_s=5, read_timeout_s=10, keepalive_s=15.0, clock=lambda: now[0])
    try:
        async with RawUpstream(engine) as up:
            await get(t, up.url)
            now[0] += 15.0  # idle exactly the limit: kept
            t.prune({up.url})
            await get(t, up.url)
            assert up.connections == 1 and not up.ended  # reused; idle again from now
            assert gauge(t) == {up.url: 1.0}
            now[0] += 15.5  # idle past the limit
            t.prune({up.url})
            await until(lambda: len(up.ended) == 1, "the upstream never saw the idle connection close")
            await until(lambda: t.open_connections() == {up.url: 0}, "the pool still counts it")
            assert gauge(t) == {up.url: 0.0}
            await get(t, up.url)  # a new connection
            assert up.connections == 2
            now[0] += 60.0  # not pruned, but too old to be handed out: the pool closes it instead
            await get(t, up.url)
            assert up.connections == 3
            await until(lambda: len(up.ended) == 2, "a connection past the limit was handed out")
            assert gauge(t) == {up.url: 1.0}
    finally:
        await t.close()


async def test_the_router_closes_its_idle_upstream_connections_after_upstream_keepalive_s(
    tokenizer: Tokenizer,
) -> None:
    """A real router (its fleet prunes every 50 ms) in front of an upstream that never closes: once
    traffic stops, every connection the router opened to it is closed by the router, and
    ``/metrics`` says 0 open connections."""
    async with RawUpstream(engine) as up:
        cfg = RouterConfig(
            backends=(BackendSpec(up.url),),
            port=0,
            upstream_keepalive_s=0.5,
            health_interval_s=3600.0,  # nothing but the test's request touches the upstream after start
            models_interval_s=3600.0,
            scrape_interval_s=3600.0,
            scrape_idle_interval_s=3600.0,
        )
        router = RouterServer(cfg, tokenizer=tokenizer)
        await router.start()
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "emu", "prompt": "hello there", "max_tokens": 2}
                async with s.post(router.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.read()
                await until(
                    lambda: up.connections >= 1 and len(up.ended) == up.connections,
                    "the router kept an idle upstream connection open",
                )
                async with s.get(router.url + "/metrics") as r:
                    text = await r.text()
            assert f'kvroute_upstream_connections{{backend="{up.url}"}} 0.0' in text.splitlines()
        finally:
            await router.stop()


def test_pd_mode_takes_upstream_keepalive() -> None:
    from kvroute.commands.pdserve import pd_config
    from kvroute.commands.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    pd, *_ = pd_config(p.parse_args(["--decode", "http://127.0.0.1:1", "--upstream-keepalive", "3"]))
    assert pd.upstream_keepalive_s == 3.0


async def test_the_pd_router_prunes_idle_connections_and_those_of_unlisted_urls(
    tokenizer: Tokenizer,
) -> None:
    """The P/D router (no fleet) prunes periodically too (:mod:`kvroute.server.wire.pruning`): the
    decode instance's connection, idle past ``upstream_keepalive_s``, is closed by the router; and a
    pool for a URL that is not an instance (what a leg begun before its instance left leaves) is
    closed without waiting for the limit."""
    from kvroute.engine import cost as costmod
    from kvroute.engine.transfer import TransferModel
    from kvroute.server.pd import PDBackend, PDConfig, PDServer

    async with RawUpstream(engine) as up, RawUpstream(engine) as gone:
        cfg = PDConfig((), (PDBackend(up.url),), scrape_interval=3600.0, upstream_keepalive_s=0.5)
        cost = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
        router = PDServer(cfg, tokenizer, cost, TransferModel(100_000.0, 100e9))
        port = await router.start("127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as s:
                body = {"model": "emu", "prompt": "hello there", "max_tokens": 2}
                async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                    assert r.status == 200, await r.read()
            legs = {r.conn for r in up.requests if r.head.startswith(b"POST")}  # not the scrape's
            assert legs, up.requests
            await until(lambda: legs <= up.ended, "the P/D router kept an idle upstream connection open")
            assert isinstance(router.transport, H1Transport)
            await get(router.transport, gone.url)  # a pool for a URL no instance has
            await until(lambda: gone.ended == {0}, "the P/D router kept a connection to an unlisted URL")
            assert gone.url not in router.transport.open_connections()
        finally:
            await router.stop()
