"""The Ray Serve router on a real local Ray (2 CPUs) with emulated engine replicas.

Each test starts Ray and a Serve app and shuts both down. The router runs in this process (a
handle's router); tests read it through the handle's private attributes (``_router``), the only way
to reach the router instance that Ray builds.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')")

from ray.serve.config import RequestRouterConfig  # noqa: E402

from kvroute.integrations.ray_engine import EmulatedEngine  # noqa: E402
from kvroute.integrations.ray_serve import KVRouteRequestRouter  # noqa: E402

SYSTEM = "You answer questions about the history of mathematics in detail. " * 40


@pytest.fixture
def serve_app() -> Iterator[Callable[..., Any]]:
    """Start Ray; yield ``deploy(replicas, **engine_kwargs) -> handle``; shut everything down."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    def deploy(replicas: int, router_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        dep = serve.deployment(
            EmulatedEngine,
            name="engine",
            num_replicas=replicas,
            ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class=KVRouteRequestRouter,
                request_router_kwargs={"policy": "lmetric", "sync_interval_s": 0.05, **(router_kwargs or {})},
                request_routing_stats_period_s=0.2,
            ),
        )
        return serve.run(dep.bind(kv_blocks=4096, **kwargs), name="app", route_prefix=None)

    try:
        yield deploy
    finally:
        serve.shutdown()
        ray.shutdown()


def router_of(handle: Any) -> KVRouteRequestRouter:
    router = handle._router._asyncio_router.request_router
    assert isinstance(router, KVRouteRequestRouter)
    return router


async def ask(handle: Any, messages: list[dict[str, str]], max_tokens: int = 4) -> dict[str, Any]:
    items = [
        x async for x in handle.options(stream=True).remote({"messages": messages, "max_tokens": max_tokens})
    ]
    assert "error" not in items[-1], items[-1]
    return items[-1]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


async def conversation(handle: Any, name: str, turns: int) -> list[dict[str, Any]]:
    msgs = [{"role": "system", "content": f"{name}: {SYSTEM}"}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"{name} asks question number {t} " * 20})
        last = await ask(handle, msgs)
        out.append(last)
        msgs.append({"role": "assistant", "content": last["text"]})
    return out


def test_turns_land_on_the_replica_holding_the_conversation(serve_app: Callable[..., Any]) -> None:
    handle = serve_app(2)

    async def run() -> list[list[dict[str, Any]]]:
        return [await conversation(handle, f"user{i}", 3) for i in range(4)]

    convs = asyncio.run(run())
    for turns in convs:
        assert len({t["replica"] for t in turns}) == 1  # every turn on one replica
        for prev, t in itertools.pairwise(turns):  # the earlier turn's prompt is cached
            assert t["usage"]["prompt_tokens_details"]["cached_tokens"] >= prev["usage"]["prompt_tokens"] - 32
    router = router_of(handle)
    assert router.decisions >= 12 and router.last_decision is not None
    assert router.last_decision.policy == "lmetric"


def test_exact_view_from_replica_kv_events(serve_app: Callable[..., Any]) -> None:
    handle = serve_app(2, kv_events=True)

    async def run() -> list[dict[str, Any]]:
        await ask(handle, [{"role": "user", "content": "warm up"}])
        return await conversation(handle, "exact", 3)

    first = asyncio.run(run())
    router = router_of(handle)
    wait_for(lambda: len(router._subscribers) == 2)
    assert {router.core.kv.mode(i, time.time()) for i in router._index.values()} <= {"exact", "recovering"}
    assert len({t["replica"] for t in first}) == 1


def test_load_is_counted_and_released(serve_app: Callable[..., Any]) -> None:
    handle = serve_app(2)
    asyncio.run(ask(handle, [{"role": "user", "content": "warm up"}]))  # Ray builds the router now
    router = router_of(handle)
    wait_for(lambda: len(router.inflight) == 0)

    async def until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, "condition not met in time"
            await asyncio.sleep(0.02)

    async def run() -> list[dict[str, Any]]:
        # Two long requests at once with unrelated prompts: the second sees the first's reservation.
        # (400 tokens take seconds of model time: the first is still in flight when the second is
        # routed, however loaded the machine; no fixed sleep decides it.)
        a = asyncio.ensure_future(ask(handle, [{"role": "user", "content": "alpha " * 300}], 400))
        await until(lambda: len(router.inflight) == 1)
        b = asyncio.ensure_future(ask(handle, [{"role": "user", "content": "beta " * 300}], 400))
        await until(lambda: len(router.inflight) == 2)
        first, second = (d.instance for _, d in router._chosen.values())
        assert first != second  # the second decision counted the first's load
        # Ray may still send a request to the decision's second choice (a replica whose queue length
        # it could not read in time): the reservations follow where Ray sent each request.
        rows = router.inflight._rows
        await until(lambda: all(r.dispatched for r in rows.values()))
        placed.extend(r.replica for r in rows.values())
        return list(await asyncio.gather(a, b))

    placed: list[str] = []

    a, b = asyncio.run(run())
    assert sorted(rid.rsplit("#", 1)[-1] for rid in placed) == sorted([a["replica"], b["replica"]])
    wait_for(lambda: len(router.inflight) == 0)
    assert router.inflight.load() == {}
    # Each replica reports where its prefills end (its engine's median time to first token).
    wait_for(lambda: all("ttft_p50_s" in (r.routing_stats or {}) for r in router._by_rid.values()))
    assert all(0.0 < r.routing_stats["ttft_p50_s"] < 5.0 for r in router._by_rid.values())
    # ... and which requests its snapshot counts (none, once a snapshot after both is in), by id.
    wait_for(lambda: all(r.routing_stats.get("requests") == [] for r in router._by_rid.values()))


def test_dead_replica_is_dropped_and_router_survives_replica_changes(serve_app: Callable[..., Any]) -> None:
    handle = serve_app(2)
    first = asyncio.run(conversation(handle, "victim", 2))
    router = router_of(handle)
    victim = first[0]["replica"]
    full = next(rid for rid in router._index if rid.endswith(victim))
    ray.kill(ray.get_actor(full, namespace="serve"), no_restart=True)
    wait_for(lambda: full not in router._index)  # dropped from the candidates and the KV view
    survivors = asyncio.run(conversation(handle, "after", 2))
    assert all(t["replica"] != victim for t in survivors)
    # Serve replaces the dead replica, then we scale to 3: the router follows the list.
    serve.run(
        serve.deployment(
            EmulatedEngine,
            name="engine",
            num_replicas=3,
            ray_actor_options={"num_cpus": 0},
            request_router_config=RequestRouterConfig(
                request_router_class=KVRouteRequestRouter,
                request_router_kwargs={"policy": "lmetric", "sync_interval_s": 0.05},
                request_routing_stats_period_s=0.2,
            ),
        ).bind(kv_blocks=4096),
        name="app",
        route_prefix=None,
    )
    wait_for(lambda: len(router.curr_replicas) == 3)
    later = asyncio.run(run_many(handle))
    assert len(later) == 6 and len(router._index) == 3
    assert router.syncs > 0  # the shared state actor answered


async def run_many(handle: Any) -> list[dict[str, Any]]:
    return list(
        await asyncio.gather(
            *(ask(handle, [{"role": "user", "content": f"topic {i} " * 100}]) for i in range(6))
        )
    )


def test_router_queue_holds_requests_while_the_replica_is_saturated(serve_app: Callable[..., Any]) -> None:
    """One replica with a 64-token chunk budget: a request of ~400 new prompt tokens saturates it,
    so the next ones wait in the router's queue and go out as requests complete; none is lost and
    the queue's counters are back to zero."""
    handle = serve_app(1, router_kwargs={"router_queue": {"ttl_s": 60}}, max_num_batched_tokens=64)
    asyncio.run(ask(handle, [{"role": "user", "content": "warm up"}]))
    router = router_of(handle)
    assert router.queue is not None
    wait_for(
        lambda: any("max_num_batched_tokens" in (r.routing_stats or {}) for r in router._by_rid.values())
    )
    wait_for(lambda: len(router.inflight) == 0)

    async def run() -> list[dict[str, Any]]:
        asks = [
            ask(handle, [{"role": "user", "content": f"request {k} " + "word " * 400}], 4) for k in range(4)
        ]
        return list(await asyncio.gather(*asks))

    outs = asyncio.run(run())
    assert len(outs) == 4 and all(o["usage"]["completion_tokens"] == 4 for o in outs)
    q = router.queue
    assert q.enqueued > 0 and q.dispatched == q.enqueued and q.expired == q.cancelled == 0
    assert len(q) == 0 and q.depth == {}
    wait_for(lambda: len(router.inflight) == 0)
