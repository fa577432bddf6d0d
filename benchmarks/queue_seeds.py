"""One capacity cell of the router-side queue, over many seeds: is a one-step capacity loss the
queue's, or the seed's?

    .venv/bin/python -m benchmarks.queue_seeds [--workload api] [--policy lmetric] [--instances 16]
        [--duration 30] [--rates 5.66,6.17,6.73] [--seeds 20] [--slo-ttft-ms 1577] [--slo-tpot-ms 105.3]
        [--jobs 2]

For each rate and seed 0 … N−1, runs ``kvroute sim`` with and without ``--router-queue`` (its
defaults) on the same generated workload and reports, per rate: how many seeds meet the SLO (TTFT
p99 and TPOT p99 at most the objectives, every request finished) with and without the queue, and in
how many only one of the two does (the discordant seeds a paired sign test reads), the
paired difference of TPOT p99 and TTFT p99 (queue − none, ms; mean and 95 % t interval over the
seeds), and how many requests waited at the router. The defaults are the paper preset's api cell
where ``lmetric +queue`` lost one capacity step (×6.17, its SLO). Writes
``benchmarks/results/queue_seeds.json`` and prints a markdown table. Not part of ``make bench``
(about 2 min on 2 cores with the defaults).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import write
from kvroute.routing.queue import QueueConfig
from kvroute.sim.compare import SpecRunner
from kvroute.sim.runner import RunSpec

# two-sided 95 % Student t quantiles by degrees of freedom (normal beyond the table)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _t95(df: int) -> float:
    if df in _T95:
        return _T95[df]
    return 2.0 + 2.3 / df if df < 120 else 1.96  # within 0.5 % of the exact quantile for df ≥ 10


def paired(diffs: list[float]) -> dict[str, float]:
    """Mean and 95 % t half-width of paired differences (half-width 0 with one pair)."""
    n = len(diffs)
    mean = statistics.fmean(diffs)
    half = _t95(n - 1) * statistics.stdev(diffs) / math.sqrt(n) if n > 1 else 0.0
    return {"mean": mean, "low": mean - half, "high": mean + half}


def meets(out: dict[str, Any], ttft_ms: float, tpot_ms: float) -> bool:
    """The preset's SLO rule: every request finished, TTFT p99 and TPOT p99 within the objectives."""
    return not out.get("unfinished") and out["ttft_ms"]["p99"] <= ttft_ms and out["tpot_ms"]["p99"] <= tpot_ms


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.queue_seeds")
    p.add_argument("--workload", default="api")
    p.add_argument("--policy", default="lmetric")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--rates", default="5.655600260104774,6.168843301631764,6.727171322029716")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--slo-ttft-ms", type=float, default=1577.0)
    p.add_argument("--slo-tpot-ms", type=float, default=105.3)
    p.add_argument("--jobs", type=int, default=2)
    a = p.parse_args(argv)
    try:
        a.rate_list = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        p.error(f"--rates must be comma-separated numbers, got {a.rates!r}")
    if not a.rate_list or any(not r > 0 for r in a.rate_list) or a.seeds < 2 or a.jobs < 1:
        p.error("--rates must be positive, --seeds at least 2, --jobs at least 1")
    return a


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    base = RunSpec(
        workload=args.workload, duration=args.duration, instances=args.instances, policy=args.policy
    )
    specs = [
        replace(base, rate_scale=r, seed=s, router_queue=q)
        for r in args.rate_list
        for s in range(args.seeds)
        for q in (None, QueueConfig())
    ]
    t0 = time.perf_counter()
    with SpecRunner(args.jobs) as runner:
        outs = runner.run(specs)
    wall = time.perf_counter() - t0
    rows = []
    for k, r in enumerate(args.rate_list):
        pairs = [
            (outs[2 * (k * args.seeds + s)], outs[2 * (k * args.seeds + s) + 1]) for s in range(args.seeds)
        ]
        rows.append(
            {
                "rate_scale": r,
                "meets_without": sum(meets(a, args.slo_ttft_ms, args.slo_tpot_ms) for a, _ in pairs),
                "meets_with": sum(meets(b, args.slo_ttft_ms, args.slo_tpot_ms) for _, b in pairs),
                # discordant seeds: the SLO met only without the queue / only with it
                "only_without": sum(
                    meets(a, args.slo_ttft_ms, args.slo_tpot_ms)
                    and not meets(b, args.slo_ttft_ms, args.slo_tpot_ms)
                    for a, b in pairs
                ),
                "only_with": sum(
                    meets(b, args.slo_ttft_ms, args.slo_tpot_ms)
                    and not meets(a, args.slo_ttft_ms, args.slo_tpot_ms)
                    for a, b in pairs
                ),
                "tpot_p99_ms": paired([b["tpot_ms"]["p99"] - a["tpot_ms"]["p99"] for a, b in pairs]),
                "ttft_p99_ms": paired([b["ttft_ms"]["p99"] - a["ttft_ms"]["p99"] for a, b in pairs]),
                "tpot_p99_without_ms": statistics.fmean(a["tpot_ms"]["p99"] for a, _ in pairs),
                "queued_per_run": statistics.fmean(
                    b.get("router_queue", {}).get("queued", 0) for _, b in pairs
                ),
                "requests_per_run": statistics.fmean(a["requests"] for a, _ in pairs),
            }
        )
    doc = {
        "settings": {k: v for k, v in vars(args).items() if k != "rate_list"},
        "wall_seconds": wall,
        "rates": rows,
    }
    write("queue_seeds.json", doc)
    n = args.seeds
    print(
        f"{args.policy} on {args.workload}, {args.instances} instances, {args.duration:g} s of arrivals, "
        f"seeds 0-{n - 1}; SLO TTFT p99 ≤ {args.slo_ttft_ms:g} ms, TPOT p99 ≤ {args.slo_tpot_ms:g} ms; "
        f"{len(specs)} runs in {wall:.0f} s\n"
    )
    print(
        "| rate scale | seeds meeting the SLO: none / +queue | met only without / only with | TPOT p99, +queue − none (ms) [95 %] "
        "| TTFT p99, +queue − none (ms) [95 %] | mean TPOT p99 without (ms) | requests queued per run |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        tp, tt = row["tpot_p99_ms"], row["ttft_p99_ms"]
        print(
            f"| ×{row['rate_scale']:.3g} | {row['meets_without']} / {row['meets_with']} of {n} "
            f"| {row['only_without']} / {row['only_with']} "
            f"| {tp['mean']:+.1f} [{tp['low']:+.1f}, {tp['high']:+.1f}] "
            f"| {tt['mean']:+.1f} [{tt['low']:+.1f}, {tt['high']:+.1f}] "
            f"| {row['tpot_p99_without_ms']:.1f} | {row['queued_per_run']:.1f} of {row['requests_per_run']:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
