"""The peers' LMetric variants in the simulator: their own bookkeeping is driven by the simulated
requests' first tokens and finishes, and is back to zero when every request finished."""

from __future__ import annotations

import pytest

from kvroute.engine.cost import get_profile
from kvroute.policies.registry import PEER_LMETRICS, make_policy
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.workloads.request import Request


def shared_prefix(n: int) -> list[Request]:
    """n requests 50 ms apart, each a 512-token shared prefix plus 256 tokens of its own."""
    return [
        Request(i, 0.05 * i, 768, 8, tuple(range(32)) + tuple(10_000 * (i + 1) + b for b in range(16)), 16)
        for i in range(n)
    ]


@pytest.mark.parametrize("name", PEER_LMETRICS)
def test_peer_variant_runs_and_settles(name: str) -> None:
    profile = get_profile()
    cfg = SimConfig(instances=3, kv_capacity_tokens=profile.kv_capacity_tokens)
    pol = make_policy(name)
    out = ClusterSim(cfg, pol, profile.cost).run(iter(shared_prefix(40)))
    assert out["requests"] == 40 and out["unfinished"] == 0
    assert out["kv_hit_rate"] > 0.3  # the shared prefix is reused
    if name == "aibrix-lmetric":
        assert all(pol.pending(i) == (0, 0) for i in range(3))  # type: ignore[attr-defined]
    if name == "vllm-router-smetric":
        assert all(w.pending == 0 for w in pol._workers.values())  # type: ignore[attr-defined]
        assert any(pol.rate(i) is not None for i in range(3))  # type: ignore[attr-defined]
