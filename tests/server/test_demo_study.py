"""benchmarks/study_demo_arms: its arms' syntax, its refusals and its table (the runs themselves are
the main job's, tested in test_demo)."""

from __future__ import annotations

import pytest
from benchmarks.study_demo_arms import _arms, main, markdown

from kvroute.errors import UserError


def test_an_arm_is_a_policy_and_its_shadows() -> None:
    assert _arms("lmetric+lmetric-time, lmetric-time,lmetric") == [
        ("lmetric+lmetric-time", "lmetric", ("lmetric-time",)),
        ("lmetric-time", "lmetric-time", ()),
        ("lmetric", "lmetric", ()),
    ]
    with pytest.raises(UserError, match="unknown policy 'nope'"):
        _arms("lmetric+nope")
    with pytest.raises(UserError, match="at least one arm"):
        _arms(" , ")


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--order", "lmetric,bogus"]) == 2
    assert main(["--order", "lmetric", "--out", "/tmp/elsewhere.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("study_demo_arms: ") for line in err)
    assert "unknown policy 'bogus'" in err[0] and "not a path" in err[1]


def test_the_table_shows_what_happens_outside_the_engines() -> None:
    row = {
        "position": 2,
        "arm": "lmetric+lmetric-time",
        "ttft_ms": {"mean": 130.0},
        "ttft_se_ms": 2.5,
        "engine_ttft_ms_mean": 95.5,
        "process_cpu_ms_per_request": 4.25,
        "routing_ms_per_request": 0.8,
        "decide_ms_per_request": 0.31,
        "gc_full": 1,
        "gc_pause_ms": 212.0,
        "text_blocks_made": 0,
        "loadavg_before": (1.5, 2.0, 2.5),
    }
    lines = markdown([row]).splitlines()
    assert len(lines) == 3 and lines[0].count("|") == lines[2].count("|")
    assert lines[2] == (
        "| 2 | `lmetric+lmetric-time` | 130.0 ± 2.5 | 95.5 | 34.5 | 4.25 | 0.80 | 0.310 | 1 | 212 | 0 | 1.50 |"
    )
