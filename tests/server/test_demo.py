"""The main job (`kvroute demo`) end to end on a small scale: real engines, router and HTTP."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvroute.cli import main


def test_demo_runs_the_policies_over_http(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo.json"
    rc = main(
        [
            *("demo", "--instances", "2", "--duration", "6", "--time-scale", "2", "--rate-scale", "0.5"),
            *("--policies", "lmetric,vllm,round-robin", "--json", str(out)),
        ]
    )
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["lmetric", "vllm", "round-robin"]
    assert [r["ttft_mean_vs_vllm"] for r in rows][1] == 1.0
    for r in rows:
        assert r["requests"] > 5 and r["unfinished"] == 0
        assert 0 < r["engine_ttft_ms_mean"] <= r["ttft_ms"]["mean"]  # the engine's share of the client's
        assert math.isfinite(r["simulated_ttft_ms_mean"]) and r["simulated_ttft_ms_mean"] > 0
        assert r["kv_hit_rate"] > 0
    text = capsys.readouterr().out
    assert "| lmetric |" in text and "| round-robin |" in text and "multiturn" in text
    # the simulated-only table: lmetric (+queue), the peers' variants, and the bound below them all
    sim = dict(
        (cells[0], float(cells[1]))
        for line in text.split("In the simulator only", 1)[1].splitlines()
        if line.startswith("| ") and not line.startswith("| policy")
        for cells in [[c.strip().removeprefix("≥ ") for c in line.strip("|").split("|")]]
    )
    bound = next(v for k, v in sim.items() if k.startswith("bound"))
    assert {"lmetric", "lmetric +queue", "aibrix-lmetric", "dynamo-lmetric"} <= set(sim)
    assert all(0 < bound <= v for k, v in sim.items() if not k.startswith("bound"))


def test_demo_rejects_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--policies", "nope"]) == 2
    assert "valid policies" in capsys.readouterr().err
    assert main(["demo", "--duration", "0"]) == 2
    assert main(["demo", "--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err
