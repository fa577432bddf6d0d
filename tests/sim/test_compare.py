"""kvroute compare: the grid, the worker-process runner, outputs that match direct runs, the saturation
search on a fake run function, the paper preset's orchestration and report on a fake runner, bad input."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvroute.cli import main
from kvroute.commands.compare import (
    GENERATED_BEGIN,
    GENERATED_END,
    default_rate,
    load_paper,
    paper_markdown,
    parse_list,
    splice_generated,
    staleness_table,
    write_paper,
)
from kvroute.commands.settings import sim_command
from kvroute.errors import UserError
from kvroute.metrics import quantile_points_ms
from kvroute.routing.queue import QueueConfig
from kvroute.sim.compare import (
    PaperPlan,
    PaperWorkload,
    SaturationRule,
    SaturationSearch,
    best_lambda,
    expand_grid,
    find_saturation,
    is_saturated,
    reference_setting,
    run_one,
    run_paper,
)
from kvroute.sim.runner import SAMPLE_POINTS, RunSpec, run_spec

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--workload", "chatbot", "--duration", "8", "--instances", "2"]


def tiny_spec(policy: str, rate: float, **changes: Any) -> RunSpec:
    return RunSpec(policy=policy, instances=2, workload="chatbot", duration=8.0, rate_scale=rate, **changes)


# ------------------------------------------------------------------------------------------ CLI, real runs


def test_compare_runs_arms_with_the_queue_or_without_prefix_caching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plain compare takes the preset's arms: ' +queue' runs the router-side queue, ' (prefix caching
    off)' engines that do not cache; each arm's run equals the direct run of its spec."""
    arms = "lmetric,lmetric +queue,vllm (prefix caching off)"
    argv = ["compare", *TINY, "--policies", arms, "--rate-scales", "4", "--out", str(tmp_path / "o")]
    assert main([*argv, "--jobs", "1", "--no-progress"]) == 0
    results = json.loads((tmp_path / "o" / "results.json").read_text())
    runs = {r["policy"]: r for r in results["runs"]}
    assert list(runs) == arms.split(",")
    assert "router_queue" in runs["lmetric +queue"] and "router_queue" not in runs["lmetric"]
    assert runs["lmetric +queue"]["command"].endswith("--router-queue")
    assert runs["vllm (prefix caching off)"]["kv_hit_rate"] == 0.0 < runs["lmetric"]["kv_hit_rate"]
    direct = run_spec(tiny_spec("lmetric", 4.0, router_queue=QueueConfig()))
    assert runs["lmetric +queue"]["ttft_ms"] == direct["ttft_ms"]
    assert f"--policies '{arms}'" in results["command"]
    assert "lmetric +queue" in capsys.readouterr().out
    assert main(["compare", *TINY, "--policies", "lmetric +nope", "--no-progress"]) == 2


def test_compare_writes_results_table_and_plots_matching_direct_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    argv = ["compare", *TINY, "--policies", "vllm,lmetric", "--rate-scales", "0.5,1"]
    assert main([*argv, "--jobs", "2", "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out

    results = json.loads((out / "results.json").read_text())
    assert results["policies"] == ["vllm", "lmetric"]
    assert results["rate_scales"] == [0.5, 1.0]
    assert results["default_rate"] == 1.0
    assert results["command"].startswith("kvroute compare --workload chatbot --duration 8 --instances 2")
    assert "--policies vllm,lmetric --rate-scales 0.5,1" in results["command"]
    runs = results["runs"]
    assert [(r["policy"], r["rate_scale"]) for r in runs] == [
        ("vllm", 0.5),
        ("vllm", 1.0),
        ("lmetric", 0.5),
        ("lmetric", 1.0),
    ]
    assert all("samples" not in r for r in runs)
    # the bound (kvroute.sim.bound) at each rate: no policy's mean TTFT or KV hit rate beats it
    bounds = {b["rate"]: b for b in results["bound"]["rates"]}
    assert set(bounds) == {0.5, 1.0} and "### the bound" in printed
    for r in runs:
        assert r["ttft_ms"]["mean"] >= bounds[r["rate_scale"]]["ttft_mean_ms"]
        assert r["kv_hit_rate"] <= bounds[r["rate_scale"]]["kv_hit_rate_ceiling"] + 1e-9
        assert bounds[r["rate_scale"]]["kv_hit_rate_ceiling"] <= bounds[r["rate_scale"]]["oracle_kv_hit_rate"]
    assert "vllm: of the bound" in printed and "lmetric: of the bound" in printed
    for r in runs:
        direct = run_spec(tiny_spec(r["policy"], r["rate_scale"]))
        assert r["ttft_ms"] == direct["ttft_ms"]
        assert r["tpot_ms"] == direct["tpot_ms"]
        assert r["kv_hit_rate"] == direct["kv_hit_rate"]
        assert r["requests"] == direct["requests"] > 0
        assert r["command"] == sim_command(tiny_spec(r["policy"], r["rate_scale"]))
        assert (r["scrape_interval"], r["event_delay"]) == (0.05, 0.002)

    samples = json.loads((out / "samples.json").read_text())
    assert [(s["policy"], s["rate_scale"]) for s in samples] == [("vllm", 1.0), ("lmetric", 1.0)]
    vllm_1 = next(r for r in runs if r["policy"] == "vllm" and r["rate_scale"] == 1.0)
    assert len(samples[0]["ttft_ms"]) == vllm_1["requests"]  # fewer than SAMPLE_POINTS: all of them
    assert samples[0]["ttft_ms"] == sorted(samples[0]["ttft_ms"])

    table = (out / "table.md").read_text()
    assert table.count("### rate scale ×") == 2
    assert "### rate scale ×0.5" in table and "### rate scale ×1 " in table
    at_1 = table.split("### rate scale ×1 ")[1]
    row = next(line for line in at_1.splitlines() if line.startswith("| lmetric |"))
    lm1 = next(r for r in runs if r["policy"] == "lmetric" and r["rate_scale"] == 1.0)
    assert row.split("|")[3].strip() == f"{lm1['ttft_ms']['mean']:.1f}"
    assert table.strip() in printed

    for png in ("latency_vs_rate.png", "cdf.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC


def test_compare_staleness_sweep_tables(tmp_path: Path) -> None:
    out = tmp_path / "stale"
    argv = ["compare", *TINY, "--policies", "lmetric", "--scrape-intervals", "0,1", "--event-delays", "0.5"]
    assert main([*argv, "--jobs", "1", "--out", str(out), "--no-progress"]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["scrape_interval"], r["event_delay"]) for r in runs] == [(0.0, 0.5), (1.0, 0.5)]
    # the run's own `kvroute sim` line: an arm without ' +queue' ran without the queue, which sim
    # turns on by default
    assert runs[1]["command"].endswith("--scrape-interval 1.0 --event-delay 0.5 --no-router-queue")
    direct = run_spec(tiny_spec("lmetric", 1.0, scrape_interval=1.0, event_delay=0.5))
    assert runs[1]["ttft_ms"] == direct["ttft_ms"]
    table = (out / "table.md").read_text()
    # 0.05 s is not in the sweep: the per-rate table uses the first listed interval
    assert "| scrape 0 s, events 0.5 s | scrape 1 s, events 0.5 s |" in table
    assert f"| lmetric | {runs[0]['ttft_ms']['mean']:.1f} |" in table
    samples = json.loads((out / "samples.json").read_text())
    assert [(s["scrape_interval"], s["event_delay"]) for s in samples] == [(0.0, 0.5)]


def test_samples_are_opt_in_and_downsampled() -> None:
    assert "samples" not in run_spec(tiny_spec("vllm", 1.0))
    out = run_spec(tiny_spec("vllm", 1.0, keep_samples=True))
    ttft = out["samples"]["ttft_ms"]
    assert len(ttft) == out["requests"] <= SAMPLE_POINTS
    assert min(ttft) > 0 and ttft == sorted(ttft)
    assert sum(ttft) / len(ttft) == pytest.approx(out["ttft_ms"]["mean"])

    values = [i / 1000.0 for i in range(10001)]  # 0 .. 10 s
    points = quantile_points_ms(values, 101)
    assert len(points) == 101
    assert points[0] == 0.0 and points[-1] == pytest.approx(10000.0)
    assert points[50] == pytest.approx(5000.0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "vllm,nope"], "unknown policy 'nope'"),
        (["--policies", " , "], "--policies: empty list"),
        (["--policies", "vllm,,lmetric"], "--policies: empty item"),
        (["--policies", "vllm,vllm"], "given twice"),
        (["--policies", "linear:2"], "must be in [0.0, 1.0]"),
        (["--policies", "vllm", "--rate-scales", "0"], "'0' is not a positive number"),
        (["--policies", "vllm", "--rate-scales", "1,fast"], "--rate-scales: 'fast'"),
        (["--policies", "vllm", "--rate-scales", "inf"], "is not a positive number"),
        (["--policies", "vllm", "--scrape-intervals", "-1"], "is not a number of seconds >= 0"),
        (["--policies", "vllm", "--jobs", "0"], "--jobs must be at least 1"),
        ([], "give --policies"),
    ],
)
def test_bad_input_is_one_line_user_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["compare", *TINY, *extra, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvroute: error: ")
    assert message in err


@pytest.mark.parametrize(
    "argv",
    [
        ["compare", "--policies", "vllm"],
        ["compare", "--preset", "paper", "--workload", "chatbot"],
        ["compare", "--preset", "paper", "--policies", "lmetric"],  # lacks the reference
        ["compare", "--preset", "seed", "--no-prefix-caching"],
        ["compare", "--preset", "paper", "--seeds", "1,1"],
        ["compare", "--preset", "paper", "--rate-scales", "1"],
        ["compare", "--preset", "nope"],
    ],
)
def test_bad_mode_is_user_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    *usage, last = capsys.readouterr().err.splitlines()  # a bad flag: argparse's usage block first
    assert last.startswith(("kvroute: error: ", "kvroute compare: error: "))
    assert not usage or usage[0].startswith("usage: kvroute compare ")


def test_worker_errors_surface_as_user_errors() -> None:
    with pytest.raises(UserError, match="unknown workload"):
        run_one(replace(tiny_spec("vllm", 1.0), workload="nope"))


# ---------------------------------------------------------------------------------------- grid, parsing


def test_expand_grid_order_and_samples() -> None:
    base = tiny_spec("x", 1.0)
    specs = expand_grid(base, ["a", "b"], [0.5, 2.0], [0.0, 0.05], samples_at=2.0)
    assert [(s.policy, s.rate_scale, s.scrape_interval) for s in specs] == [
        (p, r, si) for p in "ab" for r in (0.5, 2.0) for si in (0.0, 0.05)
    ]
    assert [(s.policy, s.rate_scale, s.scrape_interval) for s in specs if s.keep_samples] == [
        ("a", 2.0, 0.05),
        ("b", 2.0, 0.05),
    ]
    assert all(s.event_delay == base.event_delay and s.duration == 8.0 for s in specs)
    assert reference_setting(base, [0.0, 0.05], []) == (0.05, 0.002)
    assert reference_setting(base, [1.0, 0.2], [0.3]) == (1.0, 0.3)


def test_parse_list_and_default_rate() -> None:
    assert parse_list(" 1, 2.5 ", "--x", float, lambda v: v > 0, "positive") == [1.0, 2.5]
    assert parse_list(None, "--x", float, bool, "") == []
    with pytest.raises(UserError, match="--x: '-1' is not positive"):
        parse_list("1,-1", "--x", float, lambda v: v > 0, "positive")
    assert default_rate([0.5, 1.0, 2.0], 1.0) == 1.0
    assert default_rate([4.0, 0.5, 2.0], 1.0) == 2.0
    assert default_rate([4.0, 0.5, 2.0, 8.0], 1.0) == 2.0


def fake_summary(policy: str, rate: float, ttft: float, **extra: Any) -> dict[str, Any]:
    stats = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": 2 * ttft}
    out = {
        "policy": policy,
        "instances": 2,
        "requests": 100,
        "unfinished": 0,
        "ttft_ms": stats,
        "tpot_ms": {k: v / 10 for k, v in stats.items()},
        "e2e_ms": stats,
        "kv_hit_rate": 0.5,
        "rate_scale": rate,
        "scrape_interval": 0.05,
        "event_delay": 0.002,
        "wall_seconds": rate,
        "profile": "fake",
        "workload": "fake",
        "command": f"kvroute sim --policy {policy}",
    }
    out.update(extra)
    return out


def test_staleness_table_relative_to_first_setting() -> None:
    runs = [
        fake_summary("a", 1.0, 100.0, scrape_interval=0.0),
        fake_summary("a", 1.0, 150.0, scrape_interval=1.0),
        fake_summary("b", 1.0, 80.0, scrape_interval=1.0),
    ]
    table = staleness_table(runs, lambda p: p.upper())
    lines = table.splitlines()
    assert lines[0] == "| policy | scrape 0 s, events 0.002 s | scrape 1 s, events 0.002 s |"
    assert lines[2] == "| A | 100.0 | 150.0 (+50%) |"
    assert lines[3] == "| B | — | 80.0 |"


# ------------------------------------------------------------------------------------------ saturation


def knee(capacity: float, light: float = 50.0) -> Any:
    """A fake run: mean TTFT grows like an M/M/1 queue and explodes (unfinished) past capacity."""

    calls: list[float] = []

    def measure(rate: float) -> dict[str, Any]:
        calls.append(rate)
        if rate >= capacity:
            return fake_summary("vllm", rate, 1e6, unfinished=3)
        return fake_summary("vllm", rate, light / (1.0 - rate / capacity))

    return measure, calls


def test_find_saturation_ramps_then_bisects() -> None:
    measure, calls = knee(capacity=10.0)
    rule = SaturationRule(light_rate=0.5, threshold=10.0, factor=2.0, refine=2)
    sat = find_saturation(rule, measure)
    # light 0.5 → ttft 52.6; saturated when ttft > 526 ms, i.e. rate > 9.05
    assert calls[:6] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0]
    assert calls[6] == pytest.approx(math.sqrt(8 * 16))  # 11.3: saturated
    assert calls[7] == pytest.approx(math.sqrt(8 * math.sqrt(8 * 16)))  # 9.51: saturated
    assert len(calls) == 8
    assert sat.max_rate == 8.0
    assert sat.saturated_rate == pytest.approx(calls[7])
    assert sat.light_ttft_ms == pytest.approx(50.0 / 0.95)
    assert [p.saturated for p in sat.probes] == [False] * 5 + [True] * 3
    assert sat.probes[5].unfinished == 3


def test_find_saturation_moves_lo_up_when_midpoint_is_fine() -> None:
    measure, calls = knee(capacity=12.0)  # threshold crossed at 10.9
    sat = find_saturation(SaturationRule(light_rate=1.0, refine=2), measure)
    assert calls[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert sat.max_rate == pytest.approx(math.sqrt(8 * math.sqrt(128)))  # 9.51 fine, 11.3 saturated
    assert sat.saturated_rate == pytest.approx(math.sqrt(128))


def test_find_saturation_gives_up_after_max_ramp() -> None:
    measure, calls = knee(capacity=1e9)
    sat = find_saturation(SaturationRule(light_rate=1.0, max_ramp=3), measure)
    assert calls == [1.0, 2.0, 4.0, 8.0]
    assert sat.max_rate == 8.0 and sat.saturated_rate is None


def test_saturation_needs_a_light_light_rate() -> None:
    measure, _ = knee(capacity=1.0)
    with pytest.raises(UserError, match="not a light load"):
        find_saturation(SaturationRule(light_rate=2.0), measure)
    with pytest.raises(UserError):
        SaturationSearch(SaturationRule(light_rate=1.0, threshold=1.0))
    search = SaturationSearch(SaturationRule(light_rate=1.0))
    with pytest.raises(RuntimeError):
        search.result()


def test_is_saturated() -> None:
    assert not is_saturated(fake_summary("v", 1, 99.0), 10.0, 10.0)
    assert is_saturated(fake_summary("v", 1, 101.0), 10.0, 10.0)
    assert is_saturated(fake_summary("v", 1, 20.0, unfinished=1), 10.0, 10.0)
    assert is_saturated(fake_summary("v", 1, float("nan")), 10.0, 10.0)


# ---------------------------------------------------------------------------------------- paper preset


class FakeRunner:
    """Deterministic fake summaries: capacity 8 for the reference; lmetric and linear:0.5 are faster."""

    def __init__(self) -> None:
        self.specs: list[RunSpec] = []

    def __call__(self, specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
        self.specs += specs
        out = []
        for s in specs:
            cap = 8.0 if (s.workload or "") == "w1" else 4.0
            boost = {"lmetric": 0.5, "linear:0.5": 0.7}.get(s.policy, 1.0)
            stale = 1.0 + s.scrape_interval + s.event_delay
            ttft = 50.0 * boost * stale / max(1e-3, 1.0 - s.rate_scale / cap)
            extra: dict[str, Any] = {
                "scrape_interval": s.scrape_interval,
                "event_delay": s.event_delay,
                "workload": s.workload,
                "unfinished": int(s.rate_scale >= cap),
            }
            if s.keep_samples:
                extra["samples"] = {"ttft_ms": [ttft / 2, ttft, ttft * 2], "tpot_ms": [1.0, 2.0]}
            out.append(fake_summary(s.policy, s.rate_scale, ttft, **extra))
        return out


def small_plan() -> PaperPlan:
    return PaperPlan(
        workloads=(
            PaperWorkload("w1", 10.0, 1.0, workload="w1"),
            PaperWorkload("w2", 10.0, 0.5, workload="w2"),
        ),
        instances=2,
        policies=("vllm", "lmetric"),
        lambdas=(0.3, 0.5),
        rate_fractions=(0.5, 1.0),
        refine=1,
        staleness_workload="w1",
        scrape_intervals=(0.0, 0.05, 1.0),
        event_delays=(0.002, 0.5),
        bound=False,  # the fake workloads generate no requests (the bound: tests/sim/test_bound.py)
    )


def test_run_paper_orchestration_on_a_fake_runner() -> None:
    fake = FakeRunner()
    notes: list[str] = []
    res = run_paper(small_plan(), fake, notes.append)

    assert len(fake.specs) == len(set(fake.specs))  # nothing is run twice
    w1, w2 = res["workloads"]
    # w1: light 1 → 57 ms; ramp 2, 4, 8 (unfinished) → refine sqrt(32) = 5.66: 50/(1-0.707) = 171 < 571
    assert w1["saturation"]["max_rate"] == pytest.approx(math.sqrt(32))
    assert w1["saturation"]["saturated_rate"] == 8.0
    assert w1["rates"] == pytest.approx([math.sqrt(32) / 2, math.sqrt(32)])
    assert w1["default_rate"] == pytest.approx(math.sqrt(32) / 2)
    assert w1["best_lambda"] == 0.5 and w2["best_lambda"] == 0.5
    cells = {(r["policy"], r["rate_scale"]) for r in w1["runs"]}
    d, m = w1["default_rate"], w1["saturation"]["max_rate"]
    assert cells == {
        ("vllm", d),
        ("vllm", m),
        ("lmetric", d),
        ("lmetric", m),
        ("linear:0.3", d),
        ("linear:0.5", d),
        ("linear:0.5", m),
    }
    assert all(("samples" in r) == (r["rate_scale"] == d) for r in w1["runs"])
    assert any("w1: best λ = 0.5" in n for n in notes)

    st = res["staleness"]
    assert st["workload"] == "w1" and st["rate"] == d
    settings = {(r["policy"], r["scrape_interval"], r["event_delay"]) for r in st["runs"]}
    assert len(settings) == len(st["runs"]) == 3 * (3 + 2 - 1)
    assert ("linear:0.5", 1.0, 0.002) in settings and ("vllm", 0.05, 0.5) in settings
    # the reference's probe at the max rate is reused, not rerun
    ref_runs = [s for s in fake.specs if s.policy == "vllm" and s.workload == "w1" and s.rate_scale == m]
    assert len(ref_runs) == 1


def test_write_paper_report_keeps_the_hand_written_discussion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = run_paper(replace(small_plan(), workloads=small_plan().workloads[:1]), FakeRunner())
    res.update(
        command="kvroute compare --preset paper", machine="test box", wall_seconds=60.0, profile="fake"
    )
    out, doc = tmp_path / "paper", tmp_path / "paper-table.md"
    write_paper(res, out, doc)
    text = doc.read_text()
    assert text.count(GENERATED_BEGIN) == 1 and text.count(GENERATED_END) == 1
    assert "## w1 — default load" in text and "## w2" not in text
    assert "| linear (λ=0.5) |" in text and "| linear:0.3 |" not in text.split("## w1")[1].split("λ grid")[0]
    assert "![w1 latency vs rate](paper/w1/latency_vs_rate.png)" in text
    assert "## Router staleness — w1" in text
    for name in ("w1",):
        assert (out / name / "latency_vs_rate.png").read_bytes()[:8] == PNG_MAGIC
        assert (out / name / "cdf.png").read_bytes()[:8] == PNG_MAGIC
        saved = json.loads((out / name / "results.json").read_text())
        assert saved["best_lambda"] == 0.5 and len(saved["runs"]) == 7
    assert (out / "staleness" / "scrape_interval.png").read_bytes()[:8] == PNG_MAGIC
    assert json.loads((out / "paper.json").read_text())["machine"] == "test box"
    assert "## w1" in capsys.readouterr().out
    loaded = load_paper(out)
    assert loaded["staleness"] == {**res["staleness"], "runs": [_drop(r) for r in res["staleness"]["runs"]]}
    for w in res["workloads"]:  # samples.json: the shown runs' samples (not the λ grid's), rounded
        w["runs"] = [r if r["policy"] in ("vllm", "lmetric", "linear:0.5") else _drop(r) for r in w["runs"]]
        for r in w["runs"]:
            if "samples" in r:
                r["samples"] = {k: [round(v, 2) for v in xs] for k, xs in r["samples"].items()}
    assert loaded["workloads"] == res["workloads"]
    assert paper_markdown(loaded, out, doc) == paper_markdown(res, out, doc)

    # a rerun replaces only the generated part (what write_paper does last)
    doc.write_text(text.replace("(to be written)", "Hand-written analysis."))
    res["machine"] = "another box"
    again = splice_generated(doc.read_text(), paper_markdown(res, out, doc))
    assert "Hand-written analysis." in again and "another box" in again and "test box" not in again


def _drop(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "samples"}


def test_splice_generated() -> None:
    fresh = splice_generated(None, "TABLE")
    assert fresh.startswith("# ") and "TABLE" in fresh and "## Discussion" in fresh
    old = f"intro\n{GENERATED_BEGIN}\nold\n{GENERATED_END}\noutro\n"
    assert splice_generated(old, "new") == f"intro\n{GENERATED_BEGIN}\n\nnew\n\n{GENERATED_END}\noutro\n"


def test_best_lambda_prefers_lowest_mean_ttft_then_smaller() -> None:
    runs = [
        fake_summary("linear:0.1", 1, 30.0),
        fake_summary("linear:0.5", 1, 20.0),
        fake_summary("linear:0.9", 1, 20.0),
    ]
    assert best_lambda(runs, [0.1, 0.5, 0.9]) == 0.5
    runs[1]["ttft_ms"]["mean"] = float("nan")
    assert best_lambda(runs, [0.1, 0.5, 0.9]) == 0.9


def test_queue_arms_run_with_the_router_queue_and_stay_out_of_the_staleness_study() -> None:
    from kvroute.policies.registry import DEFAULT_POLICY
    from kvroute.sim.compare import (
        DEFAULT_ARM,
        PAPER_ARMS,
        PAPER_POLICIES,
        ROUTER_QUEUE,
        arm_changes,
        has_queue,
        split_arm,
    )

    assert set(PAPER_ARMS) == {*PAPER_POLICIES, *(p + ROUTER_QUEUE for p in PAPER_POLICIES)}
    assert DEFAULT_ARM == DEFAULT_POLICY + ROUTER_QUEUE and DEFAULT_ARM in PAPER_ARMS
    assert split_arm("vllm (prefix caching off) +queue") == ("vllm", False) and has_queue("vllm +queue")
    assert (
        arm_changes("lmetric +queue")["router_queue"] is not None
        and arm_changes("lmetric")["router_queue"] is None
    )
    fake = FakeRunner()
    plan = dataclasses.replace(
        small_plan(), policies=("vllm", "lmetric", "lmetric" + ROUTER_QUEUE), lambdas=()
    )
    res = run_paper(plan, fake)
    queued = [s for s in fake.specs if s.router_queue is not None]
    assert queued and all(s.policy == "lmetric" for s in queued)
    w1 = res["workloads"][0]
    assert {r["policy"] for r in w1["runs"]} == {"vllm", "lmetric", "lmetric +queue"}
    assert {c["policy"] for c in w1["capacity"]} == {"vllm", "lmetric", "lmetric +queue"}
    assert all(not has_queue(r["policy"]) for r in res["staleness"]["runs"])
