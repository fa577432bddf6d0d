"""What the main job (`kvroute demo`) prints: plain names for the policies, the verdict of the default
against each rival, and the tables. Pure functions of the rows the job measured; no I/O but ``print``
in :func:`print_report`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

PLAIN_NAMES: Mapping[str, str] = MappingProxyType(
    {
        "lmetric": "LMetric: prefill work left × batch size (the paper's formula)",
        "lmetric-kv": "LMetric with the KV-pressure term",
        "vllm": "cache-blind balancer (vLLM's default routing)",
        "llm-d": "llm-d's default scorers (cache hit ×3, queue ×2, free KV ×2)",
        "dynamo": "Dynamo's KV router (cached blocks minus load)",
        "dynamo-lmetric": "Dynamo's LMetric variant",
        "llm-d-lmetric": "llm-d's LMetric variant",
        "aibrix-lmetric": "AIBrix's LMetric variant",
        "vllm-router-smetric": "vLLM router's S-metric",
        "sglang": "SGLang's cache-aware router",
        "round-robin": "round robin (cache-blind)",
        "least-requests": "fewest requests in flight (cache-blind)",
    }
)
"""Policy base name → what a newcomer should read for it (the registry's names are for the flags)."""

BALANCER = "vllm"
"""The cache-blind reference every ratio is taken against."""

BOUND_MEANING = (
    "The bound is what no router can beat on this workload and cluster: a mean and p99 TTFT below "
    "which,\nand a KV hit rate above which, no routing decision can go (computed offline from the whole "
    "workload;\nsee docs/results/bound.md). The closer an arm is to it, the less a better router could win."
)


def plain_name(policy: str, default: str) -> str:
    """``policy``'s plain name (``base:param`` reads as its base; an arm behind the router-side queue,
    ``name +queue``, as ``name, behind the router-side queue``), marked when it is ``default``."""
    from kvroute.sim.compare import ROUTER_QUEUE, has_queue

    bare = policy.removesuffix(ROUTER_QUEUE)
    name = PLAIN_NAMES.get(bare.partition(":")[0], bare) + (
        ", behind the router-side queue" if has_queue(policy) else ""
    )
    return f"kvroute's default — {name}" if policy == default else name


@dataclass(frozen=True)
class Verdict:
    """The default against one rival on mean TTFT: ``word`` is ``leads``, ``ties`` or ``trails``;
    ``change`` = default's mean / rival's mean − 1 (−0.10: 10 % lower); ``noise`` the same ratio's
    half-width (two standard errors of the difference of the means)."""

    word: str
    change: float
    noise: float

    def __str__(self) -> str:
        return f"{self.word} ({self.change:+.0%} ± {self.noise:.0%})"


def verdict(default_mean: float, default_se: float, rival_mean: float, rival_se: float) -> Verdict:
    """Compare two mean TTFTs (same unit) with their standard errors: ``leads`` when the default's is
    lower by more than two standard errors of the difference, ``trails`` when higher by more, ``ties``
    otherwise. Requests of one run queue together, so their TTFTs are correlated and the true noise is
    larger: a ``leads`` here is a lower bound on what a rerun may show, not a proof."""
    diff = default_mean - rival_mean
    noise = 2.0 * math.hypot(default_se, rival_se)
    word = "leads" if diff < -noise else "trails" if diff > noise else "ties"
    return Verdict(word, diff / rival_mean, noise / rival_mean)


def summary_sentence(default: str, verdicts: Mapping[str, Verdict]) -> str:
    """One sentence: whether the default leads, ties or trails, naming the rivals of each."""
    by: dict[str, list[str]] = {"leads": [], "ties": [], "trails": []}
    for rival, v in verdicts.items():
        by[v.word].append(rival)
    if not verdicts:
        return f"Only the default ({default}) ran: nothing to compare."
    if not by["ties"] and not by["trails"]:
        return f"The default ({default}) leads: its mean TTFT is below every rival's by more than the noise."
    clauses = [
        f"{word} {', '.join(by[key])}"
        for key, word in (("trails", "trails"), ("ties", "ties with"), ("leads", "leads"))
        if by[key]
    ]
    tie = " (a tie: within the noise)" if by["ties"] else ""
    return f"The default ({default}) {'; '.join(clauses)} on mean TTFT{tie}."


BUSY_FACTOR = 2.0
"""A client mean TTFT above this multiple of the engines' own marks a run the machine, not the policy,
dominated (router and client starved of CPU)."""


def busy_machine_warning(rows: Sequence[dict[str, Any]]) -> str | None:
    """A warning naming the runs whose client mean TTFT exceeds :data:`BUSY_FACTOR` × the engines' own
    (both in model ms), or None when every run's client TTFT is mostly the engines'."""
    busy = [
        f"{r['policy']} ({r['ttft_ms']['mean'] / r['engine_ttft_ms_mean']:.0f}×)"
        for r in rows
        if r["engine_ttft_ms_mean"] > 0 and r["ttft_ms"]["mean"] > BUSY_FACTOR * r["engine_ttft_ms_mean"]
    ]
    if not busy:
        return None
    return (
        f"This machine was too busy for these runs: the client's mean TTFT is many times the engines' own "
        f"for {', '.join(busy)}.\nThe router and the load generator waited for CPU, so the client-side "
        "columns measure the machine, not the\npolicy: compare the engines' own TTFT and the simulated "
        "column, or rerun on a quieter machine."
    )


def live_table(rows: Sequence[dict[str, Any]], default: str, bound: dict[str, float] | None) -> str:
    """The main table: one row per policy measured over HTTP, the bound's row below them. ``rows``:
    the job's JSON rows (``ttft_ms`` in model ms, ``verdict`` set on every rival's row)."""
    base = next((r for r in rows if r["policy"] == BALANCER), None)
    lines = [
        "| arm | policy | mean TTFT (ms) | vs balancer | p99 TTFT (ms) | KV hit rate "
        "| engines' own TTFT (ms) | simulated TTFT (ms) | the default |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        rel = f"{r['ttft_ms']['mean'] / base['ttft_ms']['mean']:.2f}×" if base else "-"
        lines.append(
            f"| {plain_name(r['policy'], default)} | `{r['policy']}` | {r['ttft_ms']['mean']:.1f} | {rel} | "
            f"{r['ttft_ms']['p99']:.1f} | {r['kv_hit_rate']:.3f} | {r['engine_ttft_ms_mean']:.1f} | "
            f"{r['simulated_ttft_ms_mean']:.1f} | {r.get('verdict', '—')} |"
        )
    if bound is not None:
        rel = f"{bound['ttft_mean_ms'] / base['ttft_ms']['mean']:.2f}×" if base else "-"
        lines.append(
            f"| bound: no router does better | — | ≥ {bound['ttft_mean_ms']:.1f} | {rel} | "
            f"≥ {bound['ttft_p99_ms']:.1f} | ≤ {bound['kv_hit_rate']:.3f} | | | |"
        )
    return "\n".join(lines)


def sim_table(results: Sequence[tuple[str, dict[str, Any]]], bound: dict[str, float] | None) -> str:
    """The simulator-only table: ``results`` = (arm, simulated summary), the first the reference."""
    ref = float(results[0][1]["ttft_ms"]["mean"])
    lines = [
        f"| arm | mean TTFT (ms) | p99 TTFT (ms) | KV hit rate | vs {results[0][0]} |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results:
        lines.append(
            f"| {name} | {r['ttft_ms']['mean']:.1f} | {r['ttft_ms']['p99']:.1f} | {r['kv_hit_rate']:.3f} | "
            f"{r['ttft_ms']['mean'] / ref:.2f}× |"
        )
    if bound is not None:
        lines.append(
            f"| bound | ≥ {bound['ttft_mean_ms']:.1f} | ≥ {bound['ttft_p99_ms']:.1f} | "
            f"≤ {bound['kv_hit_rate']:.3f} | {bound['ttft_mean_ms'] / ref:.2f}× |"
        )
    return "\n".join(lines)
