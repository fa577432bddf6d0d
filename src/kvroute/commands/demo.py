"""`kvroute demo`: the main job on an embedded default — a generated multi-turn chat workload on a
simulated 16-instance cluster, routed by `lmetric`, `vllm` and `llm-d`, side by side.

Needs nothing outside the package (no ../shared). Minutes, not hours, on 2 cores.
"""

from __future__ import annotations

import argparse
import sys

from kvroute.metrics import comparison_table

HELP = "the main job: compare lmetric with vLLM- and llm-d-style routing on a generated chat workload"

POLICIES = ("lmetric", "vllm", "llm-d")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=300.0, help="seconds of arrivals (default 300)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the workload's arrival rate")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from kvroute.commands.sim import run_with_progress
    from kvroute.sim.runner import RunSpec

    show = sys.stderr.isatty()
    rows = []
    print(
        f"Simulating {args.duration:g} s of the generated `chatbot` workload on {args.instances} instances "
        "(Qwen3-30B-A3B, RTX PRO 6000 profile) with each policy ...",
        flush=True,
    )
    for policy in POLICIES:
        spec = RunSpec(
            policy=policy,
            instances=args.instances,
            workload="chatbot",
            duration=args.duration,
            rate_scale=args.rate_scale,
            seed=args.seed,
        )
        out = run_with_progress(spec, show)
        rows.append(out)
        print(f"  {policy}: {out['requests']:,} requests in {out['wall_seconds']:.1f} s wall", flush=True)
    print()
    print(comparison_table(rows))
    print("\nReproduce a row:")
    for out in rows:
        print(f"  {out['command']}")
    print(
        "\nNext: the real Mooncake trace (needs ../shared):\n"
        "  kvroute sim --trace ../shared/traces/mooncake/conversation_trace.jsonl --instances 16 --policy lmetric"
    )
    return 0
