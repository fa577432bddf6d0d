"""``kvroute profiles``: the named cost profiles, where their numbers come from, and key step times."""

from __future__ import annotations

import argparse

from kvroute.engine.cost import get_profile, profile_names

HELP = "list the named cost profiles with their source and key numbers"

# (label, prefill chunks [(tokens, history)], decode sequences, mean decode context in tokens)
PROBES: tuple[tuple[str, tuple[tuple[int, int], ...], int, int], ...] = (
    ("decode b=1", (), 1, 1024),
    ("decode b=8", (), 8, 1024),
    ("decode b=64", (), 64, 1024),
    ("prefill 2048", ((2048, 0),), 0, 0),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default 16)")


def run(args: argparse.Namespace) -> int:
    for name in profile_names():
        p = get_profile(name)
        print(f"{p.name}")
        print(f"  {p.description}")
        print(f"  source: {p.source}")
        times = ", ".join(
            f"{label} {p.cost.step_time(pf, nd, nd * kv) * 1e3:.1f} ms" for label, pf, nd, kv in PROBES
        )
        print(f"  step: {times} (decode context 1024 tokens)")
        print(
            f"  KV: {p.kv_capacity_tokens:,} tokens = {p.num_kv_blocks(args.block_size):,} blocks of "
            f"{args.block_size} ({p.gpu.name}, {p.model.kv_bytes_per_token // 1024} KiB/token, "
            f"weights {p.model.weight_bytes() / 2**30:.1f} GiB)"
        )
    return 0
