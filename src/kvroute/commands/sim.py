"""`kvroute sim`: replay a trace or a synthetic workload through a simulated cluster."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvroute.errors import UserError

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
    p.add_argument("--tp", type=int, default=1, help="tensor parallel degree for --profile-dir")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV capacity per instance in tokens")
    p.add_argument("--kv-view", default="exact", help="router's KV view: exact (KV events) or approx")
    p.add_argument("--scrape-interval", type=float, default=0.05, help="seconds between load copies")
    p.add_argument(
        "--event-delay", type=float, default=0.002, help="seconds before KV events reach the router"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_workload_arguments(p)
    add_cluster_arguments(p)
    p.add_argument("--policy", default="lmetric", help="routing policy (see the registry; default lmetric)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_profile(args: argparse.Namespace) -> Any:
    from kvroute.engine.cost import DEFAULT_PROFILE, get_profile, profile_from_dir

    if args.profile and args.profile_dir:
        raise UserError("give --profile or --profile-dir, not both")
    if args.profile_dir:
        return profile_from_dir(args.profile_dir, tp=args.tp)
    return get_profile(args.profile or DEFAULT_PROFILE)


def sim_config(args: argparse.Namespace, policy: str, kv_tokens: int) -> Any:
    from kvroute.sim.cluster import SimConfig

    cfg = SimConfig(
        instances=args.instances,
        policy=policy,
        kv_capacity_tokens=args.kv_tokens or kv_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_view=args.kv_view,
        scrape_interval=args.scrape_interval,
        event_delay=args.event_delay,
        seed=args.seed,
    )
    cfg.check()
    return cfg


def simulate(args: argparse.Namespace, policy_name: str, progress: bool = False) -> dict[str, Any]:
    """One run: the summary dict of the command-line contract (plus workload details)."""
    import random

    from kvroute.policies.registry import make_policy
    from kvroute.sim.cluster import ClusterSim
    from kvroute.workloads import open_workload

    if args.trace is None and args.workload is None:
        raise UserError("give --trace FILE or --workload NAME")
    profile = load_profile(args)
    cfg = sim_config(args, policy_name, profile.kv_capacity_tokens)
    policy = make_policy(policy_name, random.Random(args.seed))
    stream, stats = open_workload(
        args.trace, args.format, args.workload, args.rate_scale, args.duration, args.seed, args.skip_bad_lines
    )
    sim = ClusterSim(cfg, policy, profile.cost)
    if progress:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        with Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), transient=True
        ) as bar:
            task = bar.add_task(f"{policy_name}: starting")

            def report(t: float, routed: int, done: int) -> None:
                bar.update(
                    task, description=f"{policy_name}: sim {t:,.0f} s, {routed:,} routed, {done:,} done"
                )

            out = sim.run(stream, report)
    else:
        out = sim.run(stream)
    out["profile"] = profile.name
    out["workload"] = args.trace or args.workload
    out["rate_scale"] = args.rate_scale
    out["skipped_lines"] = stats.bad_lines
    return out


def command_line(args: argparse.Namespace, policy: str) -> str:
    """The `kvroute sim` command that reproduces one run."""
    parts = ["kvroute sim"]
    parts += [f"--trace {args.trace}"] if args.trace else [f"--workload {args.workload}"]
    if args.duration:
        parts.append(f"--duration {args.duration:g}")
    if args.rate_scale != 1.0:
        parts.append(f"--rate-scale {args.rate_scale:g}")
    parts += [f"--instances {args.instances}", f"--policy {policy}"]
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.profile:
        parts.append(f"--profile {args.profile}")
    return " ".join(parts)


def print_summary(out: dict[str, Any]) -> None:
    from kvroute.metrics import comparison_table

    print(comparison_table([out]))
    print(
        f"\n{out['requests']:,} requests ({out['unfinished']} unfinished, {out['rejected']} rejected), "
        f"{out['sim_seconds']:,.1f} s simulated in {out['wall_seconds']:.1f} s wall "
        f"({out['sim_seconds'] / max(out['wall_seconds'], 1e-9):,.0f}x real time)"
    )


def run(args: argparse.Namespace) -> int:
    show = not args.no_progress and sys.stderr.isatty()
    out = simulate(args, args.policy, progress=show)
    print_summary(out)
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {args.json}: {exc.strerror}") from None
    return 0
