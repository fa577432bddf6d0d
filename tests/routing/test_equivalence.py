"""The live router's core and the simulator's router decide alike.

Both drivers are built as they build themselves (:class:`~kvroute.server.state.router.RouterState` from a
router config, :func:`~kvroute.sim.cluster.sim_router` from a simulation config) and fed the same
traffic through their own conventions:

- **exact**: real engine models produce the KV events. The live side's engines hash blocks their own
  way (private hashes, as vLLM does) and send the token ids, which the router re-hashes; the
  simulator's engines hash with the router's chain, as the workloads' block ids are.
- **approximate**: each side records where it sent a request and corrects itself from the engine's
  real ``cached_tokens`` when the request finishes.

The live side routes from the request body (token-id prompts through the live router's prepare and decide stages, :mod:`kvroute.server.stages`); the
simulator from a :class:`~kvroute.routing.core.RouteRequest` built from the block chain. Every
decision, with every candidate's terms, must be the same.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvroute.blocks import hash_blocks
from kvroute.engine.model import EngineModel
from kvroute.engine.types import EngineConfig, EngineRequest, OutputKind
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.core import RouteRequest, build_policy
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.stages.decide import decide
from kvroute.server.stages.prepare import prepare_inline
from kvroute.server.state.backends import ScrapedMetrics
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import parse_request
from kvroute.sim.cluster import SimConfig, sim_router

BS = 16
N = 3
BLOCKS = 40  # small pools: evictions happen, so BlockRemoved and the LRU matter


class _UnitCost:
    """A step takes 10 ms plus 0.1 ms per token: deterministic and cheap."""

    name = "unit"

    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        return 0.01 + 1e-4 * (sum(n for _, n in prefill) + num_decode)


def _traffic(seed: int, n: int) -> list[list[int]]:
    """Prompts (token ids) sharing a few prefixes, some repeated whole (fully cached)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(rng.randrange(20, 120))] for _ in range(4)]
    out: list[list[int]] = []
    for _ in range(n):
        if out and rng.random() < 0.15:
            out.append(list(rng.choice(out)))
            continue
        out.append(rng.choice(prefixes) + [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 70))])
    return out


@pytest.mark.parametrize("mode", ["exact", "approx"])
@pytest.mark.parametrize("policy", ["lmetric", "vllm", "llm-d", "sglang", "lmetric+hotspot"])
def test_live_and_simulated_cores_decide_alike(mode: str, policy: str) -> None:
    features = None
    base = policy
    if policy.endswith("+hotspot"):
        base = policy.split("+")[0]
        features = FeatureConfig(hotspot=HotspotConfig(window_s=5.0, class_tokens=32))
    now = [0.0]
    live = RouterState(
        RouterConfig(
            backends=tuple(
                BackendSpec(f"http://b{i}:1", kv_events="tcp://127.0.0.1:1" if mode == "exact" else None)
                for i in range(N)
            ),
            block_size=BS,
            approx_capacity_blocks=BLOCKS,
            approx_ttl_s=1e9,
            features=features,
        ),
        RequestTokenizer(None),  # type: ignore[arg-type]  # prompts are token ids: never used
        make_policy(base),
        clock=lambda: now[0],
    )
    sim = sim_router(
        SimConfig(instances=N, kv_capacity_tokens=BLOCKS * BS, kv_view=mode),
        build_policy(base, features),
        BS,
        BLOCKS,
    )
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=256, num_kv_blocks=BLOCKS, block_size=BS)
    live_engines = [EngineModel(cfg, _UnitCost()) for _ in range(N)]
    sim_engines = [EngineModel(cfg, _UnitCost()) for _ in range(N)]
    inflight: dict[int, tuple[int, tuple[int, ...], int]] = {}  # req -> (instance, chain, predicted blocks)

    def advance(t: float) -> None:
        for i in range(N):
            for eng, core in ((live_engines[i], live.kv), (sim_engines[i], sim.kv)):
                while (nt := eng.next_time()) is not None and nt <= t:
                    outs = eng.advance(nt)
                    if mode == "exact":
                        core.apply_events(i, eng.take_events())
                    for o in outs:
                        if o.kind is OutputKind.FINISHED and mode == "approx":
                            inst, chain, predicted = inflight[int(o.req_id)]
                            core.on_usage(inst, chain, o.num_cached_tokens, predicted, o.time)
                if mode == "exact":
                    core.apply_events(i, eng.take_events())

    decisions = 0
    reasons: set[str] = set()
    rng = random.Random(7)
    for k, ids in enumerate(_traffic(11, 80)):
        now[0] = t = 0.02 * k
        advance(t)
        # The same engine load reaches both: the live side through its scrape, the simulator directly.
        for i, b in enumerate(live.backends):
            st = sim_engines[i].stats()
            b.scraped = ScrapedMetrics(st.running, st.waiting, st.kv_usage, t, BLOCKS)
            b.table.clear_own(b.slot)
            b.table.add(b.slot, prefill=rng.randrange(0, 64))
        views = [b.view(t, 1.0) for b in live.backends]
        body = b'{"model": "m", "prompt": %s, "max_tokens": 3}' % str(ids).encode()
        parsed = parse_request(body, chat=False)
        prep = prepare_inline(live, parsed)
        assert list(prep.ids) == ids
        plan = decide(live, parsed, prep)
        chain = tuple(hash_blocks(ids, BS))
        assert plan.chain == chain
        got = sim.route(RouteRequest(chain, len(ids), 3, req_class="default"), views, t)
        assert got == plan.decision, f"request {k}"
        assert got.candidates == plan.decision.candidates
        reasons.add(got.reason)
        decisions += 1
        inst = got.instance
        assert inst is not None
        predicted = got.cached_on(inst) // BS
        inflight[k] = (inst, chain, predicted)
        live.kv.on_routed(inst, chain, t)
        sim.kv.on_routed(inst, chain, t)
        private = tuple(hash_blocks(ids, BS, extra_key="engine-private"))
        live_engines[inst].add_request(EngineRequest(k, len(ids), 3, private, tuple(ids)), t)
        sim_engines[inst].add_request(EngineRequest(k, len(ids), 3, chain), t)
    assert decisions == 80
    # the scenario exercised what it is about: cache hits steered decisions somewhere
    hits = [sim.kv.match(tuple(hash_blocks(ids, BS)), now[0]) for ids in _traffic(11, 80)[:10]]
    assert any(any(h) for h in hits)
    if features is not None:
        assert reasons <= {"policy", "hotspot"}


def test_fully_cached_prompts_are_still_ordered_by_load() -> None:
    """P-token is never below the one token the engine recomputes: a prompt cached everywhere goes to
    the least loaded instance, not to a tie at P-token 0."""
    cfg = SimConfig(instances=2, kv_capacity_tokens=10 * BS, kv_view="approx")
    sim = sim_router(cfg, make_policy("lmetric"), BS, 10)
    chain = tuple(range(1, 5))  # 4 blocks = 64 tokens
    for i in (0, 1):
        sim.kv.on_routed(i, chain, 0.0)
    from kvroute.views import InstanceView

    views = [InstanceView(0, running=5), InstanceView(1, running=1)]
    d = sim.route(RouteRequest(chain, 4 * BS), views, 0.0)
    assert d.instance == 1
    assert d.cached_tokens == (3 * BS, 3 * BS)  # the last block is recomputed, as vLLM does
    assert [c.p_token for c in d.candidates] == [BS, BS]
