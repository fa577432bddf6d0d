"""Who is in a policy's TTFT and TPOT p99 on the ``api`` workload, from its decisions.

``python -m benchmarks.study_api_tail --instances 16 --rate 8.41 --seeds 1,2,3 --out FILE`` runs the
cluster simulator once per policy of ``--policies`` and seed (the others as shadows; the recording
is :class:`benchmarks.policy_findings.RecordingSim`'s) and writes, per run:

- the requests by prompt length (buckets of tokens): how many, their TTFT mean and p99, and how
  many of them are in the run's TTFT tail (TTFT at or above the run's p99);
- the TTFT tail's members: prompt, the chosen instance as the router saw it (running, waiting,
  queued prefill tokens Q, KV blocks held) and the first shadow's pick, with the smallest Q of any
  instance then (hypothesis: a long prompt is sent to the fewest requests rather than to its earliest
  first token);
- the TPOT tail's members (TPOT at or above the run's p99): output length, and the prefill that ran
  beside their decode: the uncached prompt tokens of the requests on the same instance whose first
  token came while they decoded (hypothesis: decodes that share steps with long prefill chunks);
- for every request of a prompt bucket, the Q at its pick and how often Q was above the minimum.

Deterministic (the simulator is); one process per run, ``--jobs`` of them; run it with ``nice``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.policy_findings import RecordingSim
from kvroute.engine.cost import get_profile
from kvroute.routing.core import build_policy
from kvroute.sim.cluster import SimConfig
from kvroute.workloads import open_workload

BUCKETS = (0, 1024, 4096, 8192)
"""Lower edges of the prompt-length buckets (tokens)."""

SHOW = 20
"""Tail members listed per run (the slowest first); the summaries count them all."""

LONG = 4096
"""A long prompt (tokens): at least one full chunk of the default budget."""


def _bucket(prompt: int) -> str:
    i = bisect.bisect_right(BUCKETS, prompt) - 1
    hi = BUCKETS[i + 1] if i + 1 < len(BUCKETS) else None
    return f"{BUCKETS[i]}-{hi}" if hi else f"{BUCKETS[i]}+"


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[int(q * (len(s) - 1))] if s else float("nan")


def _view(rec: dict[str, Any], i: int) -> dict[str, Any]:
    running, waiting, queued, blocks, _usage, _cap = rec["views"][i]
    return {"inst": i, "running": running, "waiting": waiting, "q": queued, "blocks": blocks}


def _beside(recs: list[dict[str, Any]]) -> dict[Any, tuple[int, int]]:
    """Per request: (uncached prompt tokens, longest such prompt) of the other requests on its instance
    whose first token came while it decoded (first, done]: the prefill its decode steps shared."""
    by_inst: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for r in recs:
        by_inst[r["choice"]].append((r["first"], r["prompt"] - r.get("hit", 0)))
    for v in by_inst.values():
        v.sort()
    out = {}
    for r in recs:
        firsts = by_inst[r["choice"]]
        lo = bisect.bisect_right(firsts, (r["first"], 1 << 62))
        hi = bisect.bisect_right(firsts, (r["done"], 1 << 62))
        toks = [n for _, n in firsts[lo:hi]]
        out[r["rid"]] = (sum(toks), max(toks, default=0))
    return out


def analyse(recs: list[dict[str, Any]], shadow: str) -> dict[str, Any]:
    """The figures of the module docstring for one run's records (those finished)."""
    for r in recs:
        r["ttft"] = r["first"] - r["arrival"]
        r["tpot"] = (r["done"] - r["first"]) / (r["output"] - 1) if r["output"] > 1 else None
    ttft = [r["ttft"] for r in recs]
    tpots = [r["tpot"] for r in recs if r["tpot"] is not None]
    p99, tp99 = _pct(ttft, 0.99), _pct(tpots, 0.99)
    beside = _beside(recs)
    out: dict[str, Any] = {
        "requests": len(recs),
        "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
        "ttft_ms_p99": 1e3 * p99,
        "tpot_ms_mean": 1e3 * statistics.fmean(tpots),
        "tpot_ms_p99": 1e3 * tp99,
    }
    buckets: dict[str, Any] = {}
    for b in dict.fromkeys(_bucket(x) for x in BUCKETS):
        rs = [r for r in recs if _bucket(r["prompt"]) == b]
        if not rs:
            continue
        qs = [r["views"][r["choice"]][2] for r in rs]
        qmin = [min(v[2] for v in r["views"]) for r in rs]
        sh = [r["views"][r["shadow"][shadow]][2] for r in rs if shadow in r["shadow"]]
        buckets[b] = {
            "n": len(rs),
            "ttft_ms_mean": 1e3 * statistics.fmean(r["ttft"] for r in rs),
            "ttft_ms_p99": 1e3 * _pct([r["ttft"] for r in rs], 0.99),
            "in_ttft_tail": sum(r["ttft"] >= p99 for r in rs),
            "in_tpot_tail": sum(r["tpot"] is not None and r["tpot"] >= tp99 for r in rs),
            "q_at_pick_mean": statistics.fmean(qs),
            "q_min_mean": statistics.fmean(qmin),
            "q_above_min_share": sum(q > m for q, m in zip(qs, qmin, strict=True)) / len(rs),
            "q_at_shadow_pick_mean": statistics.fmean(sh) if sh else None,
            "running_at_pick_mean": statistics.fmean(r["views"][r["choice"]][0] for r in rs),
            "blocks_at_pick_mean": statistics.fmean(r["views"][r["choice"]][3] for r in rs),
            "tpot_ms_mean": 1e3 * statistics.fmean([r["tpot"] for r in rs if r["tpot"] is not None] or [0]),
            "prefill_beside_decode_mean": statistics.fmean(beside[r["rid"]][0] for r in rs),
        }
    out["by_prompt"] = buckets
    long_on: dict[int, int] = defaultdict(int)
    for r in recs:
        if r["prompt"] >= LONG:
            long_on[r["choice"]] += 1
    n_long = sum(long_on.values())
    out["long_prompts"] = {
        "n": n_long,
        "per_instance": dict(sorted(long_on.items())),
        "busiest_share": max(long_on.values()) / n_long if n_long else None,
    }
    tail = sorted((r for r in recs if r["ttft"] >= p99), key=lambda r: -r["ttft"])
    out["ttft_tail"] = [
        {
            "ttft_ms": round(1e3 * r["ttft"], 1),
            "prompt": r["prompt"],
            "routed_at_s": round(r["t"], 3),
            "pick": _view(r, r["choice"]),
            "shadow_pick": _view(r, r["shadow"][shadow]) if shadow in r["shadow"] else None,
            "q_min": min(v[2] for v in r["views"]),
            "cached_at_pick": r["cached"][r["choice"]],
            "cached_max": max(r["cached"]),
        }
        for r in tail[:SHOW]
    ]
    out["ttft_tail_summary"] = {
        "n": len(tail),
        "prompt_mean": statistics.fmean(r["prompt"] for r in tail),
        "cached_at_pick_mean": statistics.fmean(r["cached"][r["choice"]] for r in tail),
        "cached_max_mean": statistics.fmean(max(r["cached"]) for r in tail),
        "q_at_pick_mean": statistics.fmean(r["views"][r["choice"]][2] for r in tail),
        "q_min_mean": statistics.fmean(min(v[2] for v in r["views"]) for r in tail),
        "all_cached_at_pick_mean": statistics.fmean(r["cached"][r["choice"]] for r in recs),
    }
    ttail = sorted((r for r in recs if r["tpot"] is not None and r["tpot"] >= tp99), key=lambda r: -r["tpot"])
    out["tpot_tail"] = [
        {
            "tpot_ms": round(1e3 * r["tpot"], 1),
            "prompt": r["prompt"],
            "output": r["output"],
            "pick": _view(r, r["choice"]),
            "prefill_beside_decode": beside[r["rid"]][0],
            "longest_prompt_beside": beside[r["rid"]][1],
        }
        for r in ttail[:SHOW]
    ]
    out["tpot_tail_summary"] = {
        "n": len(ttail),
        "output_median": statistics.median(r["output"] for r in ttail) if ttail else None,
        "prefill_beside_decode_mean": statistics.fmean(beside[r["rid"]][0] for r in ttail) if ttail else None,
        "with_a_long_prompt_beside": sum(beside[r["rid"]][1] >= LONG for r in ttail),
        "all_prefill_beside_decode_mean": statistics.fmean(
            beside[r["rid"]][0] for r in recs if r["tpot"] is not None
        ),
    }
    return out


def run_one(job: tuple[str, tuple[str, ...], int, argparse.Namespace]) -> dict[str, Any]:
    """One policy on one seed: the simulator run and its analysis."""
    name, shadows, seed, args = job
    profile = get_profile()
    cfg = SimConfig(instances=args.instances, kv_capacity_tokens=profile.kv_capacity_tokens, seed=seed)
    sim = RecordingSim(cfg, build_policy(name, None), profile.cost, shadows)
    stream, _ = open_workload(None, "auto", args.workload, args.rate, args.duration, seed, False)
    t0 = time.process_time()
    sim.run(stream)
    recs = [dict(r, rid=k) for k, r in sim.records.items() if "done" in r]
    res = analyse(recs, shadows[0] if shadows else "")
    res.update(policy=name, seed=seed, cpu_seconds=round(time.process_time() - t0, 1))
    return res


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="api")
    ap.add_argument("--rate", type=float, default=8.41)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--seeds", default="1")
    ap.add_argument("--policies", default="lmetric-time,dynamo-lmetric")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    jobs = [
        (p, tuple(q for q in policies if q != p), int(s), args)
        for s in args.seeds.split(",")
        for p in policies
    ]
    t0 = time.time()
    with ProcessPoolExecutor(args.jobs) as ex:
        runs = list(ex.map(run_one, jobs))
    for r in runs:
        print(
            f"{r['policy']:>24} seed {r['seed']}: TTFT {r['ttft_ms_mean']:.1f} / p99 {r['ttft_ms_p99']:.1f}"
            f"  TPOT p99 {r['tpot_ms_p99']:.1f} ms",
            file=sys.stderr,
        )
    out = {
        "command": "python -m benchmarks.study_api_tail " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": args.workload,
        "instances": args.instances,
        "rate_scale": args.rate,
        "duration_s": args.duration,
        "wall_seconds": round(time.time() - t0, 1),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
