"""Derive the compact profile tables shipped in ``src/kvroute/engine/profiles/`` from the raw CSVs.

Usage: ``python scripts/derive_profiles.py [SHARED_DIR]`` (default: ``../shared`` next to the repo root).

What it does, exactly (the only transformation is regrouping, summing and rounding; no fitting):

1. ``qwen3-30b-a3b-rtxpro6000-tp1.json`` ← ``profiles/llmservingsim/profiler/perf/RTXPRO6000/Qwen/
   Qwen3-30B-A3B-Instruct-2507/bf16`` read by ``kvroute.engine.cost.read_profile_dir(dir, tp=1)``:
   per-layer dense = 2×layernorm + qkv_proj + qk_norm + rotary_emb + o_proj summed on the union token grid
   (linear interpolation where one op lacks a point); per-step dense = embedding + final_layernorm;
   per-sequence = lm_head + sampler; attention.csv grouped into (prefill_chunk, n_decode) slices, every row
   kept; moe.csv rows kept. Times rounded to 0.001 µs.
2. ``llama31-8b-h100-tp1.json`` ← ``profiles/llmservingsim/profiler/v0/perf_models/H100/meta-llama/
   Llama-3.1-8B/tp1/layers.csv`` read by ``read_v0_layers_csv``: latency(ns) → µs; per-layer = input_layernorm
   + q/k/v_proj + rope + attn (kv=0) + o_proj + post_layernorm + gate/up/down_proj + act_fn; per-step =
   embedding + final_layernorm; per-sequence = lm_head; token grid thinned to 1..16 and multiples of 16.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvroute.engine.cost import read_profile_dir, read_v0_layers_csv, tables_to_json

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "src" / "kvroute" / "engine" / "profiles"
QWEN = "profiles/llmservingsim/profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16"
LLAMA = "profiles/llmservingsim/profiler/v0/perf_models/H100/meta-llama/Llama-3.1-8B/tp1/layers.csv"


def _write(name: str, data: dict[str, object], source: str) -> None:
    data = {**data, "source": source}
    path = OUT / name
    path.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{path.relative_to(REPO)}: {path.stat().st_size / 1024:.0f} KiB")


def main(argv: list[str]) -> int:
    shared = Path(argv[1]) if len(argv) > 1 else REPO.parent / "shared"
    qwen = read_profile_dir(shared / QWEN, tp=1)
    _write("qwen3-30b-a3b-rtxpro6000-tp1.json", tables_to_json(qwen), f"LLMServingSim 5daddb2: {QWEN}/tp1")
    llama = read_v0_layers_csv(shared / LLAMA, sample=lambda n: n <= 16 or n % 16 == 0)
    _write("llama31-8b-h100-tp1.json", tables_to_json(llama), f"LLMServingSim 5daddb2: {LLAMA}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
