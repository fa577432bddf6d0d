"""benchmarks.policy_findings' TPOT anatomy on a real (short) simulated run: the step log splits every
request's decode time exactly into prefill steps and pure-decode steps."""

from __future__ import annotations

import json

import pytest
from benchmarks import policy_findings


def test_tpot_anatomy_splits_each_requests_decode_into_prefill_and_decode_steps(tmp_path) -> None:
    out = tmp_path / "f.json"
    argv = ["--workload", "agent", "--instances", "2", "--rate", "0.5", "--duration", "5", "--seed", "1"]
    assert policy_findings.main([*argv, "--policies", "lmetric-time,vllm", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["policy"] for r in runs] == ["lmetric-time", "vllm"]
    for run in runs:
        a = run["tpot_anatomy"]
        rows = a["p99_rows"]
        assert rows and a["requests"] > len(rows)
        # the p99 rows start at the run's own TPOT p99 (rank ⌊0.99·(n − 1)⌋) and are sorted
        assert rows[0]["tpot_ms"] == pytest.approx(run["tpot_ms_p99"])
        assert [x["tpot_ms"] for x in rows] == sorted(x["tpot_ms"] for x in rows)
        for x in rows:
            assert x["tpot_ms"] == pytest.approx(x["prefill_ms"] + x["decode_ms"])
            assert x["prefill_ms"] >= 0 and x["decode_ms"] > 0 and x["batch_mean"] >= 1
            assert (x["prefill_steps"] == 0) == (x["prefill_tokens"] == 0)
        assert a["all"]["prefill_ms"] > 0  # with 2 instances some decode beside another's prefill
        spread = run["batch_spread"]
        assert 0 <= spread["pick_minus_least"] <= spread["most_minus_least"]
        assert 0 <= run["above_least"]["share"] <= 1
    # the cache-blind balancer picks the least-loaded instance or one within a few sequences of it
    assert runs[1]["above_least"]["share"] == 0.0
