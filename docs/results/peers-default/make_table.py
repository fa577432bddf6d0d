"""The peers' LMetric variants beside kvroute's lmetric at each workload's default load, and the bound.

Reads the ``results.json`` that ``run.sh`` (plain ``kvroute compare`` per workload) wrote next to this
file and writes ``table.md``: per workload and policy the mean and p99 TTFT, mean TPOT and KV hit rate,
the change of mean TTFT against ``lmetric``, and the bound's mean TTFT (docs/results/bound.md).
Run: ``python docs/results/peers-default/make_table.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOADS = ("chatbot", "coder", "api", "agent")


def main() -> None:
    lines = [
        "| workload (rate, requests) | policy | TTFT mean (ms) | vs lmetric | TTFT p99 (ms) | TPOT mean (ms) | KV hit rate |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    notes = []
    for w in WORKLOADS:
        path = HERE / w / "results.json"
        if not path.is_file():
            continue
        res = json.loads(path.read_text())
        runs = {r["policy"]: r for r in res["runs"]}
        ref = runs["lmetric"]["ttft_ms"]["mean"]
        first = next(iter(runs.values()))
        head = f"{w} (×{first['rate_scale']:g}, {first['requests']:,})"
        for p, r in runs.items():
            t = r["ttft_ms"]
            rel = "—" if p == "lmetric" else f"{100.0 * (t['mean'] / ref - 1.0):+.1f} %"
            lines.append(
                f"| {head} | {p} | {t['mean']:.1f} | {rel} | {t['p99']:.1f} | {r['tpot_ms']['mean']:.2f} | "
                f"{r['kv_hit_rate']:.3f} |"
            )
            head = ""
        b = res.get("bound")
        if b:
            at = b["rates"][0]
            notes.append(
                f"- {w}: mean TTFT ≥ {at['ttft_mean_ms']:.1f} ms, TTFT p99 ≥ {at['ttft_floor_p99_ms']:.1f} ms, "
                f"oracle KV hit rate {at['oracle_kv_hit_rate']:.3f} (engine peak "
                f"{b['engine']['peak_tokens_per_s']:,.0f} tokens/s)."
            )
    out = "\n".join(lines) + "\n\nThe bound at the same load (no router beats it; docs/results/bound.md):\n\n"
    out += "\n".join(notes) + "\n"
    (HERE / "table.md").write_text(out)
    print(out)


if __name__ == "__main__":
    main()
