"""``decode_blocks`` end to end: the live router's view of an emulated engine (over real HTTP) and the
simulator's view of the same engine model in the same situation agree, in the three phases of a
request as :mod:`kvroute.views` defines them: (1) routed, before the next scrape (copy): its prompt's
blocks count, on top of the engine's blocks in use; (2) queued at the engine after a scrape: not
counted (it holds none; its new tokens are the queued prefill); (3) decoding: counted, as the
engine's blocks in use.

The situation: an engine with one sequence slot (``max_num_seqs`` 1) decodes a 161-token request A
(11 blocks of 16 tokens, and still 11 for its next 15 tokens); a 320-token request B (20 blocks) is
routed and waits in the engine's queue until A ends. The engine runs 100 times slower than the cost
model (``time_scale`` 0.01: about 0.46 s of wall time per decode step), so A holds 11 blocks for
several seconds of wall time. The router scrapes once at its start and then only when the test
says (its scrape interval is an hour, its scrapes never stale), so each phase is a controlled state,
not a race with a timer; the test waits only for the engine and the router to reach each state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import aiohttp

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.tokenizer import Tokenizer
from kvroute.views import Choice, InstanceView, RequestView
from kvroute.workloads.request import Request

COST = costmod.get_profile(costmod.DEFAULT_PROFILE).cost
BLOCK = 16
POOL = 4096
A_IDS = list(range(1000, 1161))  # 161 tokens: 11 blocks, through token 176
B_IDS = list(range(2000, 2320))  # 320 tokens: 20 blocks
TOKEN = "t0ken"


class Recording:
    """A policy that records the views it is given and picks the first instance."""

    name = "recording"

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[InstanceView, ...]]] = []

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        self.seen.append((request.prompt_tokens, tuple(instances)))
        return Choice(0, tuple(0.0 for _ in instances), self.name)


def simulated_view(probe_at: float, b_out: int = 4, a_out: int = 40) -> InstanceView:
    """The simulator's view of one such engine (A at 0, B at 0.05 s) when a third request arrives at
    ``probe_at`` seconds (the simulator copies the engine's load every 0.05 s)."""

    def req(i: int, at: float, ids: list[int], out: int) -> Request:
        return Request(i, at, len(ids), out, tuple(range(ids[0], ids[0] + len(ids) // BLOCK)), BLOCK)

    policy = Recording()
    config = SimConfig(instances=1, kv_capacity_tokens=POOL * BLOCK, max_num_seqs=1)
    assert config.scrape_interval == 0.05
    workload = [req(0, 0.0, A_IDS, a_out), req(1, 0.05, B_IDS, b_out), req(2, probe_at, [3000] * 32, 1)]
    ClusterSim(config, policy, COST).run(iter(workload))
    (prompt, (view,)) = policy.seen[-1]
    assert prompt == 32
    return view


def numbers(view: InstanceView | dict[str, int]) -> tuple[int, int, int, int]:
    """(running, waiting, queued prefill tokens, decode blocks) of a view or ``/debug/state``'s."""
    if isinstance(view, InstanceView):
        return (view.running, view.waiting, view.queued_prefill_tokens, view.decode_blocks)
    return (view["running"], view["waiting"], view["queued_prefill_tokens"], view["decode_blocks"])


def test_the_simulators_three_phases() -> None:
    """The simulator's side alone (no sockets): B just routed, B queued after a copy, B decoding."""
    # (1) 0.01 s after B was routed, before the next copy: its optimistic entry adds its 20 blocks
    assert numbers(simulated_view(0.06)) == (1, 1, 320, 11 + 20)
    # (2) after a copy, B queued at the engine: A's 11 blocks only
    assert numbers(simulated_view(0.2)) == (1, 1, 320, 11)
    # (3) A ended, B decodes: its blocks (20 and its decoded tokens') are the engine's in use
    running, waiting, queued, blocks = numbers(simulated_view(0.5, b_out=400))
    assert (running, waiting, queued) == (1, 0, 0) and blocks > 20


async def test_live_and_simulated_views_agree_in_the_three_phases(tokenizer: Tokenizer) -> None:
    engine = EmulatorServer(
        EmulatorSettings(
            model_name="emu",
            engine=EngineConfig(max_num_seqs=1, num_kv_blocks=POOL, block_size=BLOCK, report_tokens=True),
            time_scale=0.01,
        ),
        COST,
        tokenizer,
    )
    port = await engine.start("127.0.0.1", 0)
    cfg = RouterConfig(
        backends=(BackendSpec(f"http://127.0.0.1:{port}"),),
        port=0,
        block_size=BLOCK,
        admin_token=TOKEN,
        health_interval_s=0.2,
        scrape_interval_s=3600.0,  # one scrape at the start; the others are the test's
        scrape_idle_interval_s=3600.0,
        scrape_stale_s=3600.0,
    )
    router = RouterServer(cfg, tokenizer=tokenizer)
    url = await router.start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    backend = router.state.backends[0]

    async def until(cond: Callable[[], bool], what: str) -> None:
        for _ in range(1000):  # up to ~20 s on a loaded machine
            if cond():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    async def live_view(s: aiohttp.ClientSession) -> dict[str, int]:
        """``/debug/state``'s view of the backend; its own counters too (``blocks``, ``pending``)."""
        async with s.get(url + "/debug/state", headers=auth) as r:
            (b,) = (await r.json())["backends"]
        return {**b["view"], "blocks": b["blocks"], "pending": b["pending_blocks"]}

    try:
        await until(lambda: backend.scraped is not None, "the first scrape")
        async with aiohttp.ClientSession() as s:
            a = await s.post(
                url + "/v1/completions",
                json={"model": "emu", "prompt": A_IDS, "max_tokens": 200, "stream": True},
            )
            assert a.status == 200
            assert (await a.content.readline()).startswith(b"data: ")  # A started: first byte back
            await router.monitor.scrape(backend)  # the engine's copy: A running, its 11 blocks
            assert engine.model.load().decode_blocks == 11, "A decoded past its 11th block: too slow"
            b_task = asyncio.create_task(
                s.post(
                    url + "/v1/completions",
                    json={"model": "emu", "prompt": B_IDS, "max_tokens": 400, "stream": True},
                )
            )
            await until(lambda: engine.model.stats().waiting == 1, "B queued at the engine")
            # (1) B routed, no scrape since: its 20 blocks are pending, on top of the engine's 11
            view = await live_view(s)
            assert numbers(view) == numbers(simulated_view(0.06)) == (1, 1, 320, 31)
            assert (view["blocks"], view["pending"]) == (31, 20)
            # (2) a scrape began after B was routed: the engine's copy covers B, queued, holding none
            await router.monitor.scrape(backend)
            assert engine.model.load().decode_blocks == 11, "A decoded past its 11th block: too slow"
            view = await live_view(s)
            assert (view["blocks"], view["pending"]) == (31, 0)
            assert view["kv_capacity_blocks"] == POOL
            assert numbers(view) == numbers(simulated_view(0.2)) == (1, 1, 320, 11)
            # (3) A's client goes away (the engine aborts A), B starts and decodes
            a.close()
            b = await b_task
            assert b.status == 200
            assert (await b.content.readline()).startswith(b"data: ")  # B's first byte
            await until(lambda: engine.model.stats().running == 1, "B decoding")
            for _ in range(20):  # a scrape with no block boundary crossed while it ran
                held = engine.model.load().decode_blocks  # B's blocks, the engine's own count
                await router.monitor.scrape(backend)
                live = numbers(await live_view(s))
                if engine.model.load().decode_blocks == held:
                    break
            sim = numbers(simulated_view(0.5, b_out=400))
            assert held >= 20 and live == (1, 0, 0, held) and sim[:3] == live[:3] and sim[3] >= 20
            assert (backend.waiting, backend.running, backend.blocks, backend.pending) == (0, 1, 20, 0)
            b.close()
        await until(
            lambda: (
                (backend.waiting, backend.running, backend.queued_prefill, backend.blocks, backend.pending)
                == (0,) * 5
                and engine.model.stats().running == engine.model.stats().waiting == 0
            ),
            "both requests gone",
        )
    finally:
        await router.stop()
        await engine.stop()
