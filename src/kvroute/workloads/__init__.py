"""Workloads: trace readers (:mod:`.traces`) and seeded synthetic generators (:mod:`.synthetic`), both
streams of :class:`Request` in non-decreasing arrival order. :func:`open_workload` is the CLI's entry."""

from __future__ import annotations

import math
from collections.abc import Iterator

from kvroute.errors import UserError
from kvroute.workloads.request import Request, Workload
from kvroute.workloads.synthetic import WORKLOADS, make_workload
from kvroute.workloads.traces import TRACE_FORMATS, TraceStats, open_trace

__all__ = [
    "TRACE_FORMATS",
    "WORKLOADS",
    "Request",
    "TraceStats",
    "Workload",
    "make_workload",
    "open_trace",
    "open_workload",
]


def open_workload(
    trace: str | None,
    fmt: str,
    workload: str | None,
    rate_scale: float,
    duration: float | None,
    seed: int,
    skip_bad_lines: bool,
) -> tuple[Iterator[Request], TraceStats]:
    """The request stream for ``--trace FILE [--format FMT]`` or ``--workload NAME`` (exactly one).

    ``rate_scale`` (> 0) divides arrivals; ``duration`` (seconds, > 0) cuts the stream — for a trace None
    means the whole file, for a workload None means the workload's default duration. ``seed`` only
    affects synthetic workloads; ``fmt`` and ``skip_bad_lines`` only traces. The returned
    :class:`TraceStats` is updated while the stream is consumed (``fmt`` = ``"synthetic:NAME"`` for
    workloads). Raises :class:`UserError` on invalid arguments, a missing file or an unknown name."""
    if (trace is None) == (workload is None):
        raise UserError("give exactly one of --trace FILE or --workload NAME")
    if not rate_scale > 0 or rate_scale == math.inf:
        raise UserError(f"--rate-scale must be a positive finite number, got {rate_scale}")
    if duration is not None and not duration > 0:
        raise UserError(f"--duration must be > 0 seconds, got {duration}")
    if trace is not None:
        return open_trace(trace, fmt, rate_scale, duration, skip_bad_lines)
    assert workload is not None
    stats = TraceStats(fmt=f"synthetic:{workload}")
    return _counted(make_workload(workload, seed, rate_scale, duration), stats), stats


def _counted(requests: Iterator[Request], stats: TraceStats) -> Iterator[Request]:
    for r in requests:
        stats.requests += 1
        yield r
