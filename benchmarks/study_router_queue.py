"""The router-side queue's evidence, small: capacity at the SLO and TTFT p99 at light load, with and
without ``--router-queue``, for each policy, workload and seed, in the simulator.

    .venv/bin/python -m benchmarks.study_router_queue [--jobs 2] [--instances 4] [--duration 60]
        [--policies vllm,llm-d,lmetric,...] [--seeds 0,1,2]

The rules are the paper preset's (:mod:`kvroute.sim.compare`, :mod:`kvroute.sim.capacity`), on a
smaller cluster: the light rate is the preset's scaled by instances / 16; the SLO of a workload is
5× TTFT p99 and 10× TPOT p99 of ``vllm`` without the queue at the light rate (seed 0); capacity is
searched from the light rate (×2 ramps, 3 bisections: within 9 %) for every arm and seed, the same for
every arm. Mooncake (a replayed trace: one seed) is included when ``../shared`` has it. Writes
``benchmarks/results/router_queue_study.json`` and ``docs/results/router-queue.md``. Not part of
``make bench`` (minutes of CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, write
from kvroute.commands.compare import MOONCAKE, shared_dir
from kvroute.sim.capacity import CapacityRule, CapacitySearch, Slo
from kvroute.sim.compare import (
    PAPER_POLICIES,
    ROUTER_QUEUE,
    PaperPlan,
    SpecRunner,
    paper_plan,
    run_capacity,
)

DOC = ROOT / "docs" / "results" / "router-queue.md"


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.study_router_queue")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--policies", default=",".join(PAPER_POLICIES))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--mooncake", default=None, help="the Mooncake conversation trace (default: from ../shared)"
    )
    p.add_argument("--rerender", action="store_true", help="rewrite the markdown from the JSON, run nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    if args.rerender:
        import json

        from benchmarks.common import RESULTS

        result = json.loads((RESULTS / "router_queue_study.json").read_text())
        DOC.write_text(markdown(result, {w["name"]: Slo(**w["slo"]) for w in result["workloads"]}))
        print(f"wrote {DOC.relative_to(ROOT)}")
        return 0
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    seeds = tuple(int(s) for s in args.seeds.split(","))
    arms = [a for p in policies for a in (p, p + ROUTER_QUEUE)]
    scale = args.instances / 16
    shared = shared_dir()
    trace = Path(args.mooncake) if args.mooncake else (shared / MOONCAKE if shared is not None else None)
    base = paper_plan(str(trace) if trace is not None and trace.is_file() else None, args.duration)
    workloads = tuple(dataclasses.replace(w, light_rate=w.light_rate * scale) for w in base.workloads)
    plan = PaperPlan(
        workloads, instances=args.instances, seeds=seeds, policies=tuple(arms), reference=arms[0]
    )
    t0 = time.perf_counter()
    with SpecRunner(args.jobs) as runner:
        lights = runner.run([w.spec(plan, plan.reference, w.light_rate) for w in workloads])
        slos = {w.name: plan.slo(light) for w, light in zip(workloads, lights, strict=True)}
        searches = {
            (w.name, arm, s): CapacitySearch(CapacityRule(w.light_rate, slos[w.name], plan.factor, 3))
            for w in workloads
            for arm in arms
            for s in w.seeds(plan)
        }
        wmap = {w.name: w for w in workloads}
        caps = run_capacity(searches, lambda k, r: wmap[k[0]].spec(plan, k[1], r, seed=k[2]), runner.run)
        # TTFT p99 at the light rate: the first probe of every search is that run
        light_runs = runner.run([wmap[k[0]].spec(plan, k[1], wmap[k[0]].light_rate, seed=k[2]) for k in caps])
    result = {
        "command": "python -m benchmarks.study_router_queue "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "instances": args.instances,
        "duration": args.duration,
        "seeds": list(seeds),
        "arms": arms,
        "wall_seconds": time.perf_counter() - t0,
        "loadavg_at_end": os.getloadavg(),
        "workloads": [
            {
                "name": w.name,
                "light_rate": w.light_rate,
                "seeds": list(w.seeds(plan)),
                "slo": dataclasses.asdict(slos[w.name]),
            }
            for w in workloads
        ],
        "rows": [
            {
                "workload": k[0],
                "arm": k[1],
                "seed": k[2],
                "capacity": c.rate,
                "failed_rate": c.failed_rate,
                "probes": len(c.probes),
                "light_ttft_p99_ms": light["ttft_ms"]["p99"],
                "light_ttft_mean_ms": light["ttft_ms"]["mean"],
                "light_queued": light.get("router_queue", {}).get("queued", 0),
                "light_requests": light["requests"],
            }
            for (k, c), light in zip(caps.items(), light_runs, strict=True)
        ],
    }
    write("router_queue_study.json", result)
    DOC.write_text(markdown(result, slos))
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


def _mean(xs: list[float | None]) -> float:
    vals = [x for x in xs if x is not None]
    return statistics.fmean(vals) if len(vals) == len(xs) and vals else math.nan


WHAT = """## What `--router-queue` does

A request is routed by the routing core over all its candidates, as they are now; it goes out only
when the instance the policy chose can take it. An instance is *saturated* when its next step cannot
start a new request's prefill: what the next step owes the work already there (one token per running
sequence plus the queued prefill the step in progress leaves over) reaches its chunk budget
(`max_num_batched_tokens`), or its batch is full (`running + waiting >= max_num_seqs`). A request
whose choice is saturated waits at the router and is routed again, from fresh views, at every state
change of an instance (in the simulator: every engine step end, with a fresh copy of that engine's
load); priority bands (request classes by BS weight), fair share between users (start-time fair
queueing over tokens) and a TTL (503 with `Retry-After`) order and bound the wait. A waiting
request *claims* the instance it waits for: later decisions see it there, in `waiting` and in the
queued prefill, as if it had been sent (saturation is still read from the engine's own view). The
engine's queued prefill counts a waiting request's uncached tokens only (its prefix-cache hit is
looked up on arrival), as a router counts the requests it sent. The code:
`src/kvroute/routing/queue.py`; the simulator's driver: `src/kvroute/sim/cluster.py`.
"""


def _verdict(result: dict[str, Any]) -> list[str]:
    """Where the queue wins, ties and loses, computed from the rows (ratios of the seed means)."""
    rows = result["rows"]
    arms = [a for a in result["arms"] if not a.endswith(ROUTER_QUEUE)]
    cap: dict[str, list[str]] = {"higher": [], "equal": [], "lower": []}
    light_worse = []
    for w in result["workloads"]:
        for arm in arms:
            off = [r for r in rows if r["workload"] == w["name"] and r["arm"] == arm]
            on = [r for r in rows if r["workload"] == w["name"] and r["arm"] == arm + ROUTER_QUEUE]
            c_off, c_on = _mean([r["capacity"] for r in off]), _mean([r["capacity"] for r in on])
            key = "higher" if c_on > c_off * 1.0001 else "lower" if c_on < c_off * 0.9999 else "equal"
            cap[key].append(f"{arm} on {w['name']} ({c_on / c_off:.2f}×)")
            l_off = _mean([r["light_ttft_p99_ms"] for r in off])
            l_on = _mean([r["light_ttft_p99_ms"] for r in on])
            if l_on > l_off * 1.0001:
                light_worse.append(f"{arm} on {w['name']} ({l_off:.1f} → {l_on:.1f} ms)")
    n = sum(len(v) for v in cap.values())
    return [
        "## Summary (computed from the rows below)",
        "",
        f"- Capacity at the SLO with the queue: higher in {len(cap['higher'])} of {n} (policy, workload) "
        f"pairs, equal in {len(cap['equal'])}, lower in {len(cap['lower'])}.",
        f"  Higher: {', '.join(cap['higher']) or 'none'}.",
        f"  Lower: {', '.join(cap['lower']) or 'none'}.",
        f"- TTFT p99 at the light rate, worse with the queue: {', '.join(light_worse) or 'nowhere'}.",
        "",
    ]


def markdown(result: dict[str, Any], slos: dict[str, Slo]) -> str:
    rows = result["rows"]
    lines = [
        "# The router-side queue: capacity at the SLO and light-load TTFT, with and without",
        "",
        "<!-- generated by the command below; edits are overwritten -->",
        "",
        f"Command: `{result['command']}` — {result['instances']} simulated instances, "
        f"{result['duration']:g} s of arrivals per run, seeds {result['seeds']} (Mooncake: a replayed "
        f"trace, seed 0 only). {len(rows)} capacity searches; wall {result['wall_seconds']:.0f} s; "
        f"load average at the end {result['loadavg_at_end'][0]:.1f} (a shared 2-core machine).",
        "",
        "Rules (the paper preset's, `kvroute.sim.compare`): light rate = the preset's × instances / 16; "
        "SLO = 5× TTFT p99 and 10× TPOT p99 of `vllm` without the queue at the light rate; capacity = the "
        "highest rate scale whose run meets the SLO with every request finished, searched from the light "
        "rate (×2 ramps, 3 bisections: within 9 %), the same search for every arm and seed. `+queue`: "
        "`--router-queue` with its defaults (TTL 30 s, no tick). Capacity and TTFT are means over seeds.",
        "",
        WHAT,
        *_verdict(result),
    ]
    for w in result["workloads"]:
        name = w["name"]
        slo = slos[name]
        lines += [
            f"## {name}",
            "",
            f"SLO: TTFT p99 ≤ {slo.ttft_p99_ms:.0f} ms, TPOT p99 ≤ {slo.tpot_p99_ms:.1f} ms; light rate "
            f"×{w['light_rate']:g}.",
            "",
            "| policy | capacity | capacity +queue | ratio | light TTFT p99 (ms) | +queue | queued at light load |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        arms = [a for a in result["arms"] if not a.endswith(ROUTER_QUEUE)]
        for arm in arms:
            off = [r for r in rows if r["workload"] == name and r["arm"] == arm]
            on = [r for r in rows if r["workload"] == name and r["arm"] == arm + ROUTER_QUEUE]
            c_off = _mean([r["capacity"] for r in off])
            c_on = _mean([r["capacity"] for r in on])
            l_off = _mean([r["light_ttft_p99_ms"] for r in off])
            l_on = _mean([r["light_ttft_p99_ms"] for r in on])
            queued = sum(r["light_queued"] for r in on)
            total = sum(r["light_requests"] for r in on)
            lines.append(
                f"| {arm} | ×{c_off:.3g} | ×{c_on:.3g} | {c_on / c_off:.2f} | {l_off:.1f} | {l_on:.1f} | "
                f"{queued}/{total} |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
