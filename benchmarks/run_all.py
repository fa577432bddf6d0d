"""`make bench`: run every ``benchmarks/bench_*.py`` module's ``main()`` in name order.

Each benchmark prints a table and writes its JSON under ``benchmarks/results/``. A benchmark that
needs ``../shared`` and cannot find it says so and is skipped; any other failure fails the run.
"""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    RESULTS.mkdir(parents=True, exist_ok=True)
    names = sorted(p.stem for p in Path(__file__).resolve().parent.glob("bench_*.py"))
    only = set(sys.argv[1:])
    failed = []
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        print(f"\n=== {name} ===", flush=True)
        t0 = time.perf_counter()
        mod = importlib.import_module(f"benchmarks.{name}")
        rc = mod.main()
        print(f"--- {name}: {'ok' if not rc else f'FAILED ({rc})'} in {time.perf_counter() - t0:.1f} s")
        if rc:
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
