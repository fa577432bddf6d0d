"""Capacity at a latency SLO: the highest arrival-rate scale at which a policy's run keeps TTFT p99 and
TPOT p99 within the SLO with every request finished.

The search (per policy, the same for every policy so that capacities have the same resolution): probe
the light rate; if it meets the SLO multiply the rate by ``factor`` until a probe fails, else divide
until one meets it (at most ``max_ramp`` steps either way); then bisect ``refine`` times in log space
between the highest passing and the lowest failing probe. The capacity is the highest passing probe,
within a factor ``factor ** (1 / 2 ** refine)`` of the true crossing (2 ** (1/8) = 9 % by default) if
latency grows monotonically with the rate. A state machine, so that many searches share one pool.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from kvroute.errors import UserError

Summary = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives in ms: p99 TTFT and p99 TPOT."""

    ttft_p99_ms: float
    tpot_p99_ms: float

    def check(self) -> None:
        for name, v in (("TTFT", self.ttft_p99_ms), ("TPOT", self.tpot_p99_ms)):
            if not (v > 0 and math.isfinite(v)):
                raise UserError(f"the {name} SLO must be a positive number of ms (got {v})")


def meets_slo(summary: Summary, slo: Slo) -> bool:
    """Every request finished and both p99s within ``slo`` (NaN, e.g. nothing finished, fails)."""
    ttft = float(summary["ttft_ms"]["p99"])
    tpot = float(summary["tpot_ms"]["p99"])
    return summary["unfinished"] == 0 and ttft <= slo.ttft_p99_ms and tpot <= slo.tpot_p99_ms


@dataclass(frozen=True, slots=True)
class CapacityRule:
    """How capacity is searched for: see the module docstring."""

    light_rate: float
    slo: Slo
    factor: float = 2.0
    refine: int = 3
    max_ramp: int = 8

    def check(self) -> None:
        if not (self.light_rate > 0 and math.isfinite(self.light_rate)):
            raise UserError(f"light rate must be a positive number (got {self.light_rate})")
        if not self.factor > 1 or self.refine < 0 or self.max_ramp < 1:
            raise UserError("capacity search: factor must be > 1, refine >= 0, max_ramp >= 1")
        self.slo.check()


@dataclass(frozen=True, slots=True)
class CapacityProbe:
    """One measured rate: its p99s (ms), unfinished requests, whether it met the SLO."""

    rate: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    unfinished: int
    ok: bool


@dataclass(frozen=True, slots=True)
class Capacity:
    """The outcome. ``rate``: highest probe meeting the SLO (None: none did, even ``max_ramp``
    divisions below the light rate); ``failed_rate``: lowest failing probe (None: the ramp never
    failed, the capacity is at least ``rate``)."""

    rate: float | None
    failed_rate: float | None
    probes: tuple[CapacityProbe, ...]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["probes"] = [dict(p) for p in d["probes"]]
        return d


class CapacitySearch:
    """``next_rate()`` (None when done), measure it, ``record(rate, summary)``; finally ``result()``."""

    def __init__(self, rule: CapacityRule) -> None:
        rule.check()
        self.rule = rule
        self.probes: list[CapacityProbe] = []
        self._lo: float | None = None  # highest passing rate so far
        self._hi: float | None = None  # lowest failing rate so far
        self._ramps = 0
        self._refines = 0

    def next_rate(self) -> float | None:
        rule = self.rule
        if not self.probes:
            return rule.light_rate
        lo, hi = self._lo, self._hi
        if lo is not None and hi is not None:
            return math.sqrt(lo * hi) if self._refines < rule.refine else None
        if self._ramps >= rule.max_ramp:
            return None
        return lo * rule.factor if lo is not None else hi / rule.factor  # type: ignore[operator]

    def record(self, rate: float, summary: Summary) -> None:
        ok = meets_slo(summary, self.rule.slo)
        if self.probes:
            if self._lo is not None and self._hi is not None:
                self._refines += 1
            else:
                self._ramps += 1
        self.probes.append(
            CapacityProbe(
                rate,
                float(summary["ttft_ms"]["p99"]),
                float(summary["tpot_ms"]["p99"]),
                int(summary["unfinished"]),
                ok,
            )
        )
        if ok:
            self._lo = rate if self._lo is None else max(self._lo, rate)
        else:
            self._hi = rate if self._hi is None else min(self._hi, rate)

    @property
    def done(self) -> bool:
        return self.next_rate() is None

    def result(self) -> Capacity:
        if not self.done:
            raise RuntimeError("the capacity search is not finished")
        return Capacity(self._lo, self._hi, tuple(self.probes))
