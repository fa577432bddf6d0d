"""The main job's arms in any order, in one process, as `kvroute demo` runs them: where a gap between
two policies' client-side TTFT comes from.

    .venv/bin/python -m benchmarks.study_demo_arms [--order lmetric-time,lmetric,lmetric,lmetric-time]
        [--duration 60] [--no-level] [--instances 4] [--rate-scale 1.4] [--seed 0] [--out demo_arms.json]

An arm is a policy, optionally followed by shadow policies the router also computes for every request
(``lmetric+lmetric-time``: lmetric's decisions, plus lmetric-time's routing on each request's path);
``lmetric+lmetric`` beside ``lmetric+lmetric-time`` differ only in the scoring code the router runs. A
policy may appear several times: interleaved rounds (an ABBA order shows what the position costs).
``--no-level`` runs the arms as the job did before it levelled them (the first arm makes the prompts'
text; no collection between arms).

Per arm: the client's and the engines' mean TTFT (model ms) and their difference (what happens
outside the engines: router, HTTP, tokenizing, streaming, the client), the client mean's standard
error, this process's CPU per request (router and client share it), the router's routing and decide
time per request (wall ms, from its /metrics), full GC passes and the collector's pauses, the prompt
blocks the client made, and the load average before each arm. Writes
``benchmarks/results/<--out>``. Not part of ``make bench`` (about 70 s per arm at the defaults).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from benchmarks.common import write
from kvroute.commands import demo
from kvroute.commands.demo_meter import level, unlevel
from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY, make_policy


def _arms(order: str) -> list[tuple[str, str, tuple[str, ...]]]:
    """(label, policy, shadow policies) per arm of ``order`` (comma-separated ``policy[+shadow...]``)."""
    arms = []
    for label in (a.strip() for a in order.split(",")):
        if not label:
            continue
        policy, *shadow = label.split("+")
        for name in (policy, *shadow):
            make_policy(name)  # UserError naming the valid ones
        arms.append((label, policy, tuple(shadow)))
    if not arms:
        raise UserError("--order: give at least one arm")
    return arms


HEADERS = (
    "#",
    "arm",
    "client TTFT (ms)",
    "engines' TTFT (ms)",
    "outside the engines (ms)",
    "CPU (ms/request)",
    "routing (ms/request)",
    "decide (ms/request)",
    "full GC passes",
    "GC pauses (ms)",
    "text blocks made",
    "load before",
)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The arms as a markdown table (TTFT in model ms ± the client mean's standard error)."""
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---:|" * len(HEADERS)]
    for r in rows:
        cells = (
            str(r["position"]),
            f"`{r['arm']}`",
            f"{r['ttft_ms']['mean']:.1f} ± {r['ttft_se_ms']:.1f}",
            f"{r['engine_ttft_ms_mean']:.1f}",
            f"{r['ttft_ms']['mean'] - r['engine_ttft_ms_mean']:.1f}",
            f"{r['process_cpu_ms_per_request']:.2f}",
            f"{r['routing_ms_per_request']:.2f}",
            f"{r['decide_ms_per_request']:.3f}",
            str(r["gc_full"]),
            f"{r['gc_pause_ms']:.0f}",
            str(r["text_blocks_made"]),
            f"{r['loadavg_before'][0]:.2f}",
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="study_demo_arms", description=__doc__.split("\n\n")[0])
    p.add_argument("--order", default=f"{DEFAULT_POLICY},lmetric,lmetric,{DEFAULT_POLICY}")
    p.add_argument("--duration", type=float, default=60.0, help="model seconds of arrivals per arm")
    p.add_argument("--instances", type=int, default=4)
    p.add_argument("--rate-scale", type=float, default=demo.RATE_SCALE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-level", action="store_true", help="as the job ran before levelling its arms")
    p.add_argument("--out", default="demo_arms.json", help="file name under benchmarks/results/")
    a = p.parse_args(argv)
    try:
        arms = _arms(a.order)
        if os.path.basename(a.out) != a.out or not a.out.endswith(".json"):
            raise UserError(f"--out: a file name ending in .json, not a path ({a.out!r})")
    except UserError as exc:
        print(f"study_demo_arms: {exc}", file=sys.stderr)
        return 2
    from kvroute.loadgen import BlockText
    from kvroute.server.run import run_loop
    from kvroute.tokenizer import load_tokenizer

    ns = argparse.Namespace(
        instances=a.instances,
        time_scale=1.0,
        workload=demo.WORKLOAD,
        seed=a.seed,
        rate_scale=a.rate_scale,
        duration=a.duration,
        gateway="none",
    )
    text = BlockText(load_tokenizer())
    reqs = demo._requests(ns)
    rows: list[dict[str, Any]] = []

    async def run() -> int:
        try:
            for i, (label, policy, shadow) in enumerate(arms):
                if not a.no_level:
                    level(text, reqs)
                row = await demo._one(policy, label, ns, text, reqs, None, shadow)
                rows.append({**row, "arm": label, "position": i + 1})
        finally:
            unlevel()
        return 0

    run_loop(run)
    print(markdown(rows), flush=True)
    write(
        a.out,
        {
            "order": a.order,
            "levelled": not a.no_level,
            "duration_s": a.duration,
            "instances": a.instances,
            "rate_scale": a.rate_scale,
            "seed": a.seed,
            "rows": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
