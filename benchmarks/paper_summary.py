"""Where kvroute's default policy leads, ties and loses in the paper preset's committed result.

Reads what ``kvroute compare --preset paper`` wrote (``docs/results/paper/paper.json`` and each
workload's ``results.json``) and prints, per workload, markdown tables of:

- every arm against the default (``DEFAULT_ARM``: the default policy behind the router-side queue)
  at the default load: mean and p99 TTFT and p99
  TPOT over the seeds, with the paired relative difference and its 95 % interval
  (:mod:`kvroute.sim.stats`; *lead* / *loss* only when the interval excludes 0, else *tie*), and
  capacity at the SLO as a ratio to the default's and as a fraction of the bound
  (:mod:`kvroute.sim.bound`);
- the router-side queue: each policy's ``+queue`` arm against the policy, capacity and TTFT p99 at the
  default load and at the light rate (the lowest of the preset's rates).

Nothing is simulated; numbers are read, not typed. ``--json FILE`` also writes them.

Usage: ``python -m benchmarks.paper_summary [--dir docs/results/paper] [--out FILE.md] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.sim.compare import DEFAULT_ARM, ROUTER_QUEUE
from kvroute.sim.stats import Interval, fmt_relative, paired_relative

REFERENCE = DEFAULT_ARM


def _runs_at(w: dict[str, Any], rate: float) -> dict[str, dict[int, dict[str, Any]]]:
    """arm → seed → run at rate scale ``rate`` (seed 0 from ``runs``, the others from ``seed_runs``)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for r in [*w["runs"], *w.get("seed_runs", [])]:
        if abs(r["rate_scale"] - rate) <= 1e-9 * rate:
            out.setdefault(r["policy"], {})[int(r["seed"])] = r
    return out


def _verdict(iv: Interval) -> str:
    """lead / loss of the default against the *other* arm's relative difference (positive: it is slower)."""
    if iv.n < 2:
        return "one sample"
    if not iv.excludes_zero():
        return "tie"
    return "leads" if iv.mean > 0 else "loses"


def _paired(
    by_seed: dict[int, dict[str, Any]], ref: dict[int, dict[str, Any]], key: str, metric: str = "ttft_ms"
) -> Interval:
    seeds = sorted(set(by_seed) & set(ref))
    return paired_relative([by_seed[s][metric][key] for s in seeds], [ref[s][metric][key] for s in seeds])


def _capacity(w: dict[str, Any]) -> dict[str, float | None]:
    return {c["policy"]: c["rate"] for c in w.get("capacity", []) if int(c["seed"]) == 0}


def summarize(w: dict[str, Any], reference: str = REFERENCE) -> dict[str, Any]:
    """One workload's rows (JSON-able), every arm against ``reference``."""
    at = _runs_at(w, w["default_rate"])
    light = _runs_at(w, min(w["rates"]))
    caps = _capacity(w)
    bound = (w.get("bound") or {}).get("capacity")
    bound_rates = (w.get("bound") or {}).get("rates") or [{}]
    ttft_bound = bound_rates[0].get("ttft_mean_ms")
    ref, ref_cap = at.get(reference, {}), caps.get(reference)
    rows = []
    best = w.get("best_lambda")
    for arm, by_seed in at.items():
        if arm.startswith("linear:") and (best is None or float(arm.split(":")[1]) != best):
            continue  # the λ grid: only the best λ is a shown arm
        mean = _paired(by_seed, ref, "mean")
        p99 = _paired(by_seed, ref, "p99")
        tpot = _paired(by_seed, ref, "p99", "tpot_ms")
        cap = caps.get(arm)
        ttft_mean = sum(r["ttft_ms"]["mean"] for r in by_seed.values()) / len(by_seed)
        rows.append(
            {
                "arm": arm,
                "ttft_mean_ms": ttft_mean,
                "ttft_of_bound": ttft_bound / ttft_mean if ttft_bound and ttft_mean else None,
                "ttft_p99_ms": sum(r["ttft_ms"]["p99"] for r in by_seed.values()) / len(by_seed),
                "tpot_p99_ms": sum(r["tpot_ms"]["p99"] for r in by_seed.values()) / len(by_seed),
                "vs_default_mean": [mean.mean, mean.half, mean.n],
                "vs_default_p99": [p99.mean, p99.half, p99.n],
                "vs_default_tpot_p99": [tpot.mean, tpot.half, tpot.n],
                "verdict_mean": _verdict(mean) if arm != reference else "",
                "verdict_p99": _verdict(p99) if arm != reference else "",
                "verdict_tpot_p99": _verdict(tpot) if arm != reference else "",
                "capacity": cap,
                "capacity_vs_default": cap / ref_cap if cap and ref_cap else None,
                "of_bound": cap / bound if cap and bound else None,
            }
        )
    queue = []
    for arm in at:
        if arm.endswith(ROUTER_QUEUE) or arm + ROUTER_QUEUE not in at:
            continue
        q = arm + ROUTER_QUEUE
        c0, c1 = caps.get(arm), caps.get(q)
        l0 = light.get(arm, {}).get(0)
        l1 = light.get(q, {}).get(0)
        queue.append(
            {
                "policy": arm,
                "capacity": c0,
                "capacity_queue": c1,
                "ratio": c1 / c0 if c0 and c1 else None,
                "p99_default": [_paired(at[q], at[arm], "p99").mean, _paired(at[q], at[arm], "p99").n],
                "light_p99_ms": None if l0 is None else l0["ttft_ms"]["p99"],
                "light_p99_queue_ms": None if l1 is None else l1["ttft_ms"]["p99"],
            }
        )
    return {
        "name": w["name"],
        "reference": reference,
        "default_rate": w["default_rate"],
        "bound": bound,
        "ttft_bound_ms": ttft_bound,
        "kv_hit_rate_ceiling": bound_rates[0].get("kv_hit_rate_ceiling"),
        "rows": rows,
        "queue": queue,
    }


def _x(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def markdown(summaries: Sequence[dict[str, Any]], source: str, reference: str = REFERENCE) -> str:
    what = (
        f"the default (`{reference}`)"
        if reference == DEFAULT_ARM
        else f"`{reference}` (the default, `{DEFAULT_ARM}`, was not in this run)"
    )
    out = [
        f"# Where {what} leads, ties and loses (the paper preset)",
        "",
        f"<!-- generated by `python -m benchmarks.paper_summary` from {source}; edits are overwritten -->",
        "",
        "Mean and p99 TTFT and p99 TPOT at the default load over the preset's seeds; each difference is "
        f"the other arm's against `{reference}`, paired by seed, with its 95 % interval; the verdict "
        f"says whether `{reference}` *leads* (the arm is slower) or *loses* (the arm is faster) on that "
        "metric, and only when the interval excludes 0, else *tie* (a trace is one sample: no verdict). "
        "Capacity at the SLO is seed 0's (resolution ×1.09), as a ratio to the reference's and as a "
        "fraction of the bound no router beats. *TTFT of the bound* is "
        "the bound's mean TTFT over the arm's (1 would be at the bound; the bound counts KV capacity, "
        "docs/results/bound.md).",
    ]
    for s in summaries:
        out += [
            "",
            f"## {s['name']} (default load ×{s['default_rate']:.3g}; capacity bound "
            f"{'×' + format(s['bound'], '.3g') if s['bound'] else 'not reached'}"
            + (f"; mean TTFT ≥ {s['ttft_bound_ms']:.1f} ms" if s.get("ttft_bound_ms") else "")
            + (
                f"; KV hit rate ≤ {s['kv_hit_rate_ceiling']:.3f}"
                if s.get("kv_hit_rate_ceiling") is not None
                else ""
            )
            + ")",
            "",
            "| arm | TTFT mean (ms) | vs reference | verdict | TTFT p99 (ms) | vs reference | verdict | "
            "TPOT p99 (ms) | vs reference | verdict | capacity | vs reference | of the bound | TTFT of the bound |",
            "|---|---:|---:|---|---:|---:|---|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in s["rows"]:
            m, p = Interval(*r["vs_default_mean"]), Interval(*r["vs_default_p99"])
            t = Interval(*r["vs_default_tpot_p99"])
            same = r["arm"] == reference
            out.append(
                f"| {'**' + r['arm'] + '**' if same else r['arm']} | {r['ttft_mean_ms']:.1f} | "
                f"{'' if same else fmt_relative(m)} | {r['verdict_mean']} | {r['ttft_p99_ms']:.1f} | "
                f"{'' if same else fmt_relative(p)} | {r['verdict_p99']} | {r['tpot_p99_ms']:.1f} | "
                f"{'' if same else fmt_relative(t)} | {r['verdict_tpot_p99']} | "
                f"{'—' if r['capacity'] is None else '×' + format(r['capacity'], '.3g')} | "
                f"{_x(r['capacity_vs_default'])} | {_x(r['of_bound'], 3)} | {_x(r.get('ttft_of_bound'), 3)} |"
            )
        if s["queue"]:
            out += [
                "",
                "The router-side queue (`+queue` against the same policy):",
                "",
                "| policy | capacity | +queue | ratio | TTFT p99 at the default load, +queue vs without | "
                "light-rate TTFT p99 (ms) | +queue |",
                "|---|---:|---:|---:|---:|---:|---:|",
            ]
            for q in s["queue"]:
                d, n = q["p99_default"]
                out.append(
                    f"| {q['policy']} | {'—' if q['capacity'] is None else '×' + format(q['capacity'], '.3g')} | "
                    f"{'—' if q['capacity_queue'] is None else '×' + format(q['capacity_queue'], '.3g')} | "
                    f"{_x(q['ratio'])} | {d * 100:+.1f} % (n = {n}) | {_x(q['light_p99_ms'], 1)} | "
                    f"{_x(q['light_p99_queue_ms'], 1)} |"
                )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="docs/results/paper", help="the preset's output folder")
    ap.add_argument("--out", help="write the markdown here too")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument(
        "--reference",
        help=f"the arm the others are compared with (default: {DEFAULT_ARM}, the default, when the "
        "result has it, else lmetric)",
    )
    args = ap.parse_args(argv)
    folder = Path(args.dir)
    try:
        top = json.loads((folder / "paper.json").read_text())
        workloads = []
        for meta in top["workloads"]:
            w = json.loads((folder / meta["name"] / "results.json").read_text())
            w.setdefault("bound", meta.get("bound"))
            workloads.append(w)
    except (OSError, ValueError, KeyError) as exc:
        print(f"paper_summary: cannot read the preset's result in {folder}: {exc}", file=sys.stderr)
        return 2
    reference = args.reference
    if reference is None:
        ran = {r["policy"] for w in workloads for r in w["runs"]}
        reference = REFERENCE if REFERENCE in ran else "lmetric"
    summaries = [summarize(w, reference) for w in workloads]
    text = markdown(summaries, f"`{folder}`", reference)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
