"""Capacity at the SLO for the policy grid (``python -m benchmarks.policy_grid --capacity``).

Per cell (workload, instances) and sample, every arm's capacity at the paper preset's SLO, searched the
preset's way (:func:`kvroute.sim.compare.paper_plan`, :mod:`kvroute.sim.capacity`):

- light rate: the preset workload's light rate (0.5 for a synthetic workload, 0.25 for the trace) ×
  instances / 16, so that a cell's light load per instance is the preset's (a synthetic workload outside
  the preset takes the synthetic one's);
- SLO: one per cell, 5 × the reference's (``vllm``) TTFT p99 and 10 × its TPOT p99 at the light rate
  with seed 0, as the preset derives it, whatever the sample;
- search: from the light rate, × 2 until a probe fails, then 3 bisections in log space; the capacity
  (a rate scale) is the highest passing probe, within × 2^(1/8) = 1.09 of the crossing. Every search
  of a cell starts at the same rate and bisects the same lattice, so two arms' capacities differ by
  whole steps of that lattice.

Samples: seeds for a synthetic workload; for a trace (replayed exactly, so a seed changes nothing)
replays with the light rate, and so every probe, × (1 + k / 1000), as the latency grid does.

Arithmetic (:func:`summarize`): an arm that met the SLO at no probe counts capacity 0. Per arm, the
mean capacity over the samples and the paired relative difference to the candidate ((arm − cand) /
cand per sample) with its 95 % t-interval: the candidate *loses* when the interval lies above 0 (the
arm carries more), *leads* when below, else *ties*; one sample has no interval, and its verdict is the
sign of its difference, marked ``(one sample)``. ``rank``: 1 + the
arms whose mean capacity exceeds the candidate's. ``binding``: per sample, the candidate's lowest
failing probe and, at the lowest rate where the candidate failed and the best arm passed, both runs'
TTFT p99 and TPOT p99 as fractions of the SLO (which term keeps the candidate below).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvroute.sim.capacity import CapacityRule, CapacitySearch
from kvroute.sim.compare import arm_changes, paper_plan, run_capacity
from kvroute.sim.runner import RunSpec
from kvroute.sim.stats import paired_relative

PRESET = paper_plan("trace")  # the preset's plan: only its light rates, SLO rule and search are read
TRACE = "mooncake"
ONE = " (one sample)"  # a verdict's mark when the cell has one sample
STEP = PRESET.factor ** (1 / 2**PRESET.capacity_refine)  # the search's resolution: × 2^(1/8)
Runner = Callable[[list[RunSpec]], list[dict[str, Any]]]


def light_rate(workload: str, instances: int) -> float:
    """The cell's light rate scale: the preset's for ``workload`` at 16 instances × instances / 16."""
    by_name = {w.name: w.light_rate for w in PRESET.workloads}
    return by_name.get(workload, PRESET.workloads[0].light_rate) * instances / 16


def samples(args: argparse.Namespace, workload: str) -> list[int]:
    """The sample ids of a cell: replay indices for the trace, seeds otherwise."""
    if workload == TRACE:
        return list(range(args.trace_samples))
    return list(range(args.first_seed, args.first_seed + args.seeds))


def sample_light(workload: str, instances: int, sample: int) -> float:
    """The light rate a sample's search starts from (a trace's replay k: × (1 + k / 1000))."""
    return light_rate(workload, instances) * ((1 + sample / 1000) if workload == TRACE else 1.0)


def cell_spec(args: argparse.Namespace, workload: str, n: int, arm: str, rate: float, sample: int) -> RunSpec:
    """One run of the grid, built as the preset builds its runs (the trace with seed 0)."""
    if workload == TRACE:
        return RunSpec(
            **arm_changes(arm),
            instances=n,
            trace=args.mooncake,
            rate_scale=rate,
            duration=args.trace_duration,
        )
    return RunSpec(
        **arm_changes(arm),
        instances=n,
        workload=workload,
        rate_scale=rate,
        duration=args.duration,
        seed=sample,
    )


def run(args: argparse.Namespace, arms: Sequence[str], runner: Runner) -> dict[str, Any]:
    """Every cell's SLO, then every (cell, arm, sample) search in lockstep; the raw cells:
    ``{"wl/n": {"light_rate", "slo": {...}, "arms": {arm: {sample: Capacity.to_dict()}}}}``."""
    cells = [
        (wl, int(n))
        for wl in args.workloads.split(",")
        for n in args.instances.split(",")
        if wl != TRACE or args.mooncake
    ]
    lights = runner(
        [cell_spec(args, wl, n, PRESET.reference, light_rate(wl, n), PRESET.seeds[0]) for wl, n in cells]
    )
    slos = {cell: PRESET.slo(s) for cell, s in zip(cells, lights, strict=True)}
    raw: dict[str, Any] = {}
    for (wl, n), s in zip(cells, lights, strict=True):
        slo = slos[wl, n]
        raw[f"{wl}/{n}"] = {
            "light_rate": light_rate(wl, n),
            "slo": {
                "ttft_p99_ms": slo.ttft_p99_ms,
                "tpot_p99_ms": slo.tpot_p99_ms,
                "light_ttft_p99_ms": s["ttft_ms"]["p99"],
                "light_tpot_p99_ms": s["tpot_ms"]["p99"],
            },
            "arms": {arm: {} for arm in arms},
        }
    searches = {
        (wl, n, arm, k): CapacitySearch(
            CapacityRule(sample_light(wl, n, k), slos[wl, n], PRESET.factor, PRESET.capacity_refine)
        )
        for wl, n in cells
        for arm in arms
        for k in samples(args, wl)
    }
    t0, rounds = time.time(), [0]

    def measure(specs: list[RunSpec]) -> list[dict[str, Any]]:
        rounds[0] += 1
        out = runner(specs)
        print(
            f"capacity round {rounds[0]}: {len(specs)} runs, {time.time() - t0:.0f} s so far", file=sys.stderr
        )
        return out

    caps = run_capacity(searches, lambda key, r: cell_spec(args, key[0], key[1], key[2], r, key[3]), measure)
    for (wl, n, arm, k), cap in caps.items():
        raw[f"{wl}/{n}"]["arms"][arm][str(k)] = cap.to_dict()
    return raw


def _rate(cap: dict[str, Any]) -> float:
    """A search's capacity; 0 when no probe met the SLO."""
    return 0.0 if cap["rate"] is None else float(cap["rate"])


def capacity_verdict(d: float, lo: float, hi: float) -> str:
    """The candidate's verdict from the interval [lo, hi] of (arm − candidate) / candidate capacity,
    whose mean is ``d``; with one sample (NaN bounds) from the sign of ``d``."""
    if lo > 0:
        return "lose"
    if math.isnan(lo):
        return ("lose" if d > 0 else "lead" if d < 0 else "tie") + ONE
    if hi < 0:
        return "lead"
    return "tie"


def relative(vals: Sequence[float], base: Sequence[float]) -> tuple[float, float, float]:
    """The mean of (val − base) / base over paired samples and its 95 % t-interval (NaN bounds with one
    sample). A candidate with capacity 0 in a sample: (NaN, +inf, +inf) if the arm carried anything
    there (a loss), else (NaN, 0, 0) when it too carried nothing anywhere (a tie)."""
    if all(b > 0 for b in base):
        iv = paired_relative(vals, base)
        return iv.mean, iv.low, iv.high
    worse = any(v > 0 for v, b in zip(vals, base, strict=True) if b == 0)
    return (math.nan, math.inf, math.inf) if worse else (math.nan, 0.0, 0.0)


def _fractions(probe: dict[str, Any], slo: dict[str, Any]) -> dict[str, Any]:
    """A probe's p99s as fractions of the SLO and the terms it failed on."""
    ttft = probe["ttft_p99_ms"] / slo["ttft_p99_ms"]
    tpot = probe["tpot_p99_ms"] / slo["tpot_p99_ms"]
    terms = (("unfinished", probe["unfinished"] > 0), ("TTFT", not ttft <= 1), ("TPOT", not tpot <= 1))
    failed = [name for name, bad in terms if bad]
    return {"rate": probe["rate"], "ttft_of_slo": ttft, "tpot_of_slo": tpot, "failed_on": failed}


def binding(arms: dict[str, dict[str, Any]], cand: str, sample: str, slo: dict[str, Any]) -> dict[str, Any]:
    """What keeps ``cand`` below the best arm in one sample: its lowest failing probe, and both runs at
    the lowest rate where ``cand`` failed and the best arm (highest capacity among the arms run on this
    sample; the first listed on a tie) passed (``None`` when the best arm carries no more, or never probed such a rate)."""
    me = arms[cand][sample]
    best = max((a for a in arms if a != cand and sample in arms[a]), key=lambda a: _rate(arms[a][sample]))
    fail = next((p for p in me["probes"] if p["rate"] == me["failed_rate"]), None)
    out: dict[str, Any] = {
        "capacity": _rate(me),
        "failed": None if fail is None else _fractions(fail, slo),
        "best_arm": best,
        "best_capacity": _rate(arms[best][sample]),
        "at": None,
    }
    if out["best_capacity"] > out["capacity"]:
        passed = {p["rate"]: p for p in arms[best][sample]["probes"] if p["ok"]}
        split = sorted(
            (p for p in me["probes"] if not p["ok"] and p["rate"] in passed), key=lambda p: p["rate"]
        )
        if split:
            out["at"] = {
                "candidate": _fractions(split[0], slo),
                "best": _fractions(passed[split[0]["rate"]], slo),
            }
    return out


def summarize(raw: dict[str, Any], cand: str) -> dict[str, Any]:
    """Per cell: each arm's mean capacity over its samples, the samples and the paired difference to
    ``cand`` over the samples both ran (an arm may have been run on fewer: ``n``); the candidate's rank
    (1 + the arms whose paired mean difference is above 0); per sample, what binds it (see the module
    docstring)."""
    out: dict[str, Any] = {}
    for key, c in raw.items():
        arms = c["arms"]
        ks = sorted(arms[cand], key=int)
        rows: dict[str, Any] = {}
        for arm, by in arms.items():
            own = sorted(by, key=int)
            row: dict[str, Any] = {"capacity": statistics.fmean(_rate(by[k]) for k in own), "samples": by}
            if arm != cand:
                both = [k for k in ks if k in by]
                vals, base = [_rate(by[k]) for k in both], [_rate(arms[cand][k]) for k in both]
                row["n"] = len(both)
                d, lo, hi = relative(vals, base)
                row["vs"] = [round(d, 4), round(lo, 4), round(hi, 4), capacity_verdict(d, lo, hi)]
                # whole search steps above the candidate, per sample
                row["steps"] = [
                    round(math.log(v / b) / math.log(STEP)) if v > 0 and b > 0 else None
                    for v, b in zip(vals, base, strict=True)
                ]
            rows[arm] = row
        out[key] = {
            "light_rate": c["light_rate"],
            "slo": c["slo"],
            "samples": len(ks),
            "rank": 1 + sum(r["vs"][0] > 0 or r["vs"][1] == math.inf for a, r in rows.items() if a != cand),
            "arms": rows,
            "binding": {k: binding(arms, cand, k, c["slo"]) for k in ks},
        }
    return out


def raw_of(report: dict[str, Any]) -> dict[str, Any]:
    """The raw cells a capacity report was summarized from."""
    return {
        key: {
            "light_rate": c["light_rate"],
            "slo": c["slo"],
            "arms": {arm: row["samples"] for arm, row in c["arms"].items()},
        }
        for key, c in report["cells"].items()
    }


def raw_of_preset(paper: dict[str, Any]) -> dict[str, Any]:
    """The raw cells of a paper preset's result (``docs/results/paper/paper.json``): its capacity
    searches, per workload at the preset's instances, the seeds as samples."""
    n = paper["plan"]["instances"]
    lights = {w["name"]: w["light_rate"] for w in paper["plan"]["workloads"]}
    out: dict[str, Any] = {}
    for w in paper["workloads"]:
        arms: dict[str, dict[str, Any]] = {}
        for c in w.get("capacity", []):
            arms.setdefault(c["policy"], {})[str(c["seed"])] = {
                k: c[k] for k in ("rate", "failed_rate", "probes")
            }
        if arms:
            out[f"{w['name']}/{n}"] = {"light_rate": lights[w["name"]], "slo": w["slo"], "arms": arms}
    return out


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Raw cells of two runs together: a cell in both must have the same SLO (else ValueError); its
    arms' samples are united (``new``'s win on a repeated sample)."""
    out = {key: {**c, "arms": {a: dict(s) for a, s in c["arms"].items()}} for key, c in old.items()}
    for key, c in new.items():
        if key not in out:
            out[key] = c
            continue
        if out[key]["slo"] != c["slo"] or out[key]["light_rate"] != c["light_rate"]:
            raise ValueError(f"{key}: the SLO or light rate differs between the merged runs")
        for arm, by in c["arms"].items():
            out[key]["arms"].setdefault(arm, {}).update(by)
    return out


def _cell(row: dict[str, Any], samples: int) -> str:
    """An arm's capacity, its paired difference and verdict; "(one sample)" only where the cell has more."""
    d = row["vs"]
    verdict = d[3].removesuffix(ONE) if samples == 1 else d[3]
    return f"×{row['capacity']:.3g} ({d[0] * 100:+.0f} %, {verdict})"


def render(report: dict[str, Any]) -> str:
    """Markdown: arms (rows) × cells (columns) of capacity, with the candidate's rank and its lead / tie
    / lose count per cell; then, per cell and sample, what binds the candidate."""
    cand, cells = report["candidate"], report["cells"]
    keys = list(cells)
    arms = list(dict.fromkeys(a for c in cells.values() for a in c["arms"]))
    lines = ["| arm | " + " | ".join(keys) + " |", "|---|" + "---:|" * len(keys)]
    for arm in arms:
        row = []
        for k in keys:
            r = cells[k]["arms"].get(arm)
            row.append(
                "—"
                if r is None
                else f"**×{r['capacity']:.3g}**"
                if arm == cand
                else _cell(r, cells[k]["samples"])
            )
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    verdicts = [
        [r["vs"][3].removesuffix(ONE) for a, r in cells[k]["arms"].items() if a != cand] for k in keys
    ]
    lines.append(
        f"| {cand}: rank | "
        + " | ".join(f"{cells[k]['rank']} of {len(cells[k]['arms'])}" for k in keys)
        + " |"
    )
    lines.append(
        f"| {cand}: lead / tie / lose | "
        + " | ".join(
            f"{v.count('lead')} / {v.count('tie')} / {v.count('lose')}"
            + (ONE if cells[k]["samples"] == 1 else "")
            for k, v in zip(keys, verdicts, strict=True)
        )
        + " |"
    )
    lines.append(
        "| SLO: TTFT / TPOT p99 (ms) | "
        + " | ".join(
            f"{cells[k]['slo']['ttft_p99_ms']:,.0f} / {cells[k]['slo']['tpot_p99_ms']:.1f}" for k in keys
        )
        + " |"
    )
    lines += [
        "",
        f"| cell | sample | {cand} | its lowest failing probe: TTFT / TPOT p99 of the SLO | best arm | "
        f"at the lowest rate where the best arm passes and {cand} fails: {cand}'s TTFT / TPOT | the best arm's |",
        "|---|---:|---:|---|---|---|---|",
    ]
    for k in keys:
        for s, b in cells[k]["binding"].items():
            f = b["failed"]
            failed = "—" if f is None else f"×{f['rate']:.3g}: {_pair(f)} ({', '.join(f['failed_on'])})"
            at = b["at"]
            lines.append(
                f"| {k} | {s} | ×{b['capacity']:.3g} | {failed} | {b['best_arm']} ×{b['best_capacity']:.3g} | "
                + (
                    "— | —"
                    if at is None
                    else f"×{at['candidate']['rate']:.3g}: {_pair(at['candidate'])} | {_pair(at['best'])}"
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def _pair(f: dict[str, Any]) -> str:
    return f"{f['ttft_of_slo']:.2f} / {f['tpot_of_slo']:.2f}"
