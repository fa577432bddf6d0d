"""``kvroute validate``: replay a real vLLM run through the engine model; measured vs simulated latencies."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from kvroute.engine.cost import (
    DEFAULT_PROFILE,
    ProfileCostModel,
    get_profile,
    kv_capacity_tokens,
    profile_from_dir,
)
from kvroute.errors import UserError
from kvroute.sim.validate import compare, load_bench, measured_latencies, simulate

HELP = "replay a vLLM benchmark run (LLMServingSim bench folder) and compare TTFT/TPOT/e2e with the model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bench", required=True, help="bench folder with vllm/meta.json, vllm/requests.jsonl"
    )
    parser.add_argument(
        "--profile-dir",
        help=f"LLMServingSim v1 profile folder (meta.yaml, tp<N>/); default: the packaged {DEFAULT_PROFILE}",
    )
    parser.add_argument("--tp", type=int, default=None, help="TP degree of the profile (default: the run's)")
    parser.add_argument("--policy", default="vllm", help="DP routing policy (default: vllm, as the real run)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument("--json", help="write measured, simulated and error_pct to this file")


def run(args: argparse.Namespace) -> int:
    bench = load_bench(args.bench)
    tp = args.tp if args.tp is not None else bench.tp
    if tp < 1:
        raise UserError("--tp must be >= 1")
    if args.profile_dir:
        prof = profile_from_dir(args.profile_dir, tp)
    else:
        if tp != 1:
            raise UserError(f"the packaged profile is TP 1; give --profile-dir for --tp {tp}")
        prof = get_profile(DEFAULT_PROFILE)
    if prof.model.name != bench.model:
        raise UserError(f"profile is for {prof.model.name}, the bench run used {bench.model}")
    if not isinstance(prof.cost, ProfileCostModel):
        raise UserError(f"profile {prof.name} has no per-layer tables")
    kv_tokens = kv_capacity_tokens(prof.gpu, prof.model, ep=bench.ep, tp=tp)
    sim = simulate(
        bench,
        prof.cost,
        num_kv_blocks=kv_tokens // args.block_size,
        block_size=args.block_size,
        policy=args.policy,
    )
    result = compare(measured_latencies(bench), sim)
    print(
        f"bench {bench.path}: {len(bench.requests)} requests, {bench.model}, dp={bench.dp} tp={bench.tp} "
        f"ep={bench.ep}, max_num_seqs={bench.max_num_seqs}, "
        f"max_num_batched_tokens={bench.max_num_batched_tokens}"
    )
    print(f"profile {prof.name}: KV {kv_tokens:,} tokens per rank; policy {args.policy}")
    print(f"{'metric':<12}{'stat':>6}{'measured':>12}{'simulated':>12}{'error':>9}")
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for stat, label in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99")):
            m = result["measured"][metric][stat]
            s = result["simulated"][metric][stat]
            e = result["error_pct"][metric][stat]
            err = f"{e:+.1f}%" if not math.isnan(e) else "n/a"
            print(f"{metric:<12}{label:>6}{m:>12.1f}{s:>12.1f}{err:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
