"""Helpers shared by the benchmarks: where results go, where ../shared is, machine notes."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SHARED = (ROOT / ".." / "shared").resolve()


def machine() -> dict[str, Any]:
    """What the numbers were measured on (these machines are shared: load average matters)."""
    return {
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg_1m": os.getloadavg()[0],
    }


def write(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps({**data, "machine": machine()}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return path


def table(
    rows: Sequence[tuple[str, ...]], headers: tuple[str, ...] = ("metric", "measured", "target")
) -> None:
    """Print a small aligned table."""
    from rich.console import Console
    from rich.table import Table

    t = Table(*headers)
    for r in rows:
        t.add_row(*r)
    Console().print(t)
