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
    # the table of the JSON written: one row per policy, the TPOT p99 as the JSON has it
    assert policy_findings.main(["--tpot-table", str(out)]) == 0


def test_tpot_table_rows(capsys) -> None:
    rep = {
        "workload": "agent",
        "instances": 8,
        "rate_scale": 2.828,
        "seed": 1,
        "runs": [
            {
                "policy": "p",
                "tpot_ms_p99": 60.25,
                "kv_hit_rate": 0.9,
                "tpot_anatomy": {
                    "p99_and_above": {
                        "prefill_ms": 18.0,
                        "decode_ms": 42.8,
                        "batch_mean": 29.2,
                        "context_k_mean": 210,
                    }
                },
                "batch_spread": {"most_minus_least": 14.4},
                "above_least": {"share": 0.21, "cached_share_pick": 0.95, "cached_share_least": 0.01},
            }
        ],
    }
    table = policy_findings.tpot_table([rep])
    assert table.splitlines()[2] == (
        "| agent/8 ×2.83 seed 1 | p | 60.2 | 18.0 + 42.8 | 29.2 / 210 | 14.4 | 21 % | 0.95 / 0.01 | 0.900 |"
    )
