#!/usr/bin/env bash
# Replays the first after-run's kvroute traffic (../trace.jsonl) through the simulator with exact,
# current views, once per policy, and prints the table of docs/results/ray-serve.md.
# Usage: bash docs/results/ray-serve/sim/run.sh   (from the repository root; about 3 s)
set -euo pipefail
here=docs/results/ray-serve/sim
kvroute=${KVROUTE:-.venv/bin/kvroute}
policies="lmetric lmetric-kv llm-d dynamo sglang aibrix vllm p2c lmetric:0.5 lmetric:0.25 lmetric:0 aibrix-lmetric llm-d-lmetric dynamo-lmetric"
for p in $policies; do
  "$kvroute" sim --trace docs/results/ray-serve/trace.jsonl --instances 2 --kv-tokens 16384 \
    --policy "$p" --json "$here/${p/:/-w}.json" > /dev/null
done
python3 - "$here" $policies <<'PY'
import json, sys
here, *policies = sys.argv[1:]
print("| policy | KV hit rate | TTFT mean (ms) | TTFT p99 (ms) | TPOT p99 (ms) | E2E mean (ms) |")
print("|---|---:|---:|---:|---:|---:|")
for p in policies:
    s = json.load(open(f"{here}/{p.replace(':', '-w')}.json"))
    s = s.get("summary", s)
    print(f"| `{p}` | {s['kv_hit_rate']:.3f} | {s['ttft_ms']['mean']:.1f} | {s['ttft_ms']['p99']:.1f} "
          f"| {s['tpot_ms']['p99']:.1f} | {s['e2e_ms']['mean']:.0f} |")
PY
