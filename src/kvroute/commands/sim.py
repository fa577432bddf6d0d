"""`kvroute sim`: replay a trace or a synthetic workload through a simulated cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY

HELP = "simulate a cluster of engine models routed by a policy"


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """Workload flags shared by `sim` and `compare`."""
    from kvroute.workloads import TRACE_FORMATS, WORKLOADS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="FILE", help="trace file to replay")
    src.add_argument("--workload", metavar="NAME", help=f"synthetic workload: {', '.join(WORKLOADS)}")
    p.add_argument("--format", default="auto", help=f"trace format: auto, {', '.join(TRACE_FORMATS)}")
    p.add_argument("--rate-scale", type=float, default=1.0, help="replay arrivals X times faster")
    p.add_argument("--duration", type=float, default=None, help="stop arrivals after S seconds")
    p.add_argument("--seed", type=int, default=0, help="seed for synthetic workloads and random policies")
    p.add_argument("--skip-bad-lines", action="store_true", help="skip (and count) malformed trace lines")


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """Cluster and engine flags shared by `sim` and `compare`."""
    p.add_argument("--instances", type=int, default=16, help="engine instances (default 16)")
    p.add_argument("--profile", default=None, help="named cost profile (see `kvroute profiles`)")
    p.add_argument("--profile-dir", default=None, help="LLMServingSim-format profile folder")
    p.add_argument(
        "--model-config",
        metavar="FILE",
        default=None,
        help="the model's Hugging Face config.json for --profile-dir (default: a config.json beside it)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree for --profile-dir")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV capacity per instance in tokens")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="engines without prefix caching (vLLM's --no-enable-prefix-caching): no KV hits, no KV events",
    )
    p.add_argument("--kv-view", default="exact", help="router's KV view: exact (KV events) or approx")
    p.add_argument("--scrape-interval", type=float, default=0.05, help="seconds between load copies")
    p.add_argument("--event-delay", type=float, default=0.002, help="seconds before KV events arrive")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_cluster_arguments(p)
    p.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"routing policy (see the registry; default {DEFAULT_POLICY}, behind the router-side queue)",
    )
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--shadow",
        metavar="POLICIES",
        help="comma-separated policies computed beside --policy at every decision, from the same views "
        "(agreement and predicted score/cached-token differences in the output and JSON)",
    )
    from kvroute.commands.settings import add_feature_arguments

    add_feature_arguments(p, simulation=True)


def spec_from_args(
    args: argparse.Namespace, policy: str, rate_scale: float | None = None, queue: Any = None
) -> Any:
    """The run the flags describe; ``queue``: the router-side queue (a ``QueueConfig``, or None: off)
    when no flag turns it on or off (`kvroute sim` passes the default's, `compare` None: its arms
    say)."""
    from kvroute.commands.settings import features_from_args, queue_from_args, scenario_from_args
    from kvroute.routing.shadow import parse_shadow_names
    from kvroute.sim.runner import RunSpec

    return RunSpec(
        policy=policy,
        instances=args.instances,
        trace=args.trace,
        fmt=args.format,
        workload=args.workload,
        rate_scale=args.rate_scale if rate_scale is None else rate_scale,
        duration=args.duration,
        seed=args.seed,
        skip_bad_lines=args.skip_bad_lines,
        profile=args.profile,
        profile_dir=args.profile_dir,
        model_config=args.model_config,
        tp=args.tp,
        kv_tokens=args.kv_tokens,
        prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_view=args.kv_view,
        scrape_interval=args.scrape_interval,
        event_delay=args.event_delay,
        features=features_from_args(args, seq_capacity=args.max_num_seqs),
        scenario=scenario_from_args(args),
        shadow=parse_shadow_names(args.shadow) if getattr(args, "shadow", None) else (),
        router_queue=queue_from_args(args, queue),
    )


def run_with_progress(spec: Any, show: bool) -> dict[str, Any]:
    """Run one spec, with a transient progress line on a terminal; ``command`` is added to the result."""
    from kvroute.commands.settings import sim_command
    from kvroute.sim.runner import run_spec

    if not show:
        return run_spec(spec) | {"command": sim_command(spec)}
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
    ) as bar:
        task = bar.add_task(f"{spec.policy}: starting")

        def report(t: float, routed: int, done: int) -> None:
            bar.update(
                task, description=f"{spec.policy}: {t:,.0f} s simulated, {routed:,} routed, {done:,} done"
            )

        return run_spec(spec, report) | {"command": sim_command(spec)}


def print_summary(out: dict[str, Any]) -> None:
    from kvroute.metrics import comparison_table

    print(comparison_table([out]))
    print(
        f"\n{out['requests']:,} requests ({out['unfinished']} unfinished, {out['rejected']} rejected), "
        f"{out['sim_seconds']:,.1f} s simulated in {out['wall_seconds']:.1f} s wall "
        f"({out['sim_seconds'] / max(out['wall_seconds'], 1e-9):,.0f}x real time)"
    )
    for name, sh in out.get("shadow", {}).items():
        print(
            f"shadow {name}: agrees {sh['agreement']:.1%}; its choice: P-token×(BS+1) "
            f"{sh['mean_score_diff']:+,.0f}, cached tokens {sh['mean_cached_diff']:+,.1f} on average"
        )
    q = out.get("router_queue")
    if q is not None:
        print(
            f"router-side queue: {q['queued']:,} held back ({q['expired']:,} past the TTL), wait p99 "
            f"{q['wait_ms']['p99']:,.1f} ms (--no-router-queue: without it)"
        )
    else:
        print("router-side queue: off")
    if out.get("skipped_lines"):
        print(f"skipped {out['skipped_lines']} bad trace lines")


def write_json(path: str, data: Any) -> None:
    try:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    from kvroute.routing.queue import default_queue

    spec = spec_from_args(args, args.policy, queue=default_queue())
    out = run_with_progress(spec, show=not args.no_progress and sys.stderr.isatty())
    print_summary(out)
    if args.json:
        write_json(args.json, out)
    return 0
