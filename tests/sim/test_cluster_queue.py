"""The simulator with the router-side queue: same results when it never engages, every request
accounted when it does, the TTL, ticks, flags and the reproduce command."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands.settings import sim_command
from kvroute.engine.cost import get_profile
from kvroute.policies.registry import make_policy
from kvroute.routing.queue import QueueConfig
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.sim.runner import RunSpec, run_spec
from kvroute.workloads.request import Request


def burst(n: int, prompt: int, out: int = 4, at: float = 0.0) -> Iterator[Request]:
    """n unrelated requests arriving together (unique blocks)."""
    for i in range(n):
        yield Request(i, at, prompt, out, tuple(1_000_000 * (i + 1) + b for b in range(prompt // 16)), 16)


def _sim(instances: int, queue: QueueConfig | None, budget: int = 512) -> ClusterSim:
    profile = get_profile()
    cfg = SimConfig(
        instances=instances,
        kv_capacity_tokens=profile.kv_capacity_tokens,
        max_num_batched_tokens=budget,
        scrape_interval=0.0,
        router_queue=queue,
    )
    return ClusterSim(cfg, make_policy("lmetric"), profile.cost)


def test_light_load_is_identical_with_and_without_the_queue() -> None:
    base = RunSpec(policy="lmetric", instances=4, workload="chatbot", rate_scale=0.5, duration=30.0)
    off = run_spec(base)
    on = run_spec(_with_queue(base))
    assert on["router_queue"]["queued"] == 0  # never engaged at this load
    for key in ("requests", "unfinished", "ttft_ms", "tpot_ms", "kv_hit_rate"):
        assert on[key] == off[key]


def _with_queue(spec: RunSpec, **fields: float) -> RunSpec:
    return dataclasses.replace(spec, router_queue=QueueConfig(**fields))


def test_a_burst_waits_at_the_router_and_every_request_finishes() -> None:
    """8 long prompts on 2 instances with a 512-token budget: after two each the instances are
    saturated, the rest wait at the router and go out as the engines free; nothing is lost."""
    sim = _sim(2, QueueConfig())
    out = sim.run(burst(8, prompt=2048))
    assert out["requests"] == 8 and out["unfinished"] == 0
    rq = out["router_queue"]
    assert rq["queued"] > 0 and rq["dispatched"] == rq["queued"] and rq["left"] == 0
    assert rq["wait_ms"]["max"] > 0
    # TTFT counts the wait at the router (measured from arrival)
    assert out["ttft_ms"]["p99"] >= rq["wait_ms"]["max"]
    # the router's optimistic counters and the queue are back to zero
    assert len(sim.queue) == 0 and sim.queue.depth == {}  # type: ignore[arg-type,union-attr]
    assert all(not inst.opt and inst.opt_tokens == 0 for inst in sim._insts)


def test_without_the_queue_the_burst_goes_to_the_engines_at_once() -> None:
    out = _sim(2, None).run(burst(8, prompt=2048))
    assert out["unfinished"] == 0 and "router_queue" not in out


def test_ttl_drops_requests_that_waited_too_long() -> None:
    sim = _sim(1, QueueConfig(ttl_s=0.05))
    out = sim.run(burst(12, prompt=4096))
    rq = out["router_queue"]
    assert rq["expired"] > 0 and rq["left"] == 0
    assert out["unfinished"] == rq["expired"]  # expired requests are failures, counted, not lost
    assert out["requests"] == 12


def test_ticks_batch_decisions() -> None:
    sim = _sim(4, QueueConfig(tick_s=0.01))
    out = sim.run(burst(4, prompt=256, at=0.003))
    rq = out["router_queue"]
    # all four waited for the tick at 10 ms (7 ms) and were decided together, spread over 4 instances
    assert rq["queued"] == 4 and rq["wait_ms"]["p50"] == pytest.approx(7.0)
    assert [inst.engine.stats().prefix_query_tokens for inst in sim._insts] == [256] * 4


def test_queue_flags_reach_the_spec_and_the_reproduce_command(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    rc = main(
        "sim --workload chatbot --instances 2 --duration 5 --router-queue --queue-ttl 12 --queue-tick 0.01 "
        f"--no-progress --json {path}".split()
    )
    assert rc == 0
    data = json.loads(path.read_text())
    assert "router_queue" in data and "--router-queue --queue-ttl 12 --queue-tick 0.01" in data["command"]
    spec = _with_queue(RunSpec(workload="chatbot"), ttl_s=5.0)
    assert sim_command(spec).endswith("--router-queue --queue-ttl 5")


def test_queue_flags_with_the_queue_off_are_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    off = ["sim", "--workload", "chatbot", "--duration", "1", "--no-router-queue"]
    assert main([*off, "--queue-ttl", "3"]) != 0
    assert "--queue-ttl and --queue-tick need the router-side queue on" in capsys.readouterr().err
    # on by default in `kvroute sim`: its fields need no --router-queue; the summary says the queue's state
    assert main(["sim", "--workload", "chatbot", "--duration", "1", "--queue-ttl", "3", "--no-progress"]) == 0
    assert "router-side queue: 0 held back (0 past the TTL)" in capsys.readouterr().out
    assert main([*off, "--no-progress"]) == 0
    assert "router-side queue: off" in capsys.readouterr().out
    assert (
        main(["sim", "--workload", "chatbot", "--duration", "1", "--router-queue", "--queue-ttl", "-1"]) != 0
    )
    assert "ttl_s must be a positive" in capsys.readouterr().err


class _Recording:
    """A policy that remembers whether each request it routed was behind the router-side queue."""

    name = "recording"

    def __init__(self) -> None:
        self.inner = make_policy("lmetric")
        self.gated: list[bool] = []

    def choose(self, request, instances):  # type: ignore[no-untyped-def]
        self.gated.append(request.gated)
        return self.inner.choose(request, instances)


@pytest.mark.parametrize("queue", [QueueConfig(), None])
def test_the_policy_knows_whether_it_routes_behind_the_queue(queue: QueueConfig | None) -> None:
    """Every decision the queue asks for says so once, in the request view (the policy reads it with
    each view's chunk budget: ``kvroute.views.held_back``); without the queue none does."""
    profile = get_profile()
    cfg = SimConfig(instances=2, kv_capacity_tokens=profile.kv_capacity_tokens, router_queue=queue)
    policy = _Recording()
    ClusterSim(cfg, policy, profile.cost).run(burst(6, prompt=2048))  # type: ignore[arg-type]
    assert len(policy.gated) >= 6 and set(policy.gated) == {queue is not None}
