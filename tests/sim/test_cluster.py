"""The cluster simulator: contract, accounting, determinism, routing behaviour, CLI errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands.settings import sim_command
from kvroute.engine.cost import get_profile
from kvroute.engine.host import EngineHost
from kvroute.policies.registry import DEFAULT_POLICY, make_policy
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.sim.loop import EventLoop
from kvroute.sim.runner import RunSpec, run_spec
from kvroute.workloads.request import Request

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
MOONCAKE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
CONTRACT_KEYS = {
    "policy", "instances", "requests", "unfinished", "ttft_ms", "tpot_ms", "e2e_ms",
    "kv_hit_rate", "sim_seconds", "wall_seconds",
}  # fmt: skip


def burst(n: int, prompt: int = 1024, out: int = 20) -> Iterator[Request]:
    """n unrelated requests arriving together at t=0 (unique blocks)."""
    for i in range(n):
        yield Request(i, 0.0, prompt, out, tuple(1_000_000 * (i + 1) + b for b in range(prompt // 16)), 16)


def test_event_loop_orders_by_time_priority_then_insertion() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.schedule(2.0, 0, seen.append, "late")
    loop.schedule(1.0, 2, seen.append, "engine")
    loop.schedule(1.0, 1, seen.append, "arrival-a")
    loop.schedule(1.0, 1, seen.append, "arrival-b")
    loop.run_until()
    assert seen == ["arrival-a", "arrival-b", "engine", "late"]
    with pytest.raises(ValueError):
        loop.schedule(1.0, 0, seen.append, "past")


def test_optimistic_counters_spread_a_burst_despite_stale_load() -> None:
    """16 simultaneous requests, load copies refreshed only every 10 s: without the router's own
    counters every request would see 16 idle instances and land on instance 0."""
    profile = get_profile()
    cfg = SimConfig(instances=16, kv_capacity_tokens=profile.kv_capacity_tokens, scrape_interval=10.0)
    sim = ClusterSim(cfg, make_policy("lmetric"), profile.cost)
    sim.run(burst(16))
    loads = [inst.engine.stats().prefix_query_tokens for inst in sim._insts]
    assert loads == [1024] * 16


def test_all_requests_accounted_and_counters_back_to_idle() -> None:
    profile = get_profile()
    cfg = SimConfig(instances=2, kv_capacity_tokens=20_000)
    sim = ClusterSim(cfg, make_policy("round-robin"), profile.cost)
    out = sim.run(burst(40, prompt=2048, out=200))
    assert out["requests"] == 40 and out["unfinished"] == 0
    for inst in sim._insts:
        s = inst.engine.stats()
        assert (s.running, s.waiting, s.used_blocks, s.queued_prefill_tokens) == (0, 0, 0, 0)
        inst.engine.pool.check()
    assert out["preemptions"] > 0  # 20k tokens of KV for 20 × 2.2k-token requests per instance


def test_request_too_large_for_any_instance_is_counted_not_lost() -> None:
    profile = get_profile()
    cfg = SimConfig(instances=2, kv_capacity_tokens=4096)
    out = ClusterSim(cfg, make_policy("lmetric"), profile.cost).run(burst(3, prompt=8192))
    assert out["requests"] == 3 and out["rejected"] == 3 and out["unfinished"] == 3


def test_same_spec_same_result_and_contract_fields() -> None:
    spec = RunSpec(policy="lmetric", instances=4, workload="chatbot", duration=30, seed=3)
    a, b = run_spec(spec), run_spec(spec)
    assert set(a) >= CONTRACT_KEYS
    for k in ("requests", "ttft_ms", "tpot_ms", "e2e_ms", "kv_hit_rate", "sim_seconds"):
        assert a[k] == b[k]
    assert a["requests"] > 50 and a["unfinished"] == 0
    assert sim_command(spec).startswith(
        "kvroute sim --workload chatbot --duration 30 --instances 4 --policy lmetric"
    )


def test_cache_aware_policy_reuses_the_cache_more_than_round_robin() -> None:
    base = dict(instances=8, workload="chatbot", duration=60, seed=1)
    lm = run_spec(RunSpec(policy="lmetric", **base))  # type: ignore[arg-type]
    rr = run_spec(RunSpec(policy="round-robin", **base))  # type: ignore[arg-type]
    assert lm["kv_hit_rate"] > rr["kv_hit_rate"] + 0.08  # system prompts are cached everywhere anyway
    assert lm["ttft_ms"]["mean"] < rr["ttft_ms"]["mean"]


def test_approximate_kv_view_also_finds_the_prefixes() -> None:
    base = dict(policy="lmetric", instances=8, workload="chatbot", duration=60, seed=1)
    exact = run_spec(RunSpec(**base))  # type: ignore[arg-type]
    approx = run_spec(RunSpec(kv_view="approx", **base))  # type: ignore[arg-type]
    assert approx["kv_hit_rate"] > 0.5 * exact["kv_hit_rate"] > 0


def test_cli_writes_contract_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "o.json"
    rc = main(["sim", "--workload", "coder", "--duration", "20", "--instances", "4", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data) >= CONTRACT_KEYS
    assert set(data["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert f"| {DEFAULT_POLICY} |" in capsys.readouterr().out


def test_cli_bad_trace_line_names_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    good = {"timestamp": 0, "input_length": 1024, "output_length": 5, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(good) + "\n{not json\n" + json.dumps({**good, "timestamp": 10}) + "\n")
    rc = main(["sim", "--trace", str(trace), "--format", "mooncake", "--instances", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{trace}:2" in err and "Traceback" not in err
    rc = main(["sim", "--trace", str(trace), "--format", "mooncake", "--instances", "2", "--skip-bad-lines"])
    captured = capsys.readouterr().out
    assert rc == 0 and "skipped 1 bad trace lines" in captured


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["sim", "--workload", "chatbot", "--instances", "0"], "--instances must be at least 1"),
        (["sim", "--workload", "chatbot", "--rate-scale", "-2"], "--rate-scale"),
        (["sim", "--workload", "chatbot", "--policy", "nope"], "valid policies: lmetric"),
        (["sim", "--workload", "chatbot", "--profile", "nope"], "valid: qwen3-30b-a3b-rtxpro6000-tp1"),
        (["sim", "--workload", "nope"], "unknown workload"),
        (["sim"], "give --trace FILE or --workload NAME"),
        (["sim", "--workload", "chatbot", "--instances", "x"], "invalid int value"),
    ],
)
def test_cli_nonsense_gives_one_line_error(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    *usage, last = capsys.readouterr().err.splitlines()  # a bad flag: argparse's usage block first
    assert needle in last and last.startswith(("kvroute: error: ", "kvroute sim: error: "))
    assert not usage or usage[0].startswith("usage: kvroute sim ")


@pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared (the Mooncake trace) is not beside this clone")
def test_mooncake_first_ten_minutes_all_accounted() -> None:
    out = run_spec(RunSpec(policy="lmetric", trace=str(MOONCAKE), duration=600))
    assert out["requests"] > 1500 and out["unfinished"] == 0 and out["rejected"] == 0
    assert 0.0 < out["kv_hit_rate"] < 1.0


def test_reproduce_command_carries_every_non_default_setting() -> None:
    spec = RunSpec(
        workload="coder", max_num_seqs=64, max_num_batched_tokens=2048, tp=2, seed=5, kv_view="approx"
    )
    cmd = sim_command(spec)
    for flag in (
        "--max-num-seqs 64",
        "--max-num-batched-tokens 2048",
        "--tp 2",
        "--seed 5",
        "--kv-view approx",
    ):
        assert flag in cmd
    assert "--max-num-seqs" not in sim_command(RunSpec(workload="coder"))


@pytest.mark.parametrize("interval", [0.0, 0.05, 1.0])
def test_cached_routing_views_match_a_fresh_pass_per_request(
    interval: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_all_views`` skips instances while no load copy is due and engine copies while the engine
    is unchanged; the run must equal one that builds every view every time, as before."""
    spec = RunSpec(
        policy="lmetric",
        instances=4,
        workload="chatbot",
        rate_scale=4.0,
        duration=40.0,
        scrape_interval=interval,
    )
    fast = run_spec(spec)

    def every_view(self: ClusterSim, now: float) -> list:
        for inst in self._insts:
            inst.snap_version = -1  # always copy the engine's stats
        return [self._view(i, inst, now) for i, inst in enumerate(self._insts)]

    monkeypatch.setattr(ClusterSim, "_all_views", every_view)
    slow = run_spec(spec)
    for out in (fast, slow):
        out.pop("wall_seconds")
    assert fast == slow and fast["requests"] > 50


def test_engine_version_changes_whenever_its_stats_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The staleness test behind the cached views: equal ``version`` implies equal ``stats()``; and
    ``load()`` is the part of ``stats()`` the router copies."""
    profile = get_profile()
    cfg = SimConfig(instances=2, kv_capacity_tokens=20_000)
    sim = ClusterSim(cfg, make_policy("lmetric"), profile.cost)
    seen: dict[tuple[int, int], object] = {}
    original = EngineHost._run

    def spy(host: EngineHost, now: float) -> None:
        original(host, now)
        for k, inst in enumerate(sim._insts):
            stats = inst.engine.stats()
            assert seen.setdefault((k, inst.engine.version), stats) == stats
            s = stats
            assert inst.engine.load() == (
                s.running,
                s.waiting,
                s.queued_prefill_tokens,
                s.kv_usage,
                s.num_kv_blocks,
                s.used_blocks,
            )

    monkeypatch.setattr(EngineHost, "_run", spy)
    sim.run(burst(30, prompt=2048, out=50))
    assert len(seen) > 10
