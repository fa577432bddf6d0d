"""Per-request latency records → summaries and tables.

Streaming: a :class:`LatencyRecorder` keeps three compact float arrays (TTFT, TPOT, end-to-end,
in seconds) and token sums, never the requests themselves, so a million-request run stays small
(24 bytes per request).
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


def summarize_ms(values_s: array | list[float] | np.ndarray) -> dict[str, float]:
    """``{"mean", "p50", "p90", "p99"}`` in milliseconds of values given in seconds (NaN if empty)."""
    a = np.frombuffer(values_s, dtype=np.float64) if isinstance(values_s, array) else np.asarray(values_s)
    if a.size == 0:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    pct = np.percentile(a, PERCENTILES) * 1000.0
    return {
        "mean": float(a.mean() * 1000.0),
        **{f"p{p}": float(v) for p, v in zip(PERCENTILES, pct, strict=True)},
    }


def quantile_points_ms(values_s: array | list[float] | np.ndarray, n: int) -> list[float]:
    """At most ``n`` evenly spaced quantiles (minimum and maximum included) of values given in seconds,
    in milliseconds, ascending: a downsampled empirical CDF. All values when there are at most ``n``."""
    a = np.frombuffer(values_s, dtype=np.float64) if isinstance(values_s, array) else np.asarray(values_s)
    if a.size <= n:
        return [float(v) for v in np.sort(a) * 1000.0]
    return [float(v) for v in np.quantile(a, np.linspace(0.0, 1.0, n)) * 1000.0]


class LatencyRecorder:
    """Accumulates finished requests.

    TTFT = first token − arrival; TPOT = (last token − first token) / (output tokens − 1), only for
    requests with more than one output token; e2e = last token − arrival. All in seconds.
    ``kv_hit_rate`` = prompt tokens served from the prefix cache / all prompt tokens.
    """

    def __init__(self) -> None:
        self.ttft = array("d")
        self.tpot = array("d")
        self.e2e = array("d")
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    def add(self, arrival: float, first: float, last: float, prompt: int, cached: int, output: int) -> None:
        self.ttft.append(first - arrival)
        self.e2e.append(last - arrival)
        if output > 1:
            self.tpot.append((last - first) / (output - 1))
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.output_tokens += output

    def merge(self, other: LatencyRecorder) -> None:
        """Add every request ``other`` recorded (e.g. rounds of one run measured apart)."""
        self.ttft.extend(other.ttft)
        self.tpot.extend(other.tpot)
        self.e2e.extend(other.e2e)
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens

    @property
    def finished(self) -> int:
        return len(self.ttft)

    def summary(self) -> dict[str, Any]:
        return {
            "ttft_ms": summarize_ms(self.ttft),
            "tpot_ms": summarize_ms(self.tpot),
            "e2e_ms": summarize_ms(self.e2e),
            "kv_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }


def comparison_table(rows: list[dict[str, Any]], title: str | None = None) -> str:
    """A markdown table of summaries (one per policy): TTFT mean/p99, TPOT mean/p99, KV hit rate."""
    lines = []
    if title:
        lines += [f"### {title}", ""]
    lines.append(
        "| policy | requests | TTFT mean (ms) | TTFT p99 (ms) | TPOT mean (ms) | TPOT p99 (ms) | KV hit rate |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lines.append(
            f"| {r['policy']} | {r['requests'] - r.get('unfinished', 0)} | {r['ttft_ms']['mean']:.1f} | "
            f"{r['ttft_ms']['p99']:.1f} | {r['tpot_ms']['mean']:.2f} | {r['tpot_ms']['p99']:.2f} | "
            f"{r['kv_hit_rate']:.3f} |"
        )
    return "\n".join(lines)
