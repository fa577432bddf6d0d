"""The bound with and without KV capacity (docs/results/bound.md), beside what ``lmetric`` reaches.

For each workload of the committed paper preset (``docs/results/paper/paper.json``: its rates,
durations and 16 instances) and for the preset's Mooncake conversation trace run (×2.83, 1200 s,
16 instances, when the trace is given): the bound's terms for any admission order (the
infinite-cache oracle's hit rate, the mean TTFT lower bound) and with KV capacity (the pooled
cache's hit-rate ceiling and its mean TTFT lower bound), and ``lmetric``'s simulated mean TTFT and
KV hit rate on the same workload; at the profile's KV pool and at an eighth of it (where the pools
bind). And the bound's own cost on long contexts: 600 requests of 40 conversations whose contexts
grow to 200,000 tokens (16-token blocks, 3 million block ids), 8 instances (no simulation there).
And the capacity bound at the preset's SLO for the Mooncake trace, with and without the KV capacity
conditions, on the preset's own run (30 s of arrivals), beside ``lmetric``'s committed capacity
there (seed 0); the synthetic workloads' searches reach ×100 and more (over 100,000 requests a
probe), too slow for this study.
Writes ``benchmarks/results/bound_kv.json``::

    python -m benchmarks.study_bound --trace ../shared/traces/mooncake/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import ROOT, SHARED, write
from kvroute.commands.preset_report import capacities
from kvroute.sim.bound import bound_summary, spec_bound, spec_engine, workload_bound
from kvroute.sim.runner import RunSpec, load_profile, run_spec
from kvroute.workloads.request import Request

PRESET = ROOT / "docs" / "results" / "paper" / "paper.json"
POLICY = "lmetric"
POOL_FRACTIONS = (1.0, 0.125)
MOONCAKE_RATE = 2.0**1.5  # the preset's default load on the trace (×2.83)
MOONCAKE_DURATION = 1200.0  # the preset's Mooncake duration (s of scaled arrivals)
CAPACITY_WORKLOADS = ("mooncake",)  # whose capacity bound is searched (the others' are slow)


def cases(trace: str | None) -> list[tuple[str, RunSpec]]:
    """(name, spec) per workload: the committed preset's, then the Mooncake trace's."""
    preset = json.loads(PRESET.read_text())
    instances = int(preset["plan"]["instances"])
    out = [
        (
            w["name"],
            RunSpec(
                workload=w["workload"],
                trace=w["trace"],
                instances=instances,
                rate_scale=float(w["default_rate"]),
                duration=float(w["duration"]),
                seed=int(preset["plan"]["seeds"][0]),
                policy=POLICY,
            ),
        )
        for w in preset["workloads"]
        if w["trace"] is None
    ]
    if trace is not None:
        out.append(
            (
                "mooncake",
                RunSpec(
                    trace=trace,
                    instances=instances,
                    rate_scale=MOONCAKE_RATE,
                    duration=MOONCAKE_DURATION,
                    policy=POLICY,
                ),
            )
        )
    return out


def measure(name: str, spec: RunSpec) -> dict[str, Any]:
    """The bound's terms and the policy's run on ``spec``."""
    t0 = time.perf_counter()
    b = spec_bound(spec, spec_engine(spec))
    bound_s = time.perf_counter() - t0
    run = run_spec(spec)
    mean = float(run["ttft_ms"]["mean"])
    return {
        "workload": name,
        "instances": spec.instances,
        "rate_scale": spec.rate_scale,
        "duration_s": spec.duration,
        "kv_tokens_per_instance": spec_engine(spec).kv_capacity_tokens,
        "requests": b.requests,
        "pooled_cache_blocks": b.kv_capacity_blocks,
        "oracle_kv_hit_rate": b.oracle_hit_rate,
        "kv_hit_rate_ceiling": b.kv_hit_rate_ceiling,
        "ttft_mean_bound_any_order_ms": b.ttft_mean_any_order_ms,
        "ttft_mean_bound_ms": b.ttft_mean_bound_ms,
        "bound_seconds": bound_s,
        POLICY: {
            "ttft_mean_ms": mean,
            "kv_hit_rate": run["kv_hit_rate"],
            "preemptions": run["preemptions"],
            "unfinished": run["unfinished"],
            "ttft_of_bound": b.ttft_mean_bound_ms / mean if mean > 0 else None,
            "ttft_of_bound_any_order": b.ttft_mean_any_order_ms / mean if mean > 0 else None,
        },
    }


def long_contexts(seed: int = 0) -> list[Request]:
    """40 conversations, 600 turns at 2 per second: each turn adds 2,000–20,000 tokens to its
    conversation's context, which starts over past 200,000 tokens (16-token blocks)."""
    rng = random.Random(seed)
    contexts: list[list[int]] = [[] for _ in range(40)]
    reqs, next_id, t = [], 1, 0.0
    for i in range(600):
        c = rng.randrange(len(contexts))
        grow = rng.randint(2_000, 20_000) // 16
        if (len(contexts[c]) + grow) * 16 > 200_000:
            contexts[c] = []
        contexts[c] = contexts[c] + list(range(next_id, next_id + grow))
        next_id += grow
        t += rng.expovariate(2.0)
        reqs.append(Request(i, t, 16 * len(contexts[c]) + 7, 200, tuple(contexts[c]), 16))
    return reqs


def long_context_cost() -> dict[str, Any]:
    """The bound's terms and wall time on :func:`long_contexts` (8 instances, the default profile)."""
    reqs = long_contexts()
    engine = spec_engine(RunSpec())
    t0 = time.perf_counter()
    b = workload_bound(reqs, engine, 8)
    return {
        "workload": "long contexts (600 requests, up to 200,000 tokens, 16-token blocks)",
        "instances": 8,
        "requests": b.requests,
        "block_ids": sum(len(r.block_ids) for r in reqs),
        "pooled_cache_blocks": b.kv_capacity_blocks,
        "oracle_kv_hit_rate": b.oracle_hit_rate,
        "kv_hit_rate_ceiling": b.kv_hit_rate_ceiling,
        "ttft_mean_bound_any_order_ms": b.ttft_mean_any_order_ms,
        "ttft_mean_bound_ms": b.ttft_mean_bound_ms,
        "bound_seconds": time.perf_counter() - t0,
    }


def _at_rate(base: RunSpec, rate: float) -> RunSpec:
    return replace(base, rate_scale=rate)


def preset_capacity() -> list[dict[str, Any]]:
    """Per preset workload: the capacity bound with and without the KV capacity conditions at its
    SLO (searched from its default load, as the preset does), beside ``lmetric``'s capacity."""
    preset = json.loads(PRESET.read_text())
    plan = preset["plan"]
    out = []
    for w in preset["workloads"]:
        if w["name"] not in CAPACITY_WORKLOADS:
            continue
        base = RunSpec(
            workload=w["workload"],
            trace=w["trace"],
            instances=int(plan["instances"]),
            duration=float(w["duration"]),
            seed=int(plan["seeds"][0]),
        )
        slo = (float(w["slo"]["ttft_p99_ms"]), float(w["slo"]["tpot_p99_ms"]))
        t0 = time.perf_counter()
        b = bound_summary(functools.partial(_at_rate, base), [], slo, float(w["default_rate"]))
        reached = capacities(w).get(POLICY)
        out.append(
            {
                "workload": w["name"],
                "slo": {"ttft_p99_ms": slo[0], "tpot_p99_ms": slo[1]},
                "capacity_bound": b["capacity"],
                "capacity_bound_any_order": b["capacity_any_order"],
                POLICY: reached,
                "of_bound": reached / b["capacity"] if reached and b["capacity"] else None,
                "of_bound_any_order": reached / b["capacity_any_order"]
                if reached and b["capacity_any_order"]
                else None,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"{w['name']}: capacity ≤ ×{b['capacity']} (any order ×{b['capacity_any_order']}), {POLICY} ×{reached}"
        )
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
    parser.add_argument("--trace", default=str(default) if default.exists() else None)
    args = parser.parse_args(argv)
    rows = []
    for name, spec in cases(args.trace):
        pool = load_profile(spec).kv_capacity_tokens
        for frac in POOL_FRACTIONS:
            row = measure(name, replace(spec, kv_tokens=None if frac == 1.0 else int(pool * frac)))
            print(
                f"{name} pool ×{frac:g}: hit ≤ {row['kv_hit_rate_ceiling']:.3f} (oracle {row['oracle_kv_hit_rate']:.3f}),"
                f" {POLICY} {row[POLICY]['kv_hit_rate']:.3f}; mean TTFT ≥ {row['ttft_mean_bound_ms']:.1f} ms"
                f" (any order {row['ttft_mean_bound_any_order_ms']:.1f}), {POLICY} {row[POLICY]['ttft_mean_ms']:.1f}",
                flush=True,
            )
            rows.append(row)
    write(
        "bound_kv.json",
        {
            "command": "python -m benchmarks.study_bound" + (f" --trace {args.trace}" if args.trace else ""),
            "policy": POLICY,
            "rows": rows,
            "long_contexts": long_context_cost(),
            "capacity": preset_capacity(),
        },
    )


if __name__ == "__main__":
    main()
