"""``benchmarks.paper_summary`` on a hand-built preset result: verdicts, capacity ratios, the bound."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks.paper_summary import REFERENCE, main, summarize

from kvroute.policies.registry import DEFAULT_POLICY
from kvroute.sim.compare import DEFAULT_ARM

REF = DEFAULT_ARM  # the default: its policy behind the router-side queue
PLAIN = DEFAULT_POLICY  # the same policy without the queue


def _run(policy: str, rate: float, seed: int, mean: float, p99: float, tpot: float = 20.0) -> dict[str, Any]:
    return {
        "policy": policy,
        "rate_scale": rate,
        "seed": seed,
        "ttft_ms": {"mean": mean, "p99": p99},
        "tpot_ms": {"p99": tpot},
    }


def _workload() -> dict[str, Any]:
    runs, seed_runs = [], []
    # the default: 100/110/120 ms over seeds 0..2; vllm 10 % slower on every seed (a clear lead);
    # llm-d-lmetric +5 %, −5 %, 0 % (a tie) with a TPOT p99 20 % lower (a loss); the default's policy
    # without the queue equal at the default load
    for s, base in enumerate((100.0, 110.0, 120.0)):
        rows = [
            _run(REF, 2.0, s, base, 2 * base),
            _run("vllm", 2.0, s, 1.1 * base, 2.2 * base),
            _run("llm-d-lmetric", 2.0, s, base * (1.05, 0.95, 1.0)[s], 2 * base, tpot=16.0),
            _run(PLAIN, 2.0, s, base, 2 * base),
        ]
        (runs if s == 0 else seed_runs).extend(rows)
    runs += [_run(PLAIN, 0.5, 0, 50.0, 70.0), _run(REF, 0.5, 0, 50.0, 69.0)]
    caps = {REF: 4.0, "vllm": 2.0, "llm-d-lmetric": 4.0, PLAIN: 3.2}
    return {
        "name": "chatbot",
        "default_rate": 2.0,
        "rates": [0.5, 1.0, 2.0, 4.0],
        "runs": runs,
        "seed_runs": seed_runs,
        "capacity": [{"policy": p, "seed": 0, "rate": r} for p, r in caps.items()],
        "bound": {"capacity": 40.0},
    }


def test_verdicts_capacity_and_the_bound() -> None:
    assert REFERENCE == DEFAULT_ARM == f"{DEFAULT_POLICY} +queue"
    s = summarize(_workload())
    rows = {r["arm"]: r for r in s["rows"]}
    assert rows["vllm"]["verdict_mean"] == "leads" and rows["vllm"]["verdict_p99"] == "leads"
    assert abs(rows["vllm"]["vs_default_mean"][0] - 0.10) < 1e-12
    assert rows["llm-d-lmetric"]["verdict_mean"] == "tie"
    assert rows["llm-d-lmetric"]["verdict_tpot_p99"] == "loses"
    assert rows["vllm"]["capacity_vs_default"] == 0.5 and rows[REF]["of_bound"] == 0.1
    assert rows[PLAIN]["verdict_mean"] == "tie" and rows[PLAIN]["capacity_vs_default"] == 0.8
    (q,) = s["queue"]
    assert (q["policy"], q["ratio"], q["light_p99_ms"], q["light_p99_queue_ms"]) == (
        PLAIN,
        1.25,
        70.0,
        69.0,
    )


def _summary_of(w: dict[str, Any], tmp_path: Path) -> str:
    """The markdown ``main`` writes for a preset folder holding workload ``w``."""
    (tmp_path / "chatbot").mkdir()
    (tmp_path / "chatbot" / "results.json").write_text(json.dumps(w))
    (tmp_path / "paper.json").write_text(
        json.dumps({"workloads": [{"name": "chatbot", "bound": w["bound"]}]})
    )
    out = tmp_path / "s.md"
    assert main(["--dir", str(tmp_path), "--out", str(out)]) == 0
    return out.read_text()


def test_reads_the_preset_folder_and_writes_markdown(tmp_path: Path) -> None:
    text = _summary_of(_workload(), tmp_path)
    assert "| vllm | 121.0 | +10% [+10, +10] | leads | 242.0 | +10% [+10, +10] | leads | 20.0 |" in text
    assert f"# Where the default (`{REF}`) leads" in text
    assert "capacity bound ×40" in text
    assert main(["--dir", str(tmp_path / "missing")]) == 2


def test_a_result_without_the_default_is_read_against_lmetric(tmp_path: Path) -> None:
    w = _workload()
    for r in [*w["runs"], *w["seed_runs"]]:
        r["policy"] = r["policy"].replace(REF, "lmetric")
    text = _summary_of(w, tmp_path)
    assert f"# Where `lmetric` (the default, `{REF}`, was not in this run) leads" in text
    assert "| vllm | 121.0 | +10% [+10, +10] | leads |" in text
