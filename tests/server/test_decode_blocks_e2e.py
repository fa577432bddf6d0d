"""``decode_blocks`` end to end: the live router's view of an emulated engine (over real HTTP) and the
simulator's view of the same engine model in the same situation agree, as :mod:`kvroute.views` defines
it: the blocks of the requests the engine has started, not of one still queued there.

The situation: an engine with one sequence slot (``max_num_seqs`` 1) decodes a 161-token request A
(11 blocks of 16 tokens, and still 11 for its next 15 tokens); a 320-token request B (20 blocks) waits
in the engine's queue. The engine runs 100 times slower than the cost model (``time_scale`` 0.01:
about 0.46 s of wall time per decode step), so A holds 11 blocks for several seconds of wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence

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


def simulated_view() -> InstanceView:
    """The simulator's view of one such engine when a third request arrives while A decodes and B
    waits (after a load copy: B's optimistic entry is gone)."""

    def req(i: int, at: float, ids: list[int], out: int) -> Request:
        return Request(i, at, len(ids), out, tuple(range(ids[0], ids[0] + len(ids) // BLOCK)), BLOCK)

    policy = Recording()
    config = SimConfig(instances=1, kv_capacity_tokens=POOL * BLOCK, max_num_seqs=1)
    workload = [req(0, 0.0, A_IDS, 40), req(1, 0.05, B_IDS, 4), req(2, 0.2, [3000] * 32, 1)]
    ClusterSim(config, policy, COST).run(iter(workload))
    (prompt, (view,)) = policy.seen[-1]
    assert prompt == 32
    return view


async def test_live_and_simulated_views_agree_on_an_engine_queued_request(tokenizer: Tokenizer) -> None:
    sim = simulated_view()
    assert (sim.running, sim.waiting, sim.queued_prefill_tokens, sim.decode_blocks) == (1, 1, 320, 11)

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
    )
    router = RouterServer(cfg, tokenizer=tokenizer)
    url = await router.start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as s:
            a = await s.post(
                url + "/v1/completions",
                json={"model": "emu", "prompt": A_IDS, "max_tokens": 200, "stream": True},
            )
            assert a.status == 200
            assert (await a.content.readline()).startswith(b"data: ")  # A started: first byte back
            b_task = asyncio.create_task(
                s.post(
                    url + "/v1/completions",
                    json={"model": "emu", "prompt": B_IDS, "max_tokens": 4, "stream": True},
                )
            )
            view: dict[str, object] = {}
            for _ in range(500):  # B queued at the engine and a scrape since: up to ~10 s on a loaded machine
                stats = engine.model.stats()
                async with s.get(url + "/debug/state", headers=auth) as r:
                    (backend,) = (await r.json())["backends"]
                view = backend["view"]
                if stats.waiting == 1 and view["kv_capacity_blocks"] == POOL and view["waiting"] == 1:
                    break
                await asyncio.sleep(0.02)
            assert engine.model.stats().running == 1 and engine.model.stats().waiting == 1
            held = engine.model.load().decode_blocks  # A's blocks, the engine's own count
            assert held == 11, "A decoded past its 11th block: the machine is too slow for this test"
            live = (view["running"], view["waiting"], view["queued_prefill_tokens"], view["decode_blocks"])
            assert live == (sim.running, sim.waiting, sim.queued_prefill_tokens, sim.decode_blocks)
            assert view["kv_capacity_blocks"] == sim.kv_capacity_blocks
            # B never started: its 20 blocks are nowhere in the router's count
            assert router.state.backends[0].blocks == 11
            # Both clients go away: B before its first byte (still queued), then A after it.
            b_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await b_task
            a.close()
        for _ in range(500):
            b0, st = router.state.backends[0], engine.model.stats()
            if (b0.waiting, b0.running, b0.queued_prefill, b0.blocks, st.running, st.waiting) == (0,) * 6:
                break
            await asyncio.sleep(0.02)
        b0, st = router.state.backends[0], engine.model.stats()
        assert (b0.waiting, b0.running, b0.queued_prefill, b0.blocks) == (0, 0, 0, 0)
        assert (st.running, st.waiting) == (0, 0)  # the engine dropped both
    finally:
        await router.stop()
        await engine.stop()
