"""Simulator speed: simulated seconds per wall second, and a 1,000,000-request run's time and memory.

Writes ``benchmarks/results/sim_speed.json``:
``{"speedup_vs_realtime", "mooncake": {...}, "default_load": {...}, "million": {...}}``.

- ``speedup_vs_realtime``: the Mooncake conversation trace (12,031 requests, 1 h) on 16 instances
  with ``lmetric`` (target >= 500). Needs ../shared; without it the chatbot workload stands in and
  the JSON says so.
- ``default_load``: the chatbot workload on 16 instances at the paper's default load (half of
  saturation; the rate scale is ``DEFAULT_LOAD_SCALE``, see docs/results/paper-table.md) (target >= 500).
- ``million``: 1,000,000 requests of the ``api`` workload on 16 instances in a child process: wall
  time (target <= 600 s) and peak RSS (bounded: the simulator keeps 24 bytes per finished request).
  Set ``KVROUTE_BENCH_MILLION=0`` to skip it (it takes minutes).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, SHARED, table, write
from kvroute.commands.settings import sim_command
from kvroute.sim.runner import RunSpec, run_spec

DEFAULT_LOAD_SCALE = (
    4.0  # half of chatbot's measured max rate (x8) on 16 instances: docs/results/paper-table.md
)
API_BASE_RATE = 40.0  # requests/s of the api workload at rate scale 1


def _speed(spec: RunSpec) -> dict[str, float]:
    out = run_spec(spec)
    return {
        "requests": out["requests"],
        "sim_seconds": out["sim_seconds"],
        "wall_seconds": out["wall_seconds"],
        "speedup_vs_realtime": out["sim_seconds"] / out["wall_seconds"],
        "command": sim_command(spec),
    }


def _million() -> dict[str, float]:
    duration = 1_000_000 / API_BASE_RATE
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [
            sys.executable, "-m", "kvroute.cli", "sim", "--workload", "api", "--duration", f"{duration:g}",
            "--instances", "16", "--no-progress", "--json", f.name,
        ]  # fmt: skip
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = json.loads(Path(f.name).read_text())
    return {
        "requests": out["requests"],
        "unfinished": out["unfinished"],
        "sim_seconds": out["sim_seconds"],
        "wall_seconds": out["wall_seconds"],
        "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "peak_rss_mib": after.ru_maxrss / 1024,
        "command": " ".join(["kvroute", *cmd[3:-2]]),
    }


def main() -> int:
    mooncake = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
    if mooncake.exists():
        moon = _speed(RunSpec(policy="lmetric", instances=16, trace=str(mooncake)))
    else:
        print("../shared not found: the chatbot workload stands in for the Mooncake trace")
        moon = {**_speed(RunSpec(policy="lmetric", instances=16, workload="chatbot")), "stand_in": True}
    default = _speed(
        RunSpec(policy="lmetric", instances=16, workload="chatbot", rate_scale=DEFAULT_LOAD_SCALE)
    )
    million = _million() if os.environ.get("KVROUTE_BENCH_MILLION", "1") != "0" else None
    rows = [
        ("Mooncake, 16 inst, lmetric: speedup", f"{moon['speedup_vs_realtime']:.0f}x", ">= 500x"),
        (
            f"chatbot x{DEFAULT_LOAD_SCALE:g} (default load): speedup",
            f"{default['speedup_vs_realtime']:.0f}x",
            ">= 500x",
        ),
    ]
    if million:
        rows += [
            ("1M api requests: wall", f"{million['wall_seconds']:.0f} s", "<= 600 s"),
            ("1M api requests: peak RSS", f"{million['peak_rss_mib']:.0f} MiB", "bounded"),
        ]
    table(rows)
    write(
        "sim_speed.json",
        {
            "speedup_vs_realtime": moon["speedup_vs_realtime"],
            "mooncake": moon,
            "default_load": default,
            "million": million,
            "targets": {"speedup_vs_realtime": 500, "million_wall_seconds": 600},
        },
    )
    return 0
