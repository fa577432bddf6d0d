"""The default policy against every arm: workloads × instances × load × seeds, paired by seed.

``python -m benchmarks.policy_grid --out FILE.json [--mooncake TRACE] [--jobs N]`` simulates every
policy of ``--policies`` (default: the paper preset's arms plus ``linear:0.9``) on each cell
(workload, instances, load) with ``--seeds`` seeds, and writes per cell, per arm, the mean of each
metric over the seeds and the paired per-seed difference to ``--candidate`` (default: the registry's
``DEFAULT_ARM``, the default policy behind the router-side queue) with its 95 % t-interval: the candidate *leads* on a metric when the interval of
(arm − candidate) lies above 0, *loses* when below, else *ties*. A trace is replayed exactly, so a
seed changes nothing there; its samples (``--trace-samples``) are replays at rates perturbed by
0.1 % each (sample k at rate × (1 + k / 1000)): near saturation such a small change moves the means
by tens of percent, and the interval over the samples says how far one replay can be trusted.

``--capacity``: instead, every arm's capacity at the paper preset's SLO per (workload, instances)
and sample, searched as the preset searches it (:mod:`benchmarks.grid_capacity`); ``--merge`` adds
an earlier capacity grid's samples (same SLOs) to the JSON written; without ``--capacity``, ``--merge``
adds an earlier latency grid's arms to the cells both have (:func:`merge_latency`), so that a new arm
is read against arms run before without running them again.

Loads: each workload's default load in the paper preset at 16 instances (half the cache-blind
balancer's max rate), scaled by instances / 16, and ``--heavy`` × that. Durations are short
(``--duration``, ``--trace-duration``): this is a screening grid; the preset is the reference.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import grid_capacity
from kvroute.sim.compare import DEFAULT_ARM, PAPER_ARMS, SpecRunner, arm_changes, arm_name
from kvroute.sim.runner import RunSpec

# The paper preset's default load per workload at 16 instances (docs/results/paper-table.md);
# multiturn is not in the preset: ×4 is below the cache-blind balancer's knee there.
DEFAULT_LOAD = {
    "chatbot": 8.0,
    "coder": 6.727,
    "api": 6.727,
    "agent": 5.657,
    "multiturn": 4.0,
    "longchat": 4.0,  # not in the preset: ×1 at 4 instances, about 2/3 of the KV pool's limit there
    "mooncake": 2.828,
}
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365}
METRICS = (("ttft_ms", "mean"), ("ttft_ms", "p99"), ("tpot_ms", "p99"))


def cell_specs(args: argparse.Namespace, arms: Sequence[str]) -> list[tuple[str, int, str, int, RunSpec]]:
    """(workload, instances, load label, sample, spec) for every run."""
    out = []
    for wl in args.workloads.split(","):
        for n in (int(x) for x in args.instances.split(",")):
            loads = (("default", 1.0), ("heavy", args.heavy)) if args.heavy > 0 else (("default", 1.0),)
            for label, mult in loads:
                rate = DEFAULT_LOAD[wl] * n / 16 * mult
                for arm in arms:
                    if wl == "mooncake":
                        if not args.mooncake:
                            continue
                        for k in range(args.trace_samples):
                            spec = RunSpec(
                                **arm_changes(arm),
                                instances=n,
                                trace=args.mooncake,
                                rate_scale=rate * (1 + k / 1000),
                                duration=args.trace_duration,
                            )
                            out.append((wl, n, label, k, spec))
                    else:
                        for seed in range(args.first_seed, args.first_seed + args.seeds):
                            spec = RunSpec(
                                **arm_changes(arm),
                                instances=n,
                                workload=wl,
                                rate_scale=rate,
                                duration=args.duration,
                                seed=seed,
                            )
                            out.append((wl, n, label, seed, spec))
    return out


def paired(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Mean relative difference (x − y) / y over pairs and its 95 % t half-width (NaN with one pair)."""
    d = [(x - y) / y if y else math.nan for x, y in zip(xs, ys, strict=True)]
    m = statistics.fmean(d)
    if len(d) < 2:
        return m, math.nan, math.nan
    h = T95.get(len(d) - 1, 2.0) * statistics.stdev(d) / math.sqrt(len(d))
    return m, m - h, m + h


def verdict(lo: float, hi: float) -> str:
    if math.isnan(lo):
        return "one sample"
    if lo > 0:
        return "lead"
    if hi < 0:
        return "lose"
    return "tie"


def losses(rows: dict[str, dict[str, Any]], cand: str) -> list[tuple[str, str, str, float]]:
    """(arm, metric, quantile, relative difference) where ``cand`` loses: the arm is lower beyond the
    interval, or, with one sample, by more than 2 %."""
    return [
        (arm, m, q, row[f"{m}_{q}_vs"][0])
        for arm, row in rows.items()
        if arm != cand
        for m, q in METRICS
        if row[f"{m}_{q}_vs"][3] == "lose"
        or (row[f"{m}_{q}_vs"][3] == "one sample" and row[f"{m}_{q}_vs"][0] < -0.02)
    ]


def render(report: dict[str, Any]) -> str:
    """A markdown table of a grid's JSON: per cell, the candidate's figures, the best other arm on each
    metric, and every arm that beats it beyond the interval (or, with one sample, by more than 2 %)."""
    cand = report["candidate"]
    out = [
        f"| cell | samples | {cand}: TTFT mean / p99 / TPOT p99 (ms) | best other arm: mean | p99 | TPOT p99 "
        f"| {cand} loses to |",
        "|---|---:|---|---|---|---|---|",
    ]
    for key, c in report["cells"].items():
        rows = c["arms"]
        me = rows[cand]
        best = []
        for m, q in METRICS:
            k = f"{m}_{q}"
            arm = min((a for a in rows if a != cand), key=lambda a: rows[a][k])
            d = rows[arm][f"{k}_vs"]
            best.append(f"{arm} {rows[arm][k]:.1f} ({d[0] * 100:+.0f} %, {d[3]})")
        lost = [
            f"{arm} ({m.split('_')[0].upper()} {q}: {d * 100:+.0f} %)" for arm, m, q, d in losses(rows, cand)
        ]
        out.append(
            f"| {key} ×{c['rate_scale']:.3g} | {c['samples']} | {me['ttft_ms_mean']:.1f} / {me['ttft_ms_p99']:.1f} / "
            f"{me['tpot_ms_p99']:.1f} | {' | '.join(best)} | {', '.join(lost) or 'none'} |"
        )
    return "\n".join(out) + "\n"


def summarize(cells: dict[str, Any], cand: str, quiet: bool = False) -> dict[str, Any]:
    """Per cell, per arm: the mean of each metric over the samples, the per-sample figures and the
    paired difference to ``cand``. ``cells``: key → {"rate_scale", "arms": arm → sample → figures}."""
    out: dict[str, Any] = {}
    for key, c in cells.items():
        base = c["arms"][cand]
        samples = sorted(base)
        rows = {}
        for arm, by in c["arms"].items():
            row: dict[str, Any] = {
                "preemptions": sum(by[k]["preemptions"] for k in samples),
                "unfinished": sum(by[k]["unfinished"] for k in samples),
                # per sample, so that any arm can be read as the candidate later (--render --candidate)
                "samples": {str(k): dict(by[k]) for k in samples},
            }
            for m, q in METRICS:
                vals = [by[k][f"{m}_{q}"] for k in samples]
                row[f"{m}_{q}"] = statistics.fmean(vals)
                if arm != cand:
                    d, lo, hi = paired(vals, [base[k][f"{m}_{q}"] for k in samples])
                    row[f"{m}_{q}_vs"] = [round(d, 4), round(lo, 4), round(hi, 4), verdict(lo, hi)]
            rows[arm] = row
        out[key] = {"rate_scale": c["rate_scale"], "samples": len(samples), "arms": rows}
        if not quiet:
            loses = [f"{arm}:{m}_{q}" for arm, m, q, _ in losses(rows, cand)]
            print(
                f"{key}: {cand} ttft mean {rows[cand]['ttft_ms_mean']:.1f} p99 {rows[cand]['ttft_ms_p99']:.1f}; "
                f"loses to: {', '.join(loses) or 'none'}",
                file=sys.stderr,
            )
    return out


def recandidate(report: dict[str, Any], cand: str) -> dict[str, Any]:
    """``report`` read against another of its arms (needs the per-sample figures)."""
    cells = {
        key: {
            "rate_scale": c["rate_scale"],
            "arms": {
                arm: {k: {"preemptions": 0, "unfinished": 0, **v} for k, v in row["samples"].items()}
                for arm, row in c["arms"].items()
            },
        }
        for key, c in report["cells"].items()
    }
    return {**report, "candidate": cand, "cells": summarize(cells, cand, quiet=True)}


def merge_latency(old: dict[str, Any], cells: dict[str, Any]) -> dict[str, Any]:
    """``cells`` (raw, as :func:`summarize` takes them) with the arms of an earlier latency grid
    ``old`` (its JSON, per-sample figures kept) added to the cells both have at the same rate scale.
    An arm in both must have the same figures on every sample both ran (the simulator is
    deterministic, so a difference means the runs are not the same runs): ValueError otherwise."""
    out = {key: {**c, "arms": dict(c["arms"])} for key, c in cells.items()}
    for key, c in old["cells"].items():
        mine = out.get(key)
        if mine is None or not math.isclose(mine["rate_scale"], c["rate_scale"], rel_tol=1e-12):
            continue
        for arm, row in c["arms"].items():
            if "samples" not in row:
                raise ValueError(f"{key}: {arm} has no per-sample figures")
            by = {int(k): {"preemptions": 0, "unfinished": 0, **v} for k, v in row["samples"].items()}
            if arm not in mine["arms"]:
                mine["arms"][arm] = by
                continue
            for k, v in by.items():
                ran = mine["arms"][arm].get(k)
                if ran is not None and any(ran[f"{m}_{q}"] != v[f"{m}_{q}"] for m, q in METRICS):
                    raise ValueError(f"{key}: {arm} sample {k} differs from the merged grid's")
    return out


def run_capacity_grid(args: argparse.Namespace, arms: list[str], argv: Sequence[str] | None) -> int:
    """``--capacity``: run the searches, merge an earlier run's samples, write the JSON."""
    old = None
    if args.merge:
        try:
            old = json.loads(Path(args.merge).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"policy_grid: cannot read --merge {args.merge}: {exc}") from None
        if old.get("mode") != "capacity" or old.get("candidate") != args.candidate:
            raise SystemExit(f"policy_grid: --merge {args.merge} is not a capacity grid of {args.candidate}")
    t0 = time.time()
    with SpecRunner(args.jobs) as runner:
        raw = grid_capacity.run(args, arms, runner.run)
    command = "python -m benchmarks.policy_grid " + " ".join(sys.argv[1:] if argv is None else argv)
    load = Path("/proc/loadavg").read_text().split()[:3]
    runs = [{"command": command, "wall_seconds": round(time.time() - t0, 1), "loadavg": load}]
    if old is not None:
        try:
            raw = grid_capacity.merge(grid_capacity.raw_of(old), raw)
        except ValueError as exc:
            raise SystemExit(f"policy_grid: --merge {args.merge}: {exc}") from None
        runs = [*old["runs"], *runs]
    report = {
        "mode": "capacity",
        "candidate": args.candidate,
        "runs": runs,
        "cells": grid_capacity.summarize(raw, args.candidate),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(grid_capacity.render(report), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=",".join(PAPER_ARMS))
    ap.add_argument("--extra", default="linear:0.9", help="more arms, comma-separated")
    ap.add_argument(
        "--candidate", default=DEFAULT_ARM, help=f"the arm the others are read against ({DEFAULT_ARM})"
    )
    ap.add_argument("--workloads", default="chatbot,coder,api,agent,multiturn,mooncake")
    ap.add_argument("--instances", default="8,16")
    ap.add_argument("--heavy", type=float, default=1.5, help="the heavier load, × the default (0: none)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument(
        "--first-seed", type=int, default=1, help="seeds first_seed.. (seed 0 was used to design)"
    )
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--mooncake", help="the Mooncake conversation trace")
    ap.add_argument("--trace-duration", type=float, default=60.0)
    ap.add_argument("--trace-samples", type=int, default=3, help="replays per trace cell (perturbed rates)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument(
        "--capacity",
        action="store_true",
        help="capacity at the paper preset's SLO per cell and sample instead of latency at fixed loads",
    )
    ap.add_argument(
        "--merge",
        help="an earlier grid JSON: with --capacity its samples are kept; without, its arms are added to "
        "the cells both grids have (the arms both ran must agree sample by sample)",
    )
    ap.add_argument(
        "--render",
        help="print the markdown table of this grid JSON and exit (runs nothing); with --candidate, "
        "read against that arm (grids that kept per-sample figures); a paper preset's paper.json: its "
        "capacity searches as a capacity grid",
    )
    args = ap.parse_args(argv)
    if args.render:
        try:
            shown = json.loads(Path(args.render).read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--render {args.render}: {exc}")
        if "plan" in shown:  # the paper preset's result: its capacity searches
            raw = grid_capacity.raw_of_preset(shown)
            print(
                grid_capacity.render(
                    {"candidate": args.candidate, "cells": grid_capacity.summarize(raw, args.candidate)}
                ),
                end="",
            )
            return 0
        capacity = shown.get("mode") == "capacity"
        if "--candidate" in (sys.argv[1:] if argv is None else argv) and args.candidate != shown["candidate"]:
            known = {a for c in shown["cells"].values() for a in c["arms"]}
            if args.candidate not in known:
                ap.error(f"{args.render}: no arm {args.candidate!r} (arms: {', '.join(sorted(known))})")
            shown = {**shown, "candidate": args.candidate} if capacity else recandidate(shown, args.candidate)
        if capacity:  # summarized again from the samples: the figures follow the arithmetic of this code
            shown = {
                **shown,
                "cells": grid_capacity.summarize(grid_capacity.raw_of(shown), shown["candidate"]),
            }
        print(grid_capacity.render(shown) if capacity else render(shown), end="")
        return 0
    if not args.out:
        ap.error("--out is required to run the grid")
    arms = [
        a for a in dict.fromkeys([args.candidate, *args.policies.split(","), *args.extra.split(",")]) if a
    ]
    if args.capacity:
        return run_capacity_grid(args, arms, argv)
    merged = None
    if args.merge:
        try:
            merged = json.loads(Path(args.merge).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"policy_grid: cannot read --merge {args.merge}: {exc}") from None
        if merged.get("mode") == "capacity":
            raise SystemExit(f"policy_grid: --merge {args.merge} is a capacity grid (add --capacity)")
    runs = cell_specs(args, arms)
    t0 = time.time()
    with SpecRunner(args.jobs) as runner:
        summaries = runner.run([r[4] for r in runs])
    cells: dict[str, Any] = {}
    for (wl, n, label, sample, spec), s in zip(runs, summaries, strict=True):
        arm = arm_name(spec.policy, router_queue=spec.router_queue is not None)
        key = f"{wl}/{n}/{label}"
        c = cells.setdefault(key, {"rate_scale": spec.rate_scale, "arms": {}})
        c["arms"].setdefault(arm, {})[sample] = {
            **{f"{m}_{q}": s[m][q] for m, q in METRICS},
            "unfinished": s["unfinished"],
            "preemptions": s["preemptions"],
            "kv_hit_rate": s.get("kv_hit_rate"),
        }
    if merged is not None:
        try:
            cells = merge_latency(merged, cells)
        except ValueError as exc:
            raise SystemExit(f"policy_grid: --merge {args.merge}: {exc}") from None
    report: dict[str, Any] = {
        "command": "python -m benchmarks.policy_grid " + " ".join(sys.argv[1:] if argv is None else argv),
        "candidate": args.candidate,
        "wall_seconds": round(time.time() - t0, 1),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "cells": {},
    }
    if merged is not None:
        report["merged"] = {k: merged.get(k) for k in ("command", "wall_seconds", "loadavg")}
    report["cells"] = summarize(cells, args.candidate)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
