"""EngineHost on its two clocks: the simulator's event loop (same outputs, events and event order as
the host loop the simulator used to write out by hand) and the wall clock on a real asyncio loop."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from kvroute.emulator.clock import WallClock
from kvroute.engine.host import EngineHost
from kvroute.engine.model import EngineModel
from kvroute.engine.types import (
    BlockStored,
    EngineConfig,
    EngineOutput,
    EngineRequest,
    KVEvent,
    OutputKind,
)
from kvroute.sim.loop import PRIO_ARRIVAL, PRIO_ENGINE, EventLoop, SimClock

from .test_model import AffineCost, make_req

CFG = EngineConfig(num_kv_blocks=400, max_num_seqs=8, max_num_batched_tokens=512)


def workload(seed: int, n: int = 40) -> list[tuple[float, EngineRequest]]:
    """Arrivals spread over ~2 s with shared prefixes (so there are hits, evictions, stretches)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1 << 40) for _ in range(20)) for _ in range(3)]
    t, out = 0.0, []
    for rid in range(n):
        t += rng.expovariate(20.0)
        req = make_req(rid, rng.randrange(16, 320), rng.randrange(1, 60), rng.choice(prefixes))
        out.append((t, req))
    return out


def by_hand(arrivals: list[tuple[float, EngineRequest]]) -> list[tuple[Any, ...]]:
    """The simulator's former host loop (ClusterSim._after_engine / _wake), for reference."""
    loop = EventLoop()
    eng = EngineModel(CFG, AffineCost())
    log: list[tuple[Any, ...]] = []
    wake: list[float | None] = [None]

    def after(now: float) -> None:
        for o in eng.advance(now):
            log.append(("out", loop.now, o))
        events = eng.take_events()
        if events:
            log.append(("events", loop.now, events))
        nt = eng.next_time()
        if nt is not None and nt != wake[0]:
            wake[0] = nt
            loop.schedule(nt, PRIO_ENGINE, on_wake, nt)
        elif nt is None:
            wake[0] = None

    def on_wake(t: float) -> None:
        if wake[0] != t:
            return
        wake[0] = None
        log.append(("wake", t))
        after(t)

    def arrive(req: EngineRequest) -> None:
        eng.add_request(req, loop.now)
        after(loop.now)

    for t, req in arrivals:
        loop.schedule(t, PRIO_ARRIVAL, arrive, req)
    loop.run_until()
    return log


def on_sim_clock(arrivals: list[tuple[float, EngineRequest]]) -> tuple[list[tuple[Any, ...]], EngineHost]:
    loop = EventLoop()
    log: list[tuple[Any, ...]] = []

    class LoggingClock(SimClock):  # logs the wake-ups that are not superseded
        def call_at(self, when: float, fn: Callable[[float], object]) -> None:
            def logged(t: float) -> None:
                if host.wake == t:
                    log.append(("wake", t))
                fn(t)

            super().call_at(when, logged)

    host = EngineHost(
        EngineModel(CFG, AffineCost()),
        LoggingClock(loop),
        lambda outs: log.extend(("out", loop.now, o) for o in outs),
        lambda events: log.append(("events", loop.now, events)),
    )
    for t, req in arrivals:
        loop.schedule(t, PRIO_ARRIVAL, host.add, req)
    loop.run_until()
    return log, host


def test_sim_clock_matches_the_hand_written_host_loop() -> None:
    for seed in range(3):
        arrivals = workload(seed)
        log, host = on_sim_clock(arrivals)
        assert log == by_hand(arrivals)
        outs = [e[2] for e in log if e[0] == "out"]
        finished = {o.req_id for o in outs if o.kind is OutputKind.FINISHED}
        assert finished == {req.req_id for _, req in arrivals}  # every output delivered
        assert any(e[0] == "events" for e in log)  # KV events delivered
        assert sum(e[0] == "wake" for e in log) > len(arrivals)  # rescheduled after each step
        assert host.wake is None and host.engine.idle


def test_sim_clock_ignores_superseded_wake_ups() -> None:
    """An arrival mid-stretch moves the step end earlier: the old wake-up fires and does nothing."""
    loop = EventLoop()
    eng = EngineModel(EngineConfig(num_kv_blocks=400), AffineCost())
    outs: list[EngineOutput] = []
    host = EngineHost(eng, SimClock(loop), outs.extend)
    loop.schedule(0.0, PRIO_ARRIVAL, host.add, make_req(1, 32, 200))
    loop.run_until(0.1)
    first_wake = host.wake
    assert first_wake is not None and first_wake > 1.0  # a long decode stretch
    loop.schedule(0.5, PRIO_ARRIVAL, host.add, make_req(2, 32, 5))
    loop.run_until(0.5)
    assert host.wake is not None and host.wake < first_wake  # cut at a step boundary after 0.5
    loop.run_until()
    assert [o.req_id for o in outs if o.kind is OutputKind.FINISHED] == [2, 1]
    assert host.wake is None and len(loop) == 0


def test_sim_clock_adds_requests_together() -> None:
    """Requests added in one call at the end of a step all join the next step (the simulator's
    preload requests); added one by one, the first would start that step alone."""
    for together in (True, False):
        loop = EventLoop()
        outs: list[EngineOutput] = []
        host = EngineHost(EngineModel(CFG, AffineCost()), SimClock(loop), outs.extend)
        loop.schedule(0.0, PRIO_ARRIVAL, host.add, make_req(0, 64, 50))
        loop.run_until(0.0)
        end = host.wake
        assert end is not None
        r1, r2 = make_req(1, 64, 1), make_req(2, 64, 1)
        if together:
            loop.schedule(end, PRIO_ARRIVAL, host.add, r1, r2)
        else:
            loop.schedule(end, PRIO_ARRIVAL, host.add, r1)
            loop.schedule(end, PRIO_ARRIVAL, host.add, r2)
        loop.run_until()
        firsts = {o.req_id: o.time for o in outs if o.kind is OutputKind.FIRST_TOKEN}
        assert (firsts[1] == firsts[2]) is together


async def test_wall_clock_on_a_real_event_loop() -> None:
    """Model time runs 1000x faster than the wall: outputs, KV events and wake-ups arrive."""
    clock = WallClock(time_scale=1000.0)
    clock.start()
    outs: list[EngineOutput] = []
    events: list[KVEvent] = []
    eng = EngineModel(EngineConfig(num_kv_blocks=400, report_tokens=True), AffineCost())
    host = EngineHost(eng, clock, outs.extend, events.extend)
    tokens = list(range(64))
    t0 = host.add(EngineRequest("a", 64, 5, (11, 12, 13, 14), tuple(tokens)))
    host.add(EngineRequest("b", 40, 3, (11, 12)))
    assert host.wake is not None and clock.pending >= 1  # (a superseded one stays until it fires)
    for _ in range(200):
        if eng.idle:
            break
        await asyncio.sleep(0.005)
    assert eng.idle and host.wake is None and clock.pending == 0
    kinds = {rid: [o.kind for o in outs if o.req_id == rid] for rid in ("a", "b")}
    assert kinds["a"] == [OutputKind.FIRST_TOKEN] + [OutputKind.TOKEN] * 4 + [OutputKind.FINISHED]
    assert kinds["b"] == [OutputKind.FIRST_TOKEN] + [OutputKind.TOKEN] * 2 + [OutputKind.FINISHED]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored and stored[0].block_hashes == (11, 12, 13, 14) and stored[0].token_ids == tuple(tokens)
    times = [o.time for o in outs]
    assert times == sorted(times) and t0 <= times[0] and times[-1] <= clock.now()


async def test_wall_clock_close_cancels_wake_ups() -> None:
    clock = WallClock(time_scale=1.0)
    clock.start()
    outs: list[EngineOutput] = []
    host = EngineHost(EngineModel(CFG, AffineCost()), clock, outs.extend)
    host.add(make_req(1, 32, 100))
    assert clock.pending == 1
    clock.close()
    assert clock.pending == 0
    host.add(make_req(2, 32, 1))  # after close: nothing is scheduled
    assert clock.pending == 0
    await asyncio.sleep(0.05)
    assert outs == []
