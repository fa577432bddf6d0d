"""``benchmarks.policy_grid --merge`` for latency grids: an earlier grid's arms join the cells both
grids have, and an arm both ran must agree sample by sample."""

from __future__ import annotations

import json
from typing import Any

import pytest
from benchmarks.policy_grid import main, merge_latency

from kvroute.sim.compare import DEFAULT_ARM


def _fig(x: float) -> dict[str, float]:
    return {"ttft_ms_mean": x, "ttft_ms_p99": 2 * x, "tpot_ms_p99": x / 2}


def _old() -> dict[str, Any]:
    row = {"preemptions": 0, "unfinished": 0}
    return {
        "cells": {
            "agent/8/default": {
                "rate_scale": 2.83,
                "arms": {
                    "cand": {**row, "samples": {"1": _fig(10.0), "2": _fig(12.0)}},
                    "old-arm": {**row, "samples": {"1": _fig(9.0), "2": _fig(11.0)}},
                },
            },
            "agent/8/heavy": {"rate_scale": 3.5, "arms": {"old-arm": {**row, "samples": {"1": _fig(1.0)}}}},
        }
    }


def _new(cand_1: float = 10.0, rate: float = 2.83) -> dict[str, Any]:
    fig = {"preemptions": 0, "unfinished": 0}
    return {
        "agent/8/default": {
            "rate_scale": rate,
            "arms": {
                "cand": {1: {**fig, **_fig(cand_1)}, 2: {**fig, **_fig(12.0)}},
                "new-arm": {1: {**fig, **_fig(8.0)}, 2: {**fig, **_fig(13.0)}},
            },
        }
    }


def test_merge_adds_the_old_arms_to_shared_cells_only() -> None:
    out = merge_latency(_old(), _new())
    assert list(out) == ["agent/8/default"]  # the old grid's heavy cell is not in the new one
    arms = out["agent/8/default"]["arms"]
    assert sorted(arms) == ["cand", "new-arm", "old-arm"]
    assert arms["old-arm"][2]["ttft_ms_mean"] == 11.0 and arms["old-arm"][1]["preemptions"] == 0


def test_merge_refuses_an_arm_whose_samples_differ_and_skips_another_rate() -> None:
    with pytest.raises(ValueError, match="cand sample 1 differs"):
        merge_latency(_old(), _new(cand_1=10.5))
    assert sorted(merge_latency(_old(), _new(rate=3.0))["agent/8/default"]["arms"]) == ["cand", "new-arm"]


def test_a_real_grid_merged_with_an_earlier_one_reads_the_new_arm_against_the_old(tmp_path) -> None:
    common = ["--workloads", "agent", "--instances", "2", "--heavy", "0", "--seeds", "2", "--duration", "4"]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main([*common, "--policies", "lmetric", "--extra", "", "--out", str(first)]) == 0
    assert (
        main([*common, "--policies", "vllm", "--extra", "", "--merge", str(first), "--out", str(second)]) == 0
    )
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    cell_a, cell_b = a["cells"]["agent/2/default"], b["cells"]["agent/2/default"]
    assert sorted(cell_b["arms"]) == sorted([DEFAULT_ARM, "lmetric", "vllm"])
    assert cell_b["arms"]["lmetric"]["samples"] == cell_a["arms"]["lmetric"]["samples"]
    assert b["merged"]["command"] == a["command"]
    assert cell_b["arms"]["lmetric"]["ttft_ms_mean_vs"] == cell_a["arms"]["lmetric"]["ttft_ms_mean_vs"]


@pytest.mark.parametrize("content", [None, "{", "[1, 2"])
def test_render_of_a_missing_or_broken_file_is_a_one_line_usage_error(
    tmp_path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "grid.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--render", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: --render " in err[-1] and str(path) in err[-1]
    assert "Traceback" not in "\n".join(err)
