"""Issue 16 items 2–4: the seed interval math and its labels, capacity at an SLO (fake and real runs),
engines without prefix caching (0 KV hits, the reproducing command), the seed preset's arms and the
preset report's interval and capacity tables."""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import build_parser
from kvroute.commands.preset_report import capacity_summary, capacity_table, difference_table, seed_table
from kvroute.commands.settings import sim_command
from kvroute.commands.sim import spec_from_args
from kvroute.errors import UserError
from kvroute.sim.capacity import Capacity, CapacityRule, CapacitySearch, Slo, meets_slo
from kvroute.sim.compare import (
    NO_PREFIX_CACHING,
    PaperPlan,
    PaperWorkload,
    arm_name,
    run_capacity,
    run_one,
    run_paper,
    seed_plan,
    split_arm,
)
from kvroute.sim.runner import RunSpec, run_spec
from kvroute.sim.stats import LOSS, NO_INTERVAL, NOISE, WIN, label, mean_interval, paired_relative, t95

# ------------------------------------------------------------------------------------------ intervals


def test_mean_interval_by_hand() -> None:
    # 1, 2, 3: mean 2, s = 1, half = t(0.975, 2) · 1/√3 = 4.303 / 1.732 = 2.4844
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half == pytest.approx(4.303 / math.sqrt(3))
    assert (iv.low, iv.high) == pytest.approx((2.0 - 2.4844, 2.0 + 2.4844), abs=1e-4)
    # 10, 14: mean 12, s = √8, half = 12.706 · √8 / √2 = 25.412
    assert mean_interval([10.0, 14.0]).half == pytest.approx(25.412)
    one = mean_interval([5.0])
    assert one.mean == 5.0 and math.isnan(one.half) and not one.excludes_zero()
    assert t95(2) == 4.303 and t95(30) == 2.042 and t95(31) == 1.96
    with pytest.raises(ValueError):
        mean_interval([])


def test_paired_relative_difference_by_hand() -> None:
    # per seed: 80/100 − 1 = −0.20, 90/100 − 1 = −0.10, 75/100 − 1 = −0.25 → mean −0.1833,
    # s = 0.07638, half = 4.303 · 0.07638 / √3 = 0.18975 → [−0.373, +0.006]: within noise
    iv = paired_relative([80.0, 90.0, 75.0], [100.0, 100.0, 100.0])
    assert iv.mean == pytest.approx(-0.18333, abs=1e-5)
    assert iv.half == pytest.approx(0.18975, abs=1e-4)
    assert label(iv) == NOISE
    # pairing removes the seeds' common swing: the reference moves 100 → 200, the ratio stays 0.8 ± 0.02
    tight = paired_relative([80.0, 164.0, 117.0], [100.0, 200.0, 150.0])
    assert tight.mean == pytest.approx((-0.2 - 0.18 - 0.22) / 3)
    assert label(tight) == WIN
    assert label(paired_relative([120.0, 130.0, 125.0], [100.0, 100.0, 100.0])) == LOSS
    assert label(paired_relative([80.0], [100.0])) == NO_INTERVAL
    with pytest.raises(ValueError):
        paired_relative([1.0], [1.0, 2.0])


def test_identical_values_have_a_zero_width_interval() -> None:
    iv = paired_relative([90.0, 90.0, 90.0], [100.0, 100.0, 100.0])
    assert iv.half == 0.0 and label(iv) == WIN  # every seed agrees: the interval is the point


# ------------------------------------------------------------------------------------------ capacity


def summary(ttft_p99: float, tpot_p99: float, unfinished: int = 0) -> dict[str, Any]:
    return {
        "ttft_ms": {"mean": ttft_p99 / 2, "p99": ttft_p99},
        "tpot_ms": {"mean": tpot_p99 / 2, "p99": tpot_p99},
        "unfinished": unfinished,
    }


def queue(capacity: float) -> Any:
    """A fake policy: p99s grow like a queue and explode (unfinished) at ``capacity``."""
    calls: list[float] = []

    def measure(rate: float) -> dict[str, Any]:
        calls.append(rate)
        if rate >= capacity:
            return summary(1e6, 1e3, unfinished=5)
        return summary(100.0 / (1 - rate / capacity), 10.0 / (1 - rate / capacity))

    return measure, calls


def search(rule: CapacityRule, measure: Any) -> Capacity:
    s = CapacitySearch(rule)
    while (r := s.next_rate()) is not None:
        s.record(r, measure(r))
    return s.result()


def test_meets_slo() -> None:
    slo = Slo(500.0, 50.0)
    assert meets_slo(summary(500.0, 50.0), slo)
    assert not meets_slo(summary(501.0, 10.0), slo)
    assert not meets_slo(summary(100.0, 51.0), slo)
    assert not meets_slo(summary(100.0, 10.0, unfinished=1), slo)
    assert not meets_slo(summary(float("nan"), 10.0), slo)
    with pytest.raises(UserError):
        CapacitySearch(CapacityRule(1.0, Slo(0.0, 1.0)))


def test_capacity_ramps_then_bisects_with_the_same_probes_for_every_policy() -> None:
    slo = Slo(600.0, 100.0)  # TTFT 600 ms ↔ rate ≤ 5/6 cap; TPOT 100 ms ↔ rate ≤ 0.9 cap
    results = {}
    for cap in (10.0, 20.0):
        measure, calls = queue(cap)
        results[cap] = (search(CapacityRule(0.5, slo, refine=3), measure), calls)
    c10, calls10 = results[10.0]
    assert calls10[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert len(calls10) == 6 + 3  # ramp until the first failure, then exactly 3 bisections
    assert c10.rate is not None and c10.failed_rate is not None
    assert c10.rate <= 25 / 3 < c10.failed_rate  # the true crossing: 5/6 × 10
    assert c10.failed_rate / c10.rate == pytest.approx(2 ** (1 / 8))
    c20, calls20 = results[20.0]
    assert c20.rate is not None and c20.rate <= 50 / 3 < c20.failed_rate  # type: ignore[operator]
    assert len(calls20) == 7 + 3
    # probes that met the SLO are all below those that did not (the fake is monotone)
    for c in (c10, c20):
        assert max(p.rate for p in c.probes if p.ok) < min(p.rate for p in c.probes if not p.ok)


def test_capacity_below_the_light_rate_divides_and_a_tolerant_slo_gives_up() -> None:
    measure, calls = queue(1.0)  # crossing at 0.8
    c = search(CapacityRule(2.0, Slo(500.0, 100.0), refine=2), measure)
    assert calls[:3] == [2.0, 1.0, 0.5]
    assert c.rate is not None and 0.5 <= c.rate <= 0.8 < c.failed_rate  # type: ignore[operator]
    measure, calls = queue(1e9)
    c = search(CapacityRule(1.0, Slo(500.0, 100.0), max_ramp=3), measure)
    assert calls == [1.0, 2.0, 4.0, 8.0] and c.rate == 8.0 and c.failed_rate is None
    never = search(CapacityRule(1.0, Slo(1.0, 1.0), max_ramp=2), queue(10.0)[0])
    assert never.rate is None and never.failed_rate == 0.25


def test_capacity_on_a_tiny_real_workload_is_monotone() -> None:
    """Real simulations (2 instances, 30 s of chatbot): the SLO is 3× the light-load p99s; probes
    that meet it lie below those that fail, and every probe's own run agrees with its verdict."""
    base = RunSpec(policy="lmetric", instances=2, workload="chatbot", duration=30.0)
    light = run_spec(replace(base, rate_scale=0.5))
    slo = Slo(3 * light["ttft_ms"]["p99"], 3 * light["tpot_ms"]["p99"])
    searches = {"lmetric": CapacitySearch(CapacityRule(0.5, slo, refine=2, max_ramp=6))}
    caps = run_capacity(
        searches, lambda _, r: replace(base, rate_scale=r), lambda specs: [run_spec(s) for s in specs]
    )
    c = caps["lmetric"]
    assert c.rate is not None and c.failed_rate is not None and c.rate < c.failed_rate
    ok = [p.rate for p in c.probes if p.ok]
    bad = [p.rate for p in c.probes if not p.ok]
    assert max(ok) == c.rate and min(bad) == c.failed_rate and max(ok) < min(bad)
    assert len(c.probes) == len({p.rate for p in c.probes})


# ------------------------------------------------------------------------------- no prefix caching


def test_no_prefix_caching_means_zero_kv_hits_for_the_seed_presets_baseline() -> None:
    plan = seed_plan(duration=20.0)
    w = plan.workloads[0]  # chatbot: conversations reuse their context
    off = w.spec(plan, plan.reference, 0.5)
    assert plan.reference == "vllm" + NO_PREFIX_CACHING
    assert off.policy == "vllm" and not off.prefix_caching and off.profile == "design-a100-qwen30b"
    out = run_one(off)
    assert out["requests"] > 0 and out["unfinished"] == 0
    assert out["kv_hit_rate"] == 0.0 and out["policy"] == "vllm (prefix caching off)"
    on = run_one(w.spec(plan, "vllm", 0.5))
    assert on["kv_hit_rate"] > 0.3 and on["policy"] == "vllm" and on["requests"] == out["requests"]


def test_engines_without_prefix_caching_send_no_kv_events() -> None:
    from kvroute.engine.kvmanager import KVCacheManager

    assert KVCacheManager.cache_blocks.__doc__ is not None
    spec = RunSpec(policy="lmetric", instances=2, workload="chatbot", duration=20.0, prefix_caching=False)
    out = run_spec(spec)
    # lmetric follows the router's prefix index: with no events it predicts no hits, and none happen
    assert out["kv_hit_rate"] == 0.0 and out["unfinished"] == 0


def test_the_command_string_reproduces_a_no_prefix_caching_run() -> None:
    spec = RunSpec(
        policy="vllm",
        instances=2,
        workload="chatbot",
        duration=10.0,
        rate_scale=0.5,
        profile="design-a100-qwen30b",
        prefix_caching=False,
    )
    cmd = sim_command(spec)
    assert "--no-prefix-caching" in cmd and "--no-prefix-caching" not in sim_command(RunSpec(workload="x"))
    argv = shlex.split(cmd)
    assert argv[:2] == ["kvroute", "sim"]
    args = build_parser().parse_args(argv[1:])
    again = spec_from_args(args, args.policy)
    assert again == spec
    assert run_spec(again)["kv_hit_rate"] == 0.0


def test_arm_names() -> None:
    assert arm_name("vllm") == "vllm" and split_arm("vllm") == ("vllm", True)
    assert split_arm(arm_name("linear:0.5", False)) == ("linear:0.5", False)


# ------------------------------------------------------------------------------------ the presets


class Fake:
    """Fake summaries: TTFT grows with the rate, lmetric 30 % lower than vllm, seed noise ±2 %,
    engines without caching 20 % slower; capacity 8 for vllm, 12 for lmetric."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []

    def __call__(self, specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
        self.specs += specs
        out = []
        for s in specs:
            cap = 12.0 if s.policy == "lmetric" else 8.0
            scale = (0.7 if s.policy == "lmetric" else 1.0) * (1.0 if s.prefix_caching else 1.2)
            noise = 1.0 + 0.02 * ((s.seed % 3) - 1)
            t = 50.0 * scale * noise / max(1e-3, 1.0 - s.rate_scale / cap)
            stats = {"mean": t, "p50": t, "p90": t, "p99": 2 * t}
            out.append(
                {
                    "policy": s.policy,
                    "instances": s.instances,
                    "requests": 100,
                    "unfinished": int(s.rate_scale >= cap),
                    "ttft_ms": stats,
                    "tpot_ms": {k: v / 10 for k, v in stats.items()},
                    "e2e_ms": stats,
                    "kv_hit_rate": 0.0 if not s.prefix_caching else 0.5,
                    "rate_scale": s.rate_scale,
                    "scrape_interval": s.scrape_interval,
                    "event_delay": s.event_delay,
                    "wall_seconds": 1.0,
                    "profile": "fake",
                    "workload": s.workload,
                    "command": sim_command(s),
                }
            )
        return out


def plan(**changes: Any) -> PaperPlan:
    return PaperPlan(
        workloads=(
            PaperWorkload("w", 10.0, 1.0, workload="w"),
            PaperWorkload("t", 10.0, 1.0, trace="t.jsonl"),
        ),
        instances=2,
        policies=("vllm", "lmetric"),
        lambdas=(),
        rate_fractions=(0.5, 1.0),
        refine=1,
        capacity_refine=2,
        staleness_workload=None,
        **{"bound": False, **changes},  # the bound simulates the named workloads: none exist here
    ).check()


def test_run_paper_seeds_and_capacity_on_a_fake_runner() -> None:
    fake = Fake()
    res = run_paper(plan(), fake)
    assert len(fake.specs) == len(set(fake.specs))
    w, t = res["workloads"]
    assert w["seeds"] == [0, 1, 2] and t["seeds"] == [0]  # a trace is replayed exactly: one seed
    assert {(r["policy"], r["seed"]) for r in w["seed_runs"]} == {
        (p, s) for p in ("vllm", "lmetric") for s in (1, 2)
    }
    assert all(r["rate_scale"] == w["default_rate"] for r in w["seed_runs"])
    assert all(r["seed"] == 0 for r in w["runs"]) and t["seed_runs"] == []
    # SLO = 5× / 10× the reference's p99s at the light rate (×1, seed 0: TTFT 2·50·0.98/(1−1/8) ms)
    light = 2 * 50.0 * 0.98 / (1 - 1 / 8)
    assert w["slo"]["ttft_p99_ms"] == pytest.approx(5 * light)
    assert w["slo"]["tpot_p99_ms"] == pytest.approx(10 * light / 10)
    caps = {c["policy"]: c for c in w["capacity"]}
    assert set(caps) == {"vllm", "lmetric"} and all(c["seed"] == 0 for c in w["capacity"])
    assert caps["lmetric"]["rate"] > caps["vllm"]["rate"]
    assert len(caps["lmetric"]["probes"]) - len(caps["vllm"]["probes"]) in (-1, 0, 1)  # ramp length only

    table = seed_table(w, ["vllm", "lmetric"])
    assert "| vllm |" in table and " ± " in table
    diffs = difference_table(w, ["vllm", "lmetric"], "vllm")
    assert diffs.count("| lmetric |") == 1 and "win" in diffs and "vllm |" not in diffs.split("\n", 2)[2]
    assert "one sample, no interval" in difference_table(t, ["vllm", "lmetric"], "vllm")
    cap = capacity_table(w, ["vllm", "lmetric"], "vllm")
    assert f"{caps['lmetric']['rate'] / caps['vllm']['rate']:.2f}×" in cap
    summary_md = capacity_summary(res["workloads"], ["vllm", "lmetric"], "vllm")
    assert summary_md.count("\n") == 3 and f"×{caps['vllm']['rate']:.3g}" in summary_md


def test_noise_is_not_called_a_win() -> None:
    """Seeds that disagree on the sign: the report says within noise."""
    w = {
        "default_rate": 1.0,
        "seeds": [0, 1, 2],
        "runs": [
            {
                "policy": p,
                "seed": 0,
                "rate_scale": 1.0,
                "ttft_ms": {"mean": v, "p99": v},
                "tpot_ms": {"mean": v},
            }
            for p, v in (("a", 100.0), ("b", 95.0))
        ],
        "seed_runs": [
            {
                "policy": p,
                "seed": s,
                "rate_scale": 1.0,
                "ttft_ms": {"mean": v, "p99": v},
                "tpot_ms": {"mean": v},
            }
            for p, s, v in (("a", 1, 100.0), ("b", 1, 104.0), ("a", 2, 100.0), ("b", 2, 96.0))
        ],
    }
    row = difference_table(w, ["a", "b"], "a").splitlines()[2]
    assert row.startswith("| b | -2% [") and row.count("within noise") == 3 and "win" not in row


def test_seed_preset_arms_run_with_and_without_caching() -> None:
    fake = Fake()
    p = replace(seed_plan(duration=10.0), workloads=seed_plan().workloads[:1], seeds=(0, 1))
    res = run_paper(p, fake)
    arms = {(s.policy, s.prefix_caching) for s in fake.specs}
    assert arms == {("vllm", False), ("vllm", True), ("llm-d", True), ("lmetric", True)}
    assert all(s.profile == "design-a100-qwen30b" for s in fake.specs)
    w = res["workloads"][0]
    assert w["best_lambda"] is None and res["staleness"] is None
    base = [r for r in w["runs"] if r["policy"] == "vllm (prefix caching off)"]
    assert base and all(r["kv_hit_rate"] == 0.0 for r in base)
    # the saturation search ran on the document's baseline (no caching)
    assert all(not s.prefix_caching for s in fake.specs[: len(w["saturation"]["probes"])])
    with pytest.raises(UserError, match="reference"):
        replace(p, policies=("vllm", "lmetric")).check()


def test_plain_compare_reports_capacity_at_the_given_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvroute.cli import main

    argv = ["compare", "--workload", "chatbot", "--duration", "20", "--instances", "2", "--no-progress"]
    argv += [
        "--policies",
        "vllm,lmetric",
        "--rate-scales",
        "0.5",
        "--out",
        str(tmp_path / "o"),
        "--jobs",
        "1",
    ]
    assert main([*argv, "--slo-ttft-ms", "300"]) == 2
    assert "give both --slo-ttft-ms and --slo-tpot-ms" in capsys.readouterr().err
    assert main([*argv, "--slo-ttft-ms", "300", "--slo-tpot-ms", "40"]) == 0
    out = capsys.readouterr().out
    assert "### capacity at TTFT p99 ≤ 300 ms and TPOT p99 ≤ 40 ms" in out
    saved = json.loads((tmp_path / "o" / "results.json").read_text())
    caps = saved["capacity"]["policies"]
    assert set(caps) == {"vllm", "lmetric"}
    for c in caps.values():
        assert c["probes"][0]["rate"] == 0.5
        ok = [p["rate"] for p in c["probes"] if p["ok"]]
        assert c["rate"] == (max(ok) if ok else None)
    assert "--slo-ttft-ms 300 --slo-tpot-ms 40" in saved["command"]
