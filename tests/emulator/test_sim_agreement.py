"""Emulation and simulation agree: one workload through `kvroute sim` and through the emulator.

Both run the same engine model with the same cost profile; the emulator under the wall clock. Each
request is sent after the previous one ended (the simulator's arrivals are 1,000 s apart), so the
emulator's batches do not depend on when a loaded machine gets the requests to it: its own TTFT and
inter-token means (its /metrics, model seconds) must equal the simulator's, whatever the load. The
concurrent run and the client's wall-clock view are measured by ``make bench ONLY=sim_agreement``
(benchmarks/bench_sim_agreement.py), not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.bench_sim_agreement import emulate, simulate, workload

from kvroute.tokenizer import Tokenizer


async def test_sim_and_emulator_agree(tmp_path: Path, tokenizer: Tokenizer) -> None:
    rows = workload(spacing_s=1000.0)
    sim = simulate(rows, tmp_path)
    emu = await emulate(rows, tokenizer, concurrent=False)
    # model time: equal up to float rounding (the histograms' sums), however late the requests came
    assert emu["engine_ttft_ms"] == pytest.approx(sim["ttft_ms"]["mean"], rel=1e-3)
    assert emu["engine_itl_ms"] == pytest.approx(sim["tpot_ms"]["mean"], rel=1e-3)
    # the prefix cache saw the same reuse in both worlds
    assert emu["kv_hit_rate"] == pytest.approx(sim["kv_hit_rate"], abs=1e-9)
    assert sim["kv_hit_rate"] > 0.05  # every other request reused the system prompt
