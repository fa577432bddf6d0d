"""``benchmarks.policy_grid --capacity``: the preset's light rates and SLO per cell, the capacity
arithmetic (paired differences, verdicts, rank, search steps, the binding term) on hand-built searches,
merging runs, and one tiny real grid whose JSON is checked against its own probes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from benchmarks import grid_capacity as gc
from benchmarks.policy_grid import main

SLO = {"ttft_p99_ms": 100.0, "tpot_p99_ms": 50.0}
STEP = 2 ** (1 / 8)


def _search(probes: list[tuple[float, float, float]]) -> dict[str, Any]:
    """A finished search's dict from (rate, TTFT p99, TPOT p99) probes judged against ``SLO``."""
    rows = [
        {"rate": r, "ttft_p99_ms": t, "tpot_p99_ms": p, "unfinished": 0, "ok": t <= 100.0 and p <= 50.0}
        for r, t, p in probes
    ]
    ok = [p["rate"] for p in rows if p["ok"]]
    bad = [p["rate"] for p in rows if not p["ok"]]
    return {"rate": max(ok) if ok else None, "failed_rate": min(bad) if bad else None, "probes": rows}


def _at(cap: float) -> dict[str, Any]:
    """A search that passed up to ``cap`` (on the 2^(k/8) lattice from 1) and failed one step above."""
    return _search([(1.0, 20.0, 10.0), (cap, 60.0, 45.0), (cap * STEP, 70.0, 55.0)])


def _raw(arms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        "chatbot/8": {
            "light_rate": 0.25,
            "slo": SLO,
            "arms": {a: {str(k + 1): s for k, s in enumerate(by)} for a, by in arms.items()},
        }
    }


def test_light_rates_scale_the_presets_per_instance() -> None:
    assert gc.light_rate("chatbot", 16) == 0.5  # the preset's own
    assert gc.light_rate("chatbot", 8) == 0.25
    assert gc.light_rate("mooncake", 8) == 0.125  # the trace's light rate is 0.25 at 16
    assert gc.light_rate("multiturn", 8) == 0.25  # not in the preset: the synthetic one's
    assert gc.sample_light("mooncake", 8, 2) == pytest.approx(0.125 * 1.002)
    assert gc.sample_light("chatbot", 8, 2) == 0.25  # a seed does not move the lattice
    assert pytest.approx(STEP) == gc.STEP


def test_verdicts_rank_and_steps() -> None:
    a, b = 4.0, 4.0 * STEP
    raw = _raw(
        {
            "cand": [_at(a), _at(a), _at(b)],
            "above": [_at(b), _at(b), _at(b * STEP)],  # one step above on every seed: the default loses
            "same": [_at(a), _at(a), _at(b)],
            "mixed": [_at(b), _at(a / STEP), _at(a)],  # +1, −1, −1 steps: a tie
            "below": [_at(a / 2), _at(a / 2), _at(b / 2)],
            "never": [_search([(1.0, 200.0, 10.0)])] * 3,  # met the SLO at no probe: capacity 0
        }
    )
    cell = gc.summarize(raw, "cand")["chatbot/8"]
    rows = cell["arms"]
    assert rows["cand"]["capacity"] == pytest.approx((a + a + b) / 3)
    assert "vs" not in rows["cand"]
    assert rows["above"]["vs"][0] == pytest.approx(STEP - 1, abs=1e-4)
    assert rows["above"]["vs"][3] == "lose" and rows["above"]["steps"] == [1, 1, 1]
    assert rows["same"]["vs"][:3] == [0.0, 0.0, 0.0] and rows["same"]["vs"][3] == "tie"
    assert rows["mixed"]["vs"][3] == "tie" and rows["mixed"]["steps"] == [1, -1, -1]
    assert rows["below"]["vs"][3] == "lead" and rows["below"]["vs"][0] == pytest.approx(-0.5)
    assert rows["never"]["capacity"] == 0.0 and rows["never"]["vs"][3] == "lead"
    assert rows["never"]["steps"] == [None, None, None]
    assert cell["rank"] == 2  # only "above" carries more on the mean
    assert cell["samples"] == 3


def test_one_sample_and_a_candidate_that_carried_nothing() -> None:
    one = gc.summarize(_raw({"cand": [_at(4.0)], "x": [_at(4.0 * STEP)], "y": [_at(4.0)]}), "cand")[
        "chatbot/8"
    ]
    assert one["arms"]["y"]["vs"][3] == "tie (one sample)"
    assert one["arms"]["x"]["vs"][3] == "lose (one sample)"  # no interval: the sign of the difference
    nothing = [_search([(1.0, 200.0, 10.0)])]
    lost = gc.summarize(_raw({"cand": nothing, "x": [_at(1.0)], "y": nothing}), "cand")["chatbot/8"]
    assert lost["arms"]["x"]["vs"][3] == "lose"
    assert lost["arms"]["y"]["vs"][3] == "tie"
    assert lost["rank"] == 2


def test_binding_names_the_term_and_compares_both_at_the_split_rate() -> None:
    # both pass 1 and 2; at 2·STEP the candidate fails on TPOT (60 > 50) where the best arm passes
    # (TPOT 48); the best arm fails one step higher
    cand = _search([(1.0, 20.0, 10.0), (2.0, 40.0, 30.0), (4.0, 90.0, 80.0), (2 * STEP, 50.0, 60.0)])
    best = _search(
        [
            (1.0, 20.0, 10.0),
            (2.0, 40.0, 28.0),
            (4.0, 95.0, 70.0),
            (2 * STEP, 45.0, 48.0),
            (2 * STEP**2, 55.0, 52.0),
        ]
    )
    other = _search([(1.0, 20.0, 10.0), (2.0, 120.0, 30.0)])
    b = gc.binding({"cand": {"1": cand}, "other": {"1": other}, "best": {"1": best}}, "cand", "1", SLO)
    assert b["capacity"] == 2.0 and b["best_arm"] == "best" and b["best_capacity"] == 2 * STEP
    assert b["failed"] == {"rate": 2 * STEP, "ttft_of_slo": 0.5, "tpot_of_slo": 1.2, "failed_on": ["TPOT"]}
    assert b["at"]["candidate"]["rate"] == 2 * STEP
    assert b["at"]["candidate"]["tpot_of_slo"] == pytest.approx(1.2)
    assert b["at"]["best"]["tpot_of_slo"] == pytest.approx(0.96)
    assert b["at"]["best"]["failed_on"] == []
    # the best arm carrying no more: no split rate
    tie = gc.binding({"cand": {"1": cand}, "other": {"1": cand}}, "cand", "1", SLO)
    assert tie["at"] is None and tie["failed"]["failed_on"] == ["TPOT"]


def test_merge_unites_samples_and_refuses_another_slo() -> None:
    first = _raw({"cand": [_at(4.0)], "x": [_at(4.0)]})
    second = _raw({"cand": [_at(4.0), _at(8.0)], "x": [_at(4.0), _at(4.0)]})
    second["chatbot/8"]["arms"] = {a: {"2": by["2"]} for a, by in second["chatbot/8"]["arms"].items()}
    merged = gc.merge(first, second)
    assert sorted(merged["chatbot/8"]["arms"]["cand"]) == ["1", "2"]
    assert sorted(first["chatbot/8"]["arms"]["cand"]) == ["1"]  # the inputs are not mutated
    other = _raw({"cand": [_at(4.0)]})
    other["chatbot/8"]["slo"] = {**SLO, "tpot_p99_ms": 51.0}
    with pytest.raises(ValueError, match="SLO"):
        gc.merge(first, other)


def test_a_tiny_real_grid_matches_its_own_probes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap.json"
    args = ["--capacity", "--workloads", "chatbot", "--instances", "2", "--policies", "vllm", "--extra", ""]
    assert main([*args, "--candidate", "lmetric", "--seeds", "1", "--duration", "3", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["mode"] == "capacity" and report["candidate"] == "lmetric"
    cell = report["cells"]["chatbot/2"]
    slo = cell["slo"]
    assert cell["light_rate"] == 0.0625
    # the preset's SLO: 5 × and 10 × the reference's p99s at the light rate
    assert slo["ttft_p99_ms"] == pytest.approx(5 * slo["light_ttft_p99_ms"])
    assert slo["tpot_p99_ms"] == pytest.approx(10 * slo["light_tpot_p99_ms"])
    for arm in ("vllm", "lmetric"):
        search = cell["arms"][arm]["samples"]["1"]
        probes = search["probes"]
        assert probes[0]["rate"] == 0.0625
        for p in probes:
            met = (
                p["unfinished"] == 0
                and p["ttft_p99_ms"] <= slo["ttft_p99_ms"]
                and p["tpot_p99_ms"] <= slo["tpot_p99_ms"]
            )
            assert p["ok"] == met
        assert search["rate"] == max(p["rate"] for p in probes if p["ok"])
        assert search["failed_rate"] == min(p["rate"] for p in probes if not p["ok"])
        assert search["rate"] < search["failed_rate"] <= search["rate"] * STEP * (1 + 1e-9)
        assert cell["arms"][arm]["capacity"] == search["rate"]
    assert main(["--render", str(out), "--candidate", "vllm"]) == 0
    table = capsys.readouterr().out
    assert "| vllm: rank |" in table and f"**×{cell['arms']['vllm']['capacity']:.3g}**" in table
    assert math.isfinite(cell["arms"]["vllm"]["vs"][0])


def test_a_paper_presets_capacity_searches_read_as_a_grid() -> None:
    paper = {
        "plan": {"instances": 16, "workloads": [{"name": "chatbot", "light_rate": 0.5}]},
        "workloads": [
            {
                "name": "chatbot",
                "slo": SLO,
                "capacity": [
                    {"policy": "cand", "seed": 0, **_at(4.0), "extra": 1},
                    {"policy": "x", "seed": 0, **_at(4.0 * STEP)},
                ],
            }
        ],
    }
    raw = gc.raw_of_preset(paper)
    assert list(raw) == ["chatbot/16"] and raw["chatbot/16"]["light_rate"] == 0.5
    assert raw["chatbot/16"]["arms"]["cand"]["0"] == _at(4.0)
    cell = gc.summarize(raw, "cand")["chatbot/16"]
    assert cell["rank"] == 2 and cell["arms"]["x"]["vs"][3] == "lose (one sample)"
    table = gc.render({"candidate": "cand", "cells": {"chatbot/16": cell}})
    assert (
        "| x | ×4.36 (+9 %, lose) |" in table
        and "| cand: lead / tie / lose | 0 / 0 / 1 (one sample) |" in table
    )


def test_an_arm_run_on_fewer_samples_is_paired_on_those() -> None:
    raw = _raw(
        {"cand": [_at(4.0), _at(4.0), _at(4.0)], "x": [_at(4.0 * STEP)], "y": [_at(2.0), _at(2.0), _at(2.0)]}
    )
    cell = gc.summarize(raw, "cand")["chatbot/8"]
    x = cell["arms"]["x"]
    assert x["n"] == 1 and x["vs"][3] == "lose (one sample)" and x["steps"] == [1]
    assert cell["arms"]["y"]["n"] == 3 and cell["arms"]["y"]["vs"][3] == "lead"
    assert cell["rank"] == 2
    assert cell["binding"]["1"]["best_arm"] == "x" and cell["binding"]["2"]["best_arm"] == "y"
    assert "×4.36 (+9 %, lose (one sample))" in gc.render({"candidate": "cand", "cells": {"chatbot/8": cell}})


def test_the_default_candidate_is_the_default_arm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without --candidate, a preset is read against the default's arm (its policy behind the queue)."""
    from kvroute.policies.registry import DEFAULT_POLICY
    from kvroute.sim.compare import DEFAULT_ARM

    caps = {DEFAULT_ARM: 4.0, DEFAULT_POLICY: 4.0 * STEP, "vllm": 4.0}
    paper = {
        "plan": {"instances": 16, "workloads": [{"name": "chatbot", "light_rate": 0.5}]},
        "workloads": [
            {
                "name": "chatbot",
                "slo": SLO,
                "capacity": [{"policy": p, "seed": 0, **_at(r)} for p, r in caps.items()],
            }
        ],
    }
    path = tmp_path / "paper.json"
    path.write_text(json.dumps(paper))
    assert main(["--render", str(path)]) == 0
    table = capsys.readouterr().out
    assert f"| {DEFAULT_ARM} | **×4** |" in table and f"| {DEFAULT_POLICY} | ×4.36 (+9 %, lose) |" in table
