"""Score monitoring (design §5.3): the distribution of P-token × BS over routing decisions.

For every decision the monitor takes the chosen instance's ``P-token × (BS + 1)`` (the LMetric score
in the authors' form, whatever policy chose; tokens × requests) and

- adds it to a fixed-bucket histogram (Prometheus ``le`` buckets, 1-2-5 steps from 10 to 5·10^9);
- keeps the last ``window`` scores and, every ``refresh_every`` decisions, recomputes their
  ``quantile`` (default p95) — the *rolling threshold*;
- raises an **alert** when ``persist`` consecutive decisions (default 20) score above the threshold
  (by chance that is 0.05^20 ≈ 10^-26: it means the distribution moved up), once per episode; the
  episode ends at the first decision at or below the threshold. No alert before ``min_decisions``.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from kvroute.errors import UserError

__all__ = ["DEFAULT_BUCKETS", "ScoreMonitor", "ScoreMonitorConfig"]

DEFAULT_BUCKETS: tuple[float, ...] = tuple(m * 10.0**e for e in range(1, 10) for m in (1, 2, 5))
"""Histogram upper bounds (tokens × requests): 10, 20, 50, 100, …, 5·10^9 (then +Inf)."""

EVENTS_KEPT = 1000


@dataclass(frozen=True, slots=True)
class ScoreMonitorConfig:
    window: int = 2000
    quantile: float = 0.95
    refresh_every: int = 100
    persist: int = 20
    min_decisions: int = 200

    def check(self) -> ScoreMonitorConfig:
        if self.window < 1 or not 0 < self.quantile < 1 or self.refresh_every < 1 or self.persist < 1:
            raise UserError("score monitor: window, refresh_every, persist >= 1 and 0 < quantile < 1")
        if self.min_decisions < 1:
            raise UserError("score monitor: min_decisions >= 1")
        return self


class ScoreMonitor:
    """See the module docstring. ``observe`` mutates it; everything else reads."""

    def __init__(self, config: ScoreMonitorConfig, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self.config = config.check()
        self.buckets = buckets
        self.bucket_counts = [0] * (len(buckets) + 1)  # last: above every bound (+Inf only)
        self.count = 0
        self.sum = 0.0
        self.max = 0.0
        self.threshold = float("inf")  # rolling quantile; inf until the first refresh
        self._recent: deque[float] = deque(maxlen=config.window)
        self._streak = 0
        self.alerting = False
        self.alerts = 0
        self.events: deque[tuple[float, float, float]] = deque(maxlen=EVENTS_KEPT)  # (time, score, threshold)

    def observe(self, score: float, now: float) -> bool:
        """Record one decision's score at ``now``; True when this decision starts an alert."""
        cfg = self.config
        self.count += 1
        self.sum += score
        if score > self.max:
            self.max = score
        self.bucket_counts[bisect.bisect_left(self.buckets, score)] += 1
        started = False
        if score > self.threshold and self.count > cfg.min_decisions:
            self._streak += 1
            if self._streak >= cfg.persist and not self.alerting:
                self.alerting = True
                self.alerts += 1
                self.events.append((now, score, self.threshold))
                started = True
        else:
            self._streak = 0
            self.alerting = False
        self._recent.append(score)
        if self.count % cfg.refresh_every == 0:
            ordered = sorted(self._recent)
            self.threshold = ordered[min(len(ordered) - 1, int(cfg.quantile * len(ordered)))]
        return started

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, decisions with score <= bound)`` for each bucket, then ``(inf, count)``."""
        out = []
        acc = 0
        for bound, c in zip(self.buckets, self.bucket_counts, strict=False):
            acc += c
            out.append((bound, acc))
        out.append((float("inf"), self.count))
        return out

    def summary(self) -> dict[str, object]:
        """For the simulator's JSON: count, mean, max, rolling threshold, alerts, non-empty buckets."""
        return {
            "count": self.count,
            "mean": self.sum / self.count if self.count else 0.0,
            "max": self.max,
            "rolling_p95": self.threshold if self.threshold != float("inf") else None,
            "alerts": self.alerts,
            "buckets": {
                ("+Inf" if b == float("inf") else f"{b:g}"): c
                for (b, c), raw in zip(self.cumulative(), self.bucket_counts, strict=True)
                if raw
            },
        }
