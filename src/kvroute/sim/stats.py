"""Seed statistics of the presets: means with Student-t 95 % intervals over seeds, paired relative
differences, and the words the reports may use for a difference.

A difference is a ``win`` (lower latency) or a ``loss`` only when its 95 % interval excludes 0; otherwise
it is ``within noise``. With one value there is no interval and the label says so. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Two-sided 95 % quantiles of Student's t (t_{0.975, df}), df = 1..30; above 30 the normal 1.96 is
# within 4 % of the exact value (t_{0.975, 30} = 2.042).
T95 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

WIN, LOSS, NOISE, NO_INTERVAL = "win", "loss", "within noise", "one sample, no interval"


def t95(df: int) -> float:
    """t_{0.975, df} (df >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1 (got {df})")
    return T95[df - 1] if df <= len(T95) else 1.96


@dataclass(frozen=True, slots=True)
class Interval:
    """A sample mean and the half-width of its t-based 95 % interval (NaN when ``n`` < 2)."""

    mean: float
    half: float
    n: int

    @property
    def low(self) -> float:
        return self.mean - self.half

    @property
    def high(self) -> float:
        return self.mean + self.half

    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def mean_interval(values: Sequence[float]) -> Interval:
    """Mean ± t_{0.975, n−1} · s / √n of ``values`` (s: the sample standard deviation)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values")
    mean = math.fsum(values) / n
    if n < 2:
        return Interval(mean, math.nan, n)
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return Interval(mean, t95(n - 1) * math.sqrt(var / n), n)


def paired_relative(values: Sequence[float], reference: Sequence[float]) -> Interval:
    """The interval of ``values[i] / reference[i] − 1`` over seeds ``i`` (paired: the same seed's
    workload for both), as a fraction (−0.25 = 25 % lower)."""
    if len(values) != len(reference):
        raise ValueError("paired values need the same seeds")
    return mean_interval([v / r - 1.0 for v, r in zip(values, reference, strict=True)])


def label(diff: Interval) -> str:
    """``win`` / ``loss`` for a difference whose interval excludes 0 (negative: lower latency, a win),
    ``within noise`` otherwise, ``one sample, no interval`` with a single value."""
    if diff.n < 2:
        return NO_INTERVAL
    if not diff.excludes_zero():
        return NOISE
    return WIN if diff.mean < 0 else LOSS


def fmt_interval(iv: Interval, digits: int = 1, scale: float = 1.0, unit: str = "") -> str:
    """``12.3 ± 0.4`` (``scale`` multiplies both; ``unit`` follows each), or just the mean when n < 2."""
    mean = f"{iv.mean * scale:.{digits}f}{unit}"
    if iv.n < 2:
        return mean
    return f"{mean} ± {iv.half * scale:.{digits}f}{unit}"


def fmt_relative(iv: Interval) -> str:
    """A relative difference in percent with its interval: ``−23 % [−27, −19]``."""
    if iv.n < 2:
        return f"{iv.mean * 100:+.0f}%"
    return f"{iv.mean * 100:+.0f}% [{iv.low * 100:+.0f}, {iv.high * 100:+.0f}]"
