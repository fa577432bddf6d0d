"""`kvroute compare --pd P:D[,P:D…]`: colocated against disaggregated fleets at equal instance counts.

For every ratio P:D the fleet of P + D instances runs the workload twice over: P prefill plus D decode
instances (:mod:`kvroute.sim.pd`), and P + D colocated instances (:mod:`kvroute.sim.cluster`), with
the same policy, profile, workload, seed and rate scales. Both are run with always-current load views
(``scrape_interval`` 0: the P/D simulator has no stale copies) and exact KV views. Reported: TTFT and
TPOT (mean, p99) at each rate scale, the share of requests whose prefill was skipped (the conditional
skip), and each fleet's capacity at the SLO (:mod:`kvroute.sim.capacity`, the same search for every
fleet): given by ``--slo-ttft-ms``/``--slo-tpot-ms``, else 5× / 10× the p99s of the smallest colocated
fleet at the lowest rate (the ``--preset`` rule).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvroute.errors import UserError

Summary = dict[str, Any]


def fleet_name(spec: Any) -> str:
    """``colocated N`` or ``P:D``."""
    return f"colocated {spec.instances}" if spec.pd is None else f"{spec.pd[0]}:{spec.pd[1]}"


def pd_specs(base: Any, ratios: list[tuple[int, int]], rates: list[float]) -> list[Any]:
    """Every fleet (a colocated one per total, then each ratio) at every rate, colocated first."""
    totals = sorted({p + d for p, d in ratios})
    fleets = [replace(base, instances=t, pd=None) for t in totals]
    fleets += [replace(base, instances=p + d, pd=(p, d)) for p, d in ratios]
    return [replace(f, rate_scale=r) for f in fleets for r in rates]


def table_md(runs: list[tuple[Any, Summary]], capacity: dict[str, Any] | None) -> str:
    lines = [
        "| fleet | instances | rate scale | TTFT mean ms | TTFT p99 ms | TPOT mean ms | TPOT p99 ms "
        "| P skipped | unfinished |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for spec, out in runs:
        pd = out.get("pd")
        skipped = "—" if pd is None else f"{pd['skipped_prefill'] / max(out['requests'], 1):.0%}"
        t, o = out["ttft_ms"], out["tpot_ms"]
        lines.append(
            f"| {fleet_name(spec)} | {spec.instances} | ×{spec.rate_scale:g} | {t['mean']:.1f} | {t['p99']:.1f} "
            f"| {o['mean']:.2f} | {o['p99']:.2f} | {skipped} | {out['unfinished']} |"
        )
    if capacity is not None:
        slo = capacity["slo"]
        lines += [
            "",
            f"Capacity at TTFT p99 ≤ {slo['ttft_p99_ms']:.0f} ms and TPOT p99 ≤ {slo['tpot_p99_ms']:.1f} ms "
            "(highest rate scale meeting both with every request finished):",
            "",
            "| fleet | capacity (rate scale) | first failing probe |",
            "|---|---:|---:|",
        ]
        for name, c in capacity["fleets"].items():
            rate, failed = c["rate"], c["failed_rate"]
            lines.append(
                f"| {name} | {'none' if rate is None else f'×{rate:.3g}'} "
                f"| {'none (ramp ended)' if failed is None else f'×{failed:.3g}'} |"
            )
    return "\n".join(lines)


def run_pd_compare(args: argparse.Namespace, runner: Any) -> tuple[str, dict[str, Any]]:
    """Run the comparison with ``runner`` (a SpecRunner); returns (markdown table, results JSON)."""
    from kvroute.commands.compare import parse_list
    from kvroute.commands.sim import spec_from_args
    from kvroute.sim.capacity import CapacityRule, CapacitySearch, Slo
    from kvroute.sim.compare import run_capacity
    from kvroute.sim.pd import parse_ratio

    if args.trace is None and args.workload is None:
        raise UserError("give --trace FILE or --workload NAME with --pd")
    ratios = [parse_ratio(x) for x in args.pd.split(",") if x.strip()]
    if not ratios:
        raise UserError("--pd needs at least one P:D ratio, e.g. 1:3,2:2")
    policies = (args.policies or "lmetric").split(",")
    if len(policies) != 1:
        raise UserError("--pd compares fleets under one policy: give --policies NAME")
    if not args.pd_bandwidth > 0:
        raise UserError(f"--pd-bandwidth must be positive (GB/s), got {args.pd_bandwidth}")
    rates = parse_list(args.rate_scales, "--rate-scales", float, lambda x: x > 0, "a positive number")
    rates = rates or [args.rate_scale]
    base = replace(
        spec_from_args(args, policies[0]),
        scrape_interval=0.0,
        pd_bandwidth_gbps=args.pd_bandwidth,
        pd_conditional=not args.pd_no_conditional,
    )
    specs = pd_specs(base, ratios, rates)
    t0 = time.perf_counter()
    outs = runner.run(specs)
    runs = list(zip(specs, outs, strict=True))
    for s, o in runs:
        if s.pd is not None:
            o.pop("command", None)  # `kvroute sim` has no P/D mode: the compare command reproduces it
    capacity: dict[str, Any] | None = None
    if not args.pd_no_capacity:
        given = (args.slo_ttft_ms, args.slo_tpot_ms)
        if None in given and given != (None, None):
            raise UserError("give both --slo-ttft-ms and --slo-tpot-ms (or neither)")
        if given == (None, None):
            light = next(o for s, o in runs if s.pd is None and s.rate_scale == min(rates))
            slo = Slo(5 * float(light["ttft_ms"]["p99"]), 10 * float(light["tpot_ms"]["p99"]))
        else:
            slo = Slo(float(args.slo_ttft_ms), float(args.slo_tpot_ms))
        slo.check()
        fleets = {fleet_name(s): s for s, _ in runs}
        searches = {name: CapacitySearch(CapacityRule(min(rates), slo)) for name in fleets}
        caps = run_capacity(searches, lambda name, r: replace(fleets[name], rate_scale=r), runner.run)
        capacity = {
            "slo": {"ttft_p99_ms": slo.ttft_p99_ms, "tpot_p99_ms": slo.tpot_p99_ms},
            "fleets": {name: c.to_dict() for name, c in caps.items()},
        }
    results = {
        "workload": args.trace or args.workload,
        "command": "kvroute " + shlex.join(sys.argv[1:]),
        "policy": policies[0],
        "ratios": [list(r) for r in ratios],
        "rate_scales": rates,
        "pd_bandwidth_gbps": args.pd_bandwidth,
        "conditional": not args.pd_no_conditional,
        "runs": [{"fleet": fleet_name(s), "rate_scale": s.rate_scale, **o} for s, o in runs],
        "capacity": capacity,
        "wall_seconds": time.perf_counter() - t0,
    }
    return table_md(runs, capacity), results


def write(out_dir: Path, table: str, results: dict[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pd.md").write_text(table + "\n")
    (out_dir / "pd.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
