"""open_workload: the CLI's single entry to traces and synthetic workloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.errors import UserError
from kvroute.workloads import open_workload


def test_trace_path(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]} for t in (0, 1000, 4000)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    reqs, stats = open_workload(str(path), "auto", None, 2.0, 1.0, 0, False)
    assert [r.arrival for r in reqs] == [0.0, 0.5]
    assert stats.fmt == "mooncake" and stats.requests == 2


def test_workload_path_counts_requests() -> None:
    reqs, stats = open_workload(None, "auto", "coder", 1.0, 10.0, 1, False)
    out = list(reqs)
    assert stats.fmt == "synthetic:coder" and stats.requests == len(out) > 50
    assert all(r.arrival < 10.0 for r in out)
    again, _ = open_workload(None, "auto", "coder", 1.0, 10.0, 1, False)
    assert list(again) == out


@pytest.mark.parametrize(
    ("trace", "workload", "rate_scale", "duration", "match"),
    [
        (None, None, 1.0, None, "exactly one"),
        ("x.jsonl", "chatbot", 1.0, None, "exactly one"),
        (None, "chatbot", 0.0, None, "rate-scale"),
        (None, "chatbot", float("nan"), None, "rate-scale"),
        (None, "chatbot", 1.0, 0.0, "duration"),
        (None, "nope", 1.0, None, "unknown workload"),
        ("/definitely/not/here.jsonl", None, 1.0, None, "not found"),
    ],
)
def test_nonsense_is_user_error(
    trace: str | None, workload: str | None, rate_scale: float, duration: float | None, match: str
) -> None:
    with pytest.raises(UserError, match=match):
        open_workload(trace, "auto", workload, rate_scale, duration, 0, False)
