"""Emulation and simulation agree on the wall clock: one workload through `kvroute sim` and through
the emulated engine at time scale 1 (real time), concurrent requests over HTTP.

Both run the same engine model with the same cost profile. Reported: the simulator's mean TTFT and
TPOT; the emulator's own (its /metrics histograms, model seconds); a streaming client's (TTFT = first
token − send, TPOT = (last − first) / (tokens − 1)); each as a ratio to the simulator's, with the
targets (engine within 10 %, client within 25 %) and the load average. On a loaded machine the
client's requests reach the engine late, which changes the batches: that is why this is a benchmark
and the unit test (tests/emulator/test_sim_agreement.py) compares a sequential run, whose model-time
figures do not depend on the machine's load. Writes ``benchmarks/results/sim_agreement.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from kvroute.cli import main as cli_main
from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine.cost import get_profile
from kvroute.engine.types import EngineConfig
from kvroute.tokenizer import Tokenizer, load_tokenizer

PROFILE = "design-a100-qwen30b"  # 15 ms per decoding sequence per step, 42.3 µs per prefill token
KV_TOKENS = 16 * 4096


def workload(spacing_s: float = 0.3) -> list[dict[str, Any]]:
    """Ten requests, every other one sharing a 1,024-token system prompt, ``spacing_s`` apart."""
    rng = random.Random(7)
    system = [rng.randrange(1000, 100000) for _ in range(1024)]
    rows = []
    for i in range(10):
        own = [rng.randrange(1000, 100000) for _ in range(rng.randrange(2000, 5000))]
        prompt = (system + own) if i % 2 == 0 else own
        rows.append({"timestamp": spacing_s * i, "prompt_token_ids": prompt, "output_len": 12 + (i % 3) * 4})
    return rows


def simulate(rows: list[dict[str, Any]], folder: Path) -> dict[str, Any]:
    """``kvroute sim`` of ``rows`` on one instance: its JSON summary."""
    trace = folder / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = folder / "sim.json"
    argv = ["sim", "--trace", str(trace), "--format", "jsonl", "--instances", "1", "--profile", PROFILE]
    argv += ["--kv-tokens", str(KV_TOKENS), "--json", str(out), "--no-progress"]
    if cli_main(argv) != 0:
        raise RuntimeError("kvroute sim failed")
    sim: dict[str, Any] = json.loads(out.read_text())
    if sim["requests"] != len(rows) or sim["unfinished"] != 0:
        raise RuntimeError(f"sim finished {sim['requests']} of {len(rows)} requests")
    return sim


async def _one(
    session: aiohttp.ClientSession, url: str, row: dict[str, Any], t0: float | None
) -> tuple[float, float]:
    """One streamed request (at ``t0`` + its timestamp, or now when ``t0`` is None): the client's TTFT
    and TPOT in seconds."""
    body = orjson.dumps({"prompt": row["prompt_token_ids"], "max_tokens": row["output_len"], "stream": True})
    if t0 is not None:
        await asyncio.sleep(max(0.0, t0 + row["timestamp"] - time.perf_counter()))
    sent = time.perf_counter()
    first = last = -1.0
    n = 0
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise RuntimeError(f"emulator answered {r.status}")
        async for line in r.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                first = now if first < 0 else first
                last = now
                n += 1
    if n != row["output_len"]:
        raise RuntimeError(f"{n} tokens streamed, {row['output_len']} asked")
    return first - sent, (last - first) / (n - 1)


def _means(text: str) -> dict[str, float]:
    """Mean of each histogram (sum / count over all label sets) in a Prometheus text page."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.type != "histogram":
            continue
        total = sum(s.value for s in fam.samples if s.name.endswith("_sum"))
        count = sum(s.value for s in fam.samples if s.name.endswith("_count"))
        if count:
            out[fam.name] = total / count
    return out


async def emulate(rows: list[dict[str, Any]], tokenizer: Tokenizer, concurrent: bool) -> dict[str, float]:
    """``rows`` through an emulated engine at time scale 1 over HTTP: at their timestamps
    (``concurrent``) or each after the previous one ended. Milliseconds: the engine's mean TTFT and
    inter-token latency (model time), the client's mean TTFT and TPOT (wall time), and the share of
    prompt tokens served from the prefix cache."""
    cfg = EngineConfig(num_kv_blocks=KV_TOKENS // 16, max_model_len=KV_TOKENS, report_tokens=True)
    server = EmulatorServer(EmulatorSettings("m", cfg, 1.0), get_profile(PROFILE).cost, tokenizer)
    await server.start("127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.port}/v1/completions"
        async with aiohttp.ClientSession() as session:
            if concurrent:
                t0 = time.perf_counter()
                results = await asyncio.gather(*(_one(session, url, r, t0) for r in rows))
            else:
                results = [await _one(session, url, r, None) for r in rows]
            async with session.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                metrics = _means(await r.text())
        hits = server.model.stats().prefix_hit_tokens
    finally:
        await server.stop()
    return {
        "engine_ttft_ms": 1000 * metrics["vllm:time_to_first_token_seconds"],
        "engine_itl_ms": 1000 * metrics["vllm:inter_token_latency_seconds"],
        "client_ttft_ms": 1000 * sum(r[0] for r in results) / len(results),
        "client_tpot_ms": 1000 * sum(r[1] for r in results) / len(results),
        "kv_hit_rate": hits / sum(len(r["prompt_token_ids"]) for r in rows),
    }


def main() -> int:
    from benchmarks.common import table, write

    rows = workload()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as folder:
        sim = simulate(rows, Path(folder))
    emu = asyncio.run(emulate(rows, load_tokenizer(), concurrent=True))
    ratios = {
        "engine_ttft": emu["engine_ttft_ms"] / sim["ttft_ms"]["mean"],
        "engine_itl": emu["engine_itl_ms"] / sim["tpot_ms"]["mean"],
        "client_ttft": emu["client_ttft_ms"] / sim["ttft_ms"]["mean"],
        "client_tpot": emu["client_tpot_ms"] / sim["tpot_ms"]["mean"],
    }
    targets = {"engine_ttft": 0.10, "engine_itl": 0.10, "client_ttft": 0.25, "client_tpot": 0.25}
    within = {k: abs(ratios[k] - 1) <= targets[k] for k in ratios}
    table(
        [(k, f"{ratios[k]:.3f}", f"1 ± {targets[k]:.2f}") for k in ratios]
        + [("kv_hit_rate (emulator / sim)", f"{emu['kv_hit_rate']:.3f} / {sim['kv_hit_rate']:.3f}", "equal")],
        ("emulator / simulator", "ratio", "target"),
    )
    write(
        "sim_agreement.json",
        {
            "what": "one workload (10 concurrent requests, 0.3 s apart) through kvroute sim and the emulated "
            "engine at time scale 1; means in ms",
            "sim": {
                "ttft_ms": sim["ttft_ms"]["mean"],
                "tpot_ms": sim["tpot_ms"]["mean"],
                "kv_hit_rate": sim["kv_hit_rate"],
            },
            "emulator": emu,
            "ratios": ratios,
            "targets": targets,
            "within": within,
            "loadavg_1m_before": load_before,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
