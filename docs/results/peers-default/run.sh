#!/usr/bin/env bash
# The peers' LMetric variants at each synthetic workload's default load, and capacity at the paper
# preset's chatbot SLO, with the bound. Usage: bash docs/results/peers-default/run.sh (from any
# directory; about 10 min on 2 free cores), then python docs/results/peers-default/make_table.py.
set -euo pipefail
cd "$(dirname "$0")/../../.."
K=${KVROUTE:-.venv/bin/kvroute}
# default loads = half the vllm saturation rates found by the paper-peers preset's search (60 s arrivals)
for wr in chatbot:5.66 coder:6.73 api:6.73 agent:3.36; do
  w=${wr%%:*}; r=${wr##*:}
  nice -n 5 $K compare --workload $w --instances 16 --duration 60 --rate-scale $r --jobs 2 \
    --policies vllm,lmetric,aibrix-lmetric,llm-d-lmetric,dynamo-lmetric,vllm-router-smetric \
    --out docs/results/peers-default/$w --no-progress > docs/results/peers-default/$w.log 2>&1
  echo "$w done $(date)"
done
# capacity at the full paper preset's chatbot SLO (TTFT p99 ≤ 462 ms, TPOT p99 ≤ 66.1 ms), and the bound
nice -n 5 $K compare --workload chatbot --instances 16 --duration 60 --rate-scale 5.66 --jobs 2 \
  --policies vllm,lmetric,aibrix-lmetric,llm-d-lmetric,dynamo-lmetric,vllm-router-smetric \
  --slo-ttft-ms 462 --slo-tpot-ms 66.1 --out docs/results/peers-default/chatbot-capacity --no-progress \
  > docs/results/peers-default/chatbot-capacity.log 2>&1
echo "chatbot capacity done $(date)"
