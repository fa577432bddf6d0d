"""PNG plots of comparison runs (matplotlib's object API on the Agg canvas: no pyplot, no global state).

Every function takes run summaries (``run_spec`` dicts) and a path, draws one figure and writes it.
Latencies are in milliseconds; rates are rate scales (× the workload's base arrival rate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvroute.errors import UserError

Summary = dict[str, Any]

METRICS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"))


def _figure(ncols: int, nrows: int = 1) -> Any:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.0 * ncols, 3.6 * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _plain_ticks(ax: Any) -> None:
    """Plain numbers (0.5, 2, 100) on log axes instead of powers."""
    from matplotlib.ticker import FuncFormatter, LogFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        # minor labels (20, 30, 50) only when the axis spans little more than a decade
        axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1.2, 0.6)))


def _save(fig: Any, path: Path) -> None:
    try:
        fig.savefig(path, format="png")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror}") from None


def _label(run: Summary, names: Callable[[str], str] | None) -> str:
    return names(run["policy"]) if names is not None else str(run["policy"])


def _by_policy(runs: Sequence[Summary]) -> dict[str, list[Summary]]:
    out: dict[str, list[Summary]] = {}
    for r in runs:
        out.setdefault(r["policy"], []).append(r)
    return out


def plot_vs_rate(
    runs: Sequence[Summary], path: Path, title: str, names: Callable[[str], str] | None = None
) -> None:
    """2×2 panels: TTFT and TPOT, mean and p99, against rate scale (log x); one line per policy."""
    fig, axes = _figure(2, 2)
    groups = _by_policy(runs)
    for col, (key, label) in enumerate(METRICS):
        for row, stat in enumerate(("mean", "p99")):
            ax = axes[row][col]
            for rs in groups.values():
                rs = sorted(rs, key=lambda r: r["rate_scale"])
                ax.plot(
                    [r["rate_scale"] for r in rs],
                    [r[key][stat] for r in rs],
                    marker="o",
                    label=_label(rs[0], names),
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            _plain_ticks(ax)
            ax.set_xlabel("rate scale (× base arrival rate)")
            ax.set_ylabel(f"{label} {stat} (ms)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)


def plot_cdfs(
    runs: Sequence[Summary], path: Path, title: str, names: Callable[[str], str] | None = None
) -> None:
    """TTFT and TPOT empirical CDFs (log x) of runs that carry ``samples``; one line per run."""
    fig, axes = _figure(2)
    for col, (key, label) in enumerate(METRICS):
        ax = axes[0][col]
        for r in runs:
            xs = r["samples"][key]
            if not xs:
                continue
            n = len(xs)
            ax.plot(xs, [(i + 1) / n for i in range(n)], label=_label(r, names))
        ax.set_xscale("log")
        _plain_ticks(ax)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)


def plot_staleness(
    runs: Sequence[Summary],
    path: Path,
    title: str,
    field: str,
    axis_label: str,
    names: Callable[[str], str] | None = None,
) -> None:
    """Mean and p99 TTFT against one staleness setting (``field``: ``scrape_interval`` or
    ``event_delay``, seconds; symlog x so 0 shows); one line per policy."""
    fig, axes = _figure(2)
    groups = _by_policy(runs)
    for col, stat in enumerate(("mean", "p99")):
        ax = axes[0][col]
        for rs in groups.values():
            rs = sorted(rs, key=lambda r: r[field])
            ax.plot(
                [r[field] for r in rs],
                [r["ttft_ms"][stat] for r in rs],
                marker="o",
                label=_label(rs[0], names),
            )
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xlabel(axis_label)
        ax.set_ylabel(f"TTFT {stat} (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(title)
    _save(fig, path)
