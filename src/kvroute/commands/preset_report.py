"""The presets' tables of seed intervals and capacity at the SLO (markdown), from the dict that
:func:`kvroute.sim.compare.run_paper` returns. Pure functions of that dict; the words for a difference
come from :func:`kvroute.sim.stats.label` (a "win" only when the 95 % interval excludes 0)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvroute.sim.stats import Interval, fmt_interval, fmt_relative, label, mean_interval, paired_relative

Summary = dict[str, Any]
Names = Callable[[str], str]

METRICS = (("ttft_ms", "mean", "mean TTFT"), ("ttft_ms", "p99", "p99 TTFT"), ("tpot_ms", "mean", "mean TPOT"))


def _ident(p: str) -> str:
    return p


def default_load_runs(w: dict[str, Any]) -> list[Summary]:
    """Every run at the workload's default rate and default staleness setting, all seeds."""
    at = [r for r in w["runs"] if r["rate_scale"] == w["default_rate"]]
    return at + list(w.get("seed_runs", []))


def per_seed(w: dict[str, Any], policy: str, key: str, stat: str) -> dict[int, float]:
    """{seed: value} of ``policy``'s ``key``/``stat`` at the default load."""
    return {int(r.get("seed", 0)): float(r[key][stat]) for r in default_load_runs(w) if r["policy"] == policy}


def seed_interval(w: dict[str, Any], policy: str, key: str, stat: str) -> Interval:
    values = per_seed(w, policy, key, stat)
    return mean_interval([values[s] for s in sorted(values)])


def paired(w: dict[str, Any], policy: str, reference: str, key: str, stat: str) -> Interval:
    """The relative difference ``policy`` vs ``reference`` over the seeds both ran (paired)."""
    a, b = per_seed(w, policy, key, stat), per_seed(w, reference, key, stat)
    seeds = sorted(set(a) & set(b))
    return paired_relative([a[s] for s in seeds], [b[s] for s in seeds])


def seed_table(w: dict[str, Any], policies: Sequence[str], names: Names = _ident) -> str:
    """Per policy: mean TTFT, p99 TTFT and mean TPOT at the default load, mean ± 95 % half-width over
    the workload's seeds (ms)."""
    n = len(w.get("seeds", [0]))
    lines = [
        f"| policy (n = {n} seeds) | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) |",
        "|---|---:|---:|---:|",
    ]
    for p in policies:
        if not per_seed(w, p, "ttft_ms", "mean"):
            continue
        cells = [
            fmt_interval(seed_interval(w, p, key, stat), 2 if key == "tpot_ms" else 1)
            for key, stat, _ in METRICS
        ]
        lines.append(f"| {names(p)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def difference_table(
    w: dict[str, Any], policies: Sequence[str], reference: str, names: Names = _ident
) -> str:
    """Each policy vs ``reference`` at the default load: the per-seed paired relative difference's
    mean and 95 % interval, and its label (win / loss / within noise)."""
    head = " | ".join(title for _, _, title in METRICS)
    lines = [f"| vs {names(reference)} | {head} |", "|---|" + "---|" * len(METRICS)]
    for p in policies:
        if p == reference or not per_seed(w, p, "ttft_ms", "mean"):
            continue
        cells = []
        for key, stat, _ in METRICS:
            iv = paired(w, p, reference, key, stat)
            cells.append(f"{fmt_relative(iv)} {label(iv)}")
        lines.append(f"| {names(p)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def capacities(w: dict[str, Any], seed: int | None = None) -> dict[str, float | None]:
    """{policy: capacity rate scale} of one seed (default: the first capacity seed present)."""
    entries = w.get("capacity", [])
    if not entries:
        return {}
    seed = entries[0]["seed"] if seed is None else seed
    return {c["policy"]: c["rate"] for c in entries if c["seed"] == seed}


def _cap_cell(rate: float | None, failed: float | None) -> str:
    if rate is None:
        return f"< ×{failed:.3g}" if failed is not None else "—"
    return f"×{rate:.3g}" + ("" if failed is not None else "+")


def capacity_table(w: dict[str, Any], policies: Sequence[str], reference: str, names: Names = _ident) -> str:
    """Per policy: capacity (rate scale) at the workload's SLO, relative to ``reference``, the lowest
    failing probe and what failed there."""
    entries = {c["policy"]: c for c in w.get("capacity", []) if c["seed"] == w["capacity"][0]["seed"]}
    ref = entries.get(reference, {}).get("rate")
    bound = bound_capacity(w)
    lines = [
        "| policy | capacity (rate scale) | vs "
        + names(reference)
        + " | of the bound | first failing probe | failed on |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for p in policies:
        c = entries.get(p)
        if c is None:
            continue
        rel = f"{c['rate'] / ref:.2f}×" if c["rate"] is not None and ref else "—"
        fail = next((pr for pr in c["probes"] if pr["rate"] == c["failed_rate"]), None)
        lines.append(
            f"| {names(p)} | {_cap_cell(c['rate'], c['failed_rate'])} | {rel} | {_of_bound(c['rate'], bound)} | "
            + ("—" if fail is None else f"×{fail['rate']:.3g}")
            + f" | {'—' if fail is None else _why(fail, w['slo'])} |"
        )
    return "\n".join(lines)


def bound_capacity(w: dict[str, Any]) -> float | None:
    """The workload's capacity bound (rate scale; None: not computed or nothing meets it)."""
    b = w.get("bound")
    return None if not b else b.get("capacity")


def _of_bound(rate: float | None, bound: float | None) -> str:
    return f"{rate / bound:.2f}" if rate is not None and bound else "—"


def _why(probe: dict[str, Any], slo: dict[str, Any]) -> str:
    why = []
    if probe["unfinished"]:
        why.append(f"{probe['unfinished']} unfinished")
    if not probe["ttft_p99_ms"] <= slo["ttft_p99_ms"]:
        why.append(f"TTFT p99 {probe['ttft_p99_ms']:,.0f} ms")
    if not probe["tpot_p99_ms"] <= slo["tpot_p99_ms"]:
        why.append(f"TPOT p99 {probe['tpot_p99_ms']:,.1f} ms")
    return ", ".join(why)


BEST_LINEAR = "linear (best λ)"


def capacity_summary(workloads: Sequence[dict[str, Any]], policies: Sequence[str], reference: str) -> str:
    """Workloads (rows) × policies (columns): capacity relative to ``reference`` (its own capacity
    in the reference's column). ``policies`` may include names absent from some workloads, and
    :data:`BEST_LINEAR`: the workload's best ``linear:<λ>``."""
    with_bound = any(bound_capacity(w) is not None for w in workloads)
    lines = [
        "| workload | SLO: TTFT p99 / TPOT p99 (ms) | "
        + " | ".join(policies)
        + (" | bound |" if with_bound else " |"),
        "|---|---:|" + "---:|" * (len(policies) + with_bound),
    ]
    for w in workloads:
        caps = capacities(w)
        if not caps:
            continue
        ref = caps.get(reference)
        cells = []
        for p in _resolved(w, policies):
            rate = caps.get(p)
            if p not in caps:
                cells.append("—")
            elif p == reference or rate is None or not ref:
                cells.append("—" if rate is None else f"×{rate:.3g}")
            else:
                cells.append(f"{rate / ref:.2f}×")
        if with_bound:
            bound = bound_capacity(w)
            cells.append("—" if bound is None else f"{bound / ref:.1f}×" if ref else f"×{bound:.3g}")
        slo = w["slo"]
        lines.append(
            f"| {w['name']} | {slo['ttft_p99_ms']:,.0f} / {slo['tpot_p99_ms']:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _resolved(w: dict[str, Any], policies: Sequence[str]) -> list[str]:
    """``policies`` with :data:`BEST_LINEAR` replaced by the workload's best ``linear:<λ>``."""
    lam = w.get("best_lambda")
    return [f"linear:{lam:g}" if p == BEST_LINEAR and lam is not None else p for p in policies]


def bound_summary_table(workloads: Sequence[dict[str, Any]], policies: Sequence[str]) -> str:
    """Workloads (rows) × policies (columns): capacity as a fraction of the workload's bound, and
    the bound's own terms (capacity, mean TTFT lower bound at the default load, the KV hit-rate
    ceiling, with the infinite-cache oracle's beside it). Empty when no workload has a bound."""
    rows = [w for w in workloads if w.get("bound")]
    if not rows:
        return ""
    lines = [
        "| workload | bound: capacity | mean TTFT ≥ (ms) | KV hit rate ≤ (infinite caches) | "
        + " | ".join(policies)
        + " |",
        "|---|---:|---:|---:|" + "---:|" * len(policies),
    ]
    for w in rows:
        b = w["bound"]
        caps = capacities(w)
        bound = b.get("capacity")
        at = b["rates"][0]
        cells = [_of_bound(caps.get(p), bound) for p in _resolved(w, policies)]
        lines.append(
            f"| {w['name']} | {'—' if bound is None else f'×{bound:.3g}'} | {at['ttft_mean_ms']:.1f} | "
            f"{at.get('kv_hit_rate_ceiling', at['oracle_kv_hit_rate']):.3f} ({at['oracle_kv_hit_rate']:.3f}) | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)
