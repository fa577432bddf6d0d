"""The features inside the simulator: flags → RunSpec → Guarded; hot-spot workload; scale-out with cold
start and preloads; cache reset; quotas; per-class output; CLI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands.settings import sim_command
from kvroute.engine.cost import get_profile
from kvroute.engine.types import AllBlocksCleared
from kvroute.features.classes import ClassConfig
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.limits import QuotaConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import DEFAULT_POLICY, make_policy
from kvroute.routing.guarded import Guarded
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.sim.runner import RunSpec, SimScenario, run_spec
from kvroute.workloads import make_workload


def _run(guard: Guarded | None, instances: int, workload: object) -> dict[str, object]:
    prof = get_profile()
    cfg = SimConfig(instances=instances, kv_capacity_tokens=prof.kv_capacity_tokens)
    return ClusterSim(cfg, guard or make_policy("lmetric"), prof.cost).run(workload)  # type: ignore[arg-type]


def test_hotspot_workload_meets_the_condition_and_mitigation_spreads_the_prefix() -> None:
    small = {"rate": 12.0, "hot_start_s": 5.0, "hot_ramp_s": 20.0, "duration_s": 60.0}
    feats = FeatureConfig(hotspot=HotspotConfig(), monitor=ScoreMonitorConfig())
    g = Guarded(make_policy("lmetric"), feats)
    out = _run(g, 8, make_workload("hotspot", seed=0, **small))
    hs = out["features"]["hotspot"]  # type: ignore[index]
    assert hs["alarms"] >= 1 and hs["mitigations"] >= 1 and hs["mitigated_requests"] >= 1
    first = hs["events"][0]
    assert first["kind"] == "alarm" and first["share"] > first["holders"] / first["instances"]
    assert out["policy"] == "lmetric+hotspot+monitor" and out["unfinished"] == 0
    assert g.monitor is not None and g.monitor.count == out["requests"]
    assert any(line.startswith("hotspot alarm") for line in g.log)
    # detection only: the same alarms, routing untouched
    watch = Guarded(make_policy("lmetric"), FeatureConfig(hotspot=HotspotConfig(mitigate=False)))
    _run(watch, 8, make_workload("hotspot", seed=0, **small))
    assert watch.hotspot is not None and watch.hotspot.alarms >= 1 and watch.hotspot.mitigated_requests == 0


def test_hotspot_flag_reaches_the_runner() -> None:
    spec = RunSpec(
        workload="hotspot", instances=4, duration=10.0, features=FeatureConfig(hotspot=HotspotConfig())
    )
    out = run_spec(spec)
    assert out["policy"] == "lmetric+hotspot" and "--hotspot-mitigation" in sim_command(spec)


def _cold_sim(scale_out: tuple[tuple[float, int], ...] = ((20.0, 2),)) -> ClusterSim:
    prof = get_profile()
    cfg = SimConfig(instances=2, kv_capacity_tokens=prof.kv_capacity_tokens, scale_out=scale_out)
    guard = Guarded(make_policy("lmetric"), FeatureConfig(cold_start=ColdStartConfig(window_s=30.0)))
    return ClusterSim(cfg, guard, prof.cost)


def test_scale_out_joins_instances_that_warm_up_and_get_preloads() -> None:
    sim = _cold_sim()
    out = sim.run(make_workload("coder", seed=1, rate_scale=0.25, duration=60.0))
    assert out["instances"] == 4 and out["unfinished"] == 0 and out["rejected"] == 0
    feats = out["features"]
    assert feats["warmups"] == 2 and feats["preloads"] > 0
    assert not sim._preload  # every preload request finished and was forgotten
    new = [sim._insts[i].engine.stats() for i in (2, 3)]
    assert all(s.prefix_query_tokens > 0 for s in new)  # the new instances served requests
    assert out["scale_out"] == [[20.0, 2]]
    timeline = out["ttft_timeline"]
    assert sum(b["requests"] for b in timeline) == out["requests"]


def test_preloaded_prefix_is_a_cache_hit_on_the_new_instance() -> None:
    sim = _cold_sim()
    sim.run(make_workload("coder", seed=1, rate_scale=0.25, duration=60.0))
    # preloads are prefill-only requests: the new engines hold the hot repository blocks
    guard = sim.guard
    assert guard is not None and guard._frequent is not None
    top = guard._frequent.top(1, sim.loop.now)
    assert top and top[0].count >= 2
    chain = top[0].chain  # the hottest class's common prefix is cached on both new instances
    assert all(sim._insts[i].engine.pool.count_hits(chain, len(chain))[0] > 0 for i in (2, 3))


def test_all_blocks_cleared_starts_a_warm_up() -> None:
    sim = _cold_sim(scale_out=())
    sim.run(make_workload("coder", seed=1, rate_scale=0.25, duration=10.0))
    sim._deliver(1, [AllBlocksCleared()])
    assert sim.guard is not None and sim.guard.warmup is not None
    assert sim.guard.warmup.warming(1, sim.loop.now)
    assert sim.guard.counts["warmups"] == 1


def test_quota_rejections_are_counted_and_not_routed() -> None:
    out = run_spec(
        RunSpec(
            workload="coder",
            instances=2,
            duration=20.0,
            features=FeatureConfig(quota=QuotaConfig(500.0, 6000.0)),
        )
    )
    q = out["quota_rejected"]
    assert q > 0 and out["unfinished"] == q
    assert out["features"]["quota_rejected"] == q


def test_mixed_workload_reports_per_class_latencies_and_classes_change_routing() -> None:
    spec = RunSpec(workload="mixed", instances=4, duration=40.0, scenario=SimScenario(by_class=True))
    plain = run_spec(spec)
    assert set(plain["by_class"]) == {"ttft", "tpot"}
    assert sum(c["requests"] for c in plain["by_class"].values()) == plain["requests"] - plain["unfinished"]
    classed = run_spec(
        RunSpec(workload="mixed", instances=4, duration=40.0, features=FeatureConfig(classes=ClassConfig()))
    )
    assert classed["features"]["class:ttft"] + classed["features"]["class:tpot"] == classed["requests"]
    assert classed["by_class"]["ttft"]["ttft_ms"] != plain["by_class"]["ttft"]["ttft_ms"]


def test_spot_and_p_token_cap_flags_reach_the_simulator(tmp_path: Path) -> None:
    out_file = tmp_path / "out.json"
    rc = main(
        [
            "sim", "--workload", "coder", "--duration", "15", "--instances", "4", "--no-progress",
            "--spot-instances", "2", "--spot-max-tokens", "1000", "--p-token-cap", "4000",
            "--json", str(out_file),
        ]
    )  # fmt: skip
    assert rc == 0
    out = json.loads(out_file.read_text())
    assert out["policy"] == f"{DEFAULT_POLICY}+limits"
    assert out["features"]["spot_excluded"] > 0 and out["features"]["p_token_capped"] > 0
    assert "--spot-instances 2" in out["command"] and "--p-token-cap 4000" in out["command"]


@pytest.mark.parametrize(
    "flags",
    [
        ["--scale-out", "abc"],
        ["--scale-out", "10:0"],
        ["--quota", "5"],
        ["--class-weight", "ttft"],
        ["--spot-instances", "9"],
        ["--policy", "vllm", "--classes"],
        ["--cold-start", "--cold-start-cap", "maybe"],
    ],
)
def test_bad_feature_flags_are_one_line_user_errors(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["sim", "--workload", "coder", "--duration", "5", "--instances", "4", "--no-progress", *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(("kvroute: error:", "usage: kvroute sim ")) and "Traceback" not in err
    assert err.splitlines()[-1].startswith(("kvroute: error:", "kvroute sim: error:"))
