"""``kvroute validate``: replay a real vLLM run through the engine model; measured vs simulated latencies."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from kvroute.engine.cost import (
    DEFAULT_PROFILE,
    Profile,
    ProfileCostModel,
    get_profile,
    kv_capacity_tokens,
    profile_from_dir,
)
from kvroute.errors import UserError
from kvroute.sim.validate import BenchRun, compare, load_bench, measured_latencies, simulate

HELP = "replay a vLLM benchmark run (LLMServingSim bench folder) and compare TTFT/TPOT/e2e with the model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bench", required=True, help="bench folder with vllm/meta.json, vllm/requests.jsonl"
    )
    src = parser.add_mutually_exclusive_group()
    src.add_argument(
        "--profile-dir",
        help=f"LLMServingSim v1 profile folder (meta.yaml, tp<N>/); default: the packaged {DEFAULT_PROFILE}",
    )
    src.add_argument("--profile", help="a named packaged profile instead (see `kvroute profiles`)")
    parser.add_argument(
        "--model-config",
        metavar="FILE",
        help="the model's Hugging Face config.json for --profile-dir (default: a config.json beside it)",
    )
    parser.add_argument("--tp", type=int, default=None, help="TP degree of the profile (default: the run's)")
    parser.add_argument("--policy", default="vllm", help="DP routing policy (default: vllm, as the real run)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")
    parser.add_argument("--json", help="write the run, the profile, measured, simulated and error_pct here")


def _profile(args: argparse.Namespace, tp: int) -> Profile:
    if args.model_config and not args.profile_dir:
        raise UserError("--model-config goes with --profile-dir")
    if args.profile_dir:
        return profile_from_dir(args.profile_dir, tp, model_config=args.model_config)
    name = args.profile or DEFAULT_PROFILE
    if tp != 1:
        raise UserError(f"the packaged profile {name} is TP 1; give --profile-dir for --tp {tp}")
    return get_profile(name)


def validate_run(args: argparse.Namespace) -> tuple[BenchRun, Profile, int, dict[str, Any]]:
    """(bench run, profile, KV tokens per rank, result dict) for the parsed flags."""
    bench = load_bench(args.bench)
    tp = args.tp if args.tp is not None else bench.tp
    if tp < 1:
        raise UserError("--tp must be >= 1")
    if args.block_size < 1:
        raise UserError("--block-size must be >= 1")
    prof = _profile(args, tp)
    if prof.model.name != bench.model:
        raise UserError(
            f"profile {prof.name} is for {prof.model.name}, the bench run used {bench.model}; "
            "give that model's --profile-dir (and --model-config) or --profile NAME"
        )
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
    info = {
        "bench": str(args.bench),
        "model": bench.model,
        "requests": len(bench.requests),
        "dp": bench.dp,
        "tp": bench.tp,
        "ep": bench.ep,
        "max_num_seqs": bench.max_num_seqs,
        "max_num_batched_tokens": bench.max_num_batched_tokens,
        "run_hardware": bench.hardware,
        "profile": prof.name,
        "profile_source": prof.source,
        "profile_hardware": prof.gpu.key or prof.gpu.name,
        "kv_tokens_per_rank": kv_tokens,
        "policy": args.policy,
    }
    return bench, prof, kv_tokens, {"run": info, **result}


def run(args: argparse.Namespace) -> int:
    bench, prof, kv_tokens, result = validate_run(args)
    print(
        f"bench {bench.path}: {len(bench.requests)} requests, {bench.model}, dp={bench.dp} tp={bench.tp} "
        f"ep={bench.ep}, max_num_seqs={bench.max_num_seqs}, "
        f"max_num_batched_tokens={bench.max_num_batched_tokens}"
    )
    print(f"profile {prof.name}: KV {kv_tokens:,} tokens per rank; policy {args.policy}")
    if bench.hardware and prof.gpu.key and bench.hardware != prof.gpu.key:
        print(
            f"note: the run used {bench.hardware}, the profile was measured on {prof.gpu.key}: "
            "the errors below include the hardware difference"
        )
    print(f"{'metric':<12}{'stat':>6}{'measured':>12}{'simulated':>12}{'error':>9}")
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        for stat, label in (("mean", "mean"), ("p50", "median"), ("p90", "p90"), ("p99", "p99")):
            m = result["measured"][metric][stat]
            s = result["simulated"][metric][stat]
            e = result["error_pct"][metric][stat]
            err = f"{e:+.1f}%" if not math.isnan(e) else "n/a"
            print(f"{metric:<12}{label:>6}{m:>12.1f}{s:>12.1f}{err:>9}")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"cannot write {args.json}: {exc.strerror}") from None
    return 0
