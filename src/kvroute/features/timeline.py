"""TTFT by arrival time, for evaluating events in a simulated run (a scale-out, a cache reset).

Keeps ``(arrival, TTFT)`` of every finished request (16 bytes each) and summarises them per
``bucket_s`` seconds of arrival time or over any arrival window.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

__all__ = ["TtftTimeline"]


class TtftTimeline:
    """``add`` mutates; ``window``/``buckets`` read. Times in seconds, results in milliseconds."""

    def __init__(self, bucket_s: float = 10.0) -> None:
        if not bucket_s > 0:
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        self.bucket_s = bucket_s
        self._arrival = array("d")
        self._ttft = array("d")

    def add(self, arrival: float, ttft_s: float) -> None:
        self._arrival.append(arrival)
        self._ttft.append(ttft_s)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """Requests that arrived in ``[start, end)``: count, TTFT mean, p50, p99 (ms; NaN if none)."""
        a = np.frombuffer(self._arrival, dtype=np.float64)
        t = np.frombuffer(self._ttft, dtype=np.float64)[(a >= start) & (a < end)] * 1000.0
        if not t.size:
            nan = float("nan")
            return {
                "start": start,
                "end": end,
                "requests": 0,
                "ttft_mean_ms": nan,
                "ttft_p50_ms": nan,
                "ttft_p99_ms": nan,
            }
        p50, p99 = np.percentile(t, [50, 99])
        return {
            "start": start,
            "end": end,
            "requests": int(t.size),
            "ttft_mean_ms": float(t.mean()),
            "ttft_p50_ms": float(p50),
            "ttft_p99_ms": float(p99),
        }

    def buckets(self) -> list[dict[str, Any]]:
        """One :meth:`window` per ``bucket_s`` seconds from 0 to the last arrival."""
        if not len(self._arrival):
            return []
        last = max(self._arrival)
        n = int(last // self.bucket_s) + 1
        return [self.window(k * self.bucket_s, (k + 1) * self.bucket_s) for k in range(n)]
