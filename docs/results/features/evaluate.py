"""Evaluation of the production features (docs/results/features.md): runs `kvroute sim` for every
experiment (two at a time), keeps each run's JSON under runs/, and prints the markdown tables.

    .venv/bin/python docs/results/features/evaluate.py            # run what is missing, print tables
    .venv/bin/python docs/results/features/evaluate.py --only e2  # one experiment
    .venv/bin/python docs/results/features/evaluate.py --tables   # tables from the saved runs only
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"
ROOT = HERE.parents[2]

# name -> kvroute sim arguments (without --json / --no-progress)
EXPERIMENTS: dict[str, dict[str, str]] = {
    "e1": {},
    "e1b": {},
    "e2": {},
    "e4": {},
    "e4b": {},
    "e5": {},
    "e5b": {},
}

for seed in (0, 1, 2):
    for tag, flag in (("plain", ""), ("mitigation", " --hotspot-mitigation")):
        EXPERIMENTS["e1"][f"hotspot-s{seed}-{tag}"] = f"--workload hotspot --seed {seed}{flag}"
for wl in ("chatbot", "coder", "api", "agent"):
    dur = "" if wl == "chatbot" else " --duration 600"
    for tag, flag in (("plain", ""), ("mitigation", " --hotspot-mitigation")):
        EXPERIMENTS["e1b"][f"{wl}-{tag}"] = f"--workload {wl}{dur}{flag}"
COLD = {
    "plain": "",
    "admit": " --cold-start",
    "score": " --cold-start --cold-start-cap score",
    "none": " --cold-start --cold-start-cap none",
}
for wl, rate in (("chatbot", 5), ("coder", 2.5)):
    for tag, flag in COLD.items():
        EXPERIMENTS["e2"][f"scaleout-{wl}-{tag}"] = (
            f"--workload {wl} --instances 8 --rate-scale {rate} --duration 400 --scale-out 200:8{flag}"
        )
for wl, rates in (("chatbot", (2, 3, 4, 5, 6)), ("coder", (1, 2, 3))):
    for rate in rates:
        for tag, flag in (
            ("plain", " --score-monitor"),
            ("adaptive", " --score-monitor --load-adaptive 0.5"),
        ):
            EXPERIMENTS["e4"][f"load-{wl}-r{rate}-{tag}"] = (
                f"--workload {wl} --instances 8 --rate-scale {rate} --duration 300{flag}"
            )
# E4b: the lower BS weight applied at every load (threshold 0), and a stronger one
for rate in (3, 4, 5):
    for w in (0.5, 0.25):
        EXPERIMENTS["e4b"][f"load-chatbot-r{rate}-always-w{w}"] = (
            f"--workload chatbot --instances 8 --rate-scale {rate} --duration 300 --score-monitor "
            f"--load-adaptive {w} --load-threshold 0"
        )
for rate in (1, 1.5, 2):
    for tag, flag in (("plain", " --by-class"), ("classes", " --classes")):
        EXPERIMENTS["e5"][f"mixed-r{rate}-{tag}"] = f"--workload mixed --rate-scale {rate}{flag}"


# E5b: stronger class weights
for rate in (1, 2):
    EXPERIMENTS["e5b"][f"mixed-r{rate}-strong"] = (
        f"--workload mixed --rate-scale {rate} --class-weight ttft=0.25 --class-weight tpot=4"
    )
    EXPERIMENTS["e5b"][f"mixed-r{rate}-inverse"] = (
        f"--workload mixed --rate-scale {rate} --class-weight ttft=2 --class-weight tpot=0.5"
    )


def command(args: str) -> str:
    return f"kvroute sim {args}"


def run_one(name: str, args: str) -> None:
    out = RUNS / f"{name}.json"
    if out.exists():
        return
    cmd = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "sim",
        *shlex.split(args),
        "--no-progress",
        "--json",
        str(out),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    print(f"{name}: rc {res.returncode}", file=sys.stderr)
    if res.returncode:
        print(res.stderr, file=sys.stderr)


def load(name: str) -> dict[str, Any]:
    return json.loads((RUNS / f"{name}.json").read_text())


def f1(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def delta(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.0f}%" if a else "n/a"


def lat_row(label: str, d: dict[str, Any]) -> str:
    t, p = d["ttft_ms"], d["tpot_ms"]
    return f"| {label} | {f1(t['mean'])} | {f1(t['p99'])} | {f1(p['mean'])} | {f1(p['p99'])} | {d['kv_hit_rate']:.3f} |"


LAT_HEAD = "| run | TTFT mean | TTFT p99 | TPOT mean | TPOT p99 | KV hit |\n|---|---:|---:|---:|---:|---:|"


def tables_e1() -> None:
    print("### E1: hotspot workload, lmetric vs lmetric + mitigation (16 instances, 300 s)\n")
    print(LAT_HEAD)
    for seed in (0, 1, 2):
        for tag in ("plain", "mitigation"):
            d = load(f"hotspot-s{seed}-{tag}")
            extra = ""
            if tag == "mitigation":
                h = d["features"]["hotspot"]
                extra = f" (alarms {h['alarms']}, mitigations {h['mitigations']}, mitigated {h['mitigated_requests']})"
            print(lat_row(f"seed {seed} {tag}{extra}", d))
    print()
    print("| seed | ΔTTFT mean | ΔTTFT p99 | ΔTPOT mean | ΔTPOT p99 |\n|---|---:|---:|---:|---:|")
    for seed in (0, 1, 2):
        a, b = load(f"hotspot-s{seed}-plain"), load(f"hotspot-s{seed}-mitigation")
        print(
            f"| {seed} | {delta(a['ttft_ms']['mean'], b['ttft_ms']['mean'])} | {delta(a['ttft_ms']['p99'], b['ttft_ms']['p99'])} "
            f"| {delta(a['tpot_ms']['mean'], b['tpot_ms']['mean'])} | {delta(a['tpot_ms']['p99'], b['tpot_ms']['p99'])} |"
        )


def tables_e1b() -> None:
    print("### E1b: the other workloads with and without mitigation (16 instances)\n")
    print(LAT_HEAD)
    for wl in ("chatbot", "coder", "api", "agent"):
        for tag in ("plain", "mitigation"):
            d = load(f"{wl}-{tag}")
            extra = ""
            if tag == "mitigation":
                h = d["features"]["hotspot"]
                extra = f" (alarms {h['alarms']}, mitigated {h['mitigated_requests']} of {d['requests']})"
            print(lat_row(f"{wl} {tag}{extra}", d))
    print()


def tables_e2() -> None:
    print("### E2: TTFT around a scale-out (8 → 16 instances at t = 200 s)\n")
    windows = ((140, 200), (200, 210), (210, 230), (230, 260), (260, 400))
    head = " | ".join(f"[{a}, {b}) s mean / p99" for a, b in windows)
    print(f"| run | {head} | whole run mean / p99 |")
    print("|---|" + "---:|" * (len(windows) + 1))
    for wl in ("chatbot", "coder"):
        for tag in COLD:
            d = load(f"scaleout-{wl}-{tag}")
            cells = []
            for a, b in windows:
                buckets = [x for x in d["ttft_timeline"] if a <= x["start"] < b and x["requests"]]
                n = sum(x["requests"] for x in buckets)
                mean = sum(x["ttft_mean_ms"] * x["requests"] for x in buckets) / n if n else float("nan")
                p99 = max((x["ttft_p99_ms"] for x in buckets), default=float("nan"))
                cells.append(f"{f1(mean)} / {f1(p99)}")
            print(
                f"| {wl} {tag} | "
                + " | ".join(cells)
                + f" | {f1(d['ttft_ms']['mean'])} / {f1(d['ttft_ms']['p99'])} |"
            )
    print("\n(p99 of a window = the largest p99 of its 10-second buckets.)\n")


def tables_e4() -> None:
    print("### E4: load-adaptive weighting (w = 0.5 above 70 % cluster load), 8 instances, 300 s\n")
    print(
        "| workload, rate | mean load | decisions reweighted | TTFT mean plain → adaptive | TTFT p99 | TPOT mean | TPOT p99 |"
    )
    print("|---|---:|---:|---|---|---|---|")
    for wl, rates in (("chatbot", (2, 3, 4, 5, 6)), ("coder", (1, 2, 3))):
        for rate in rates:
            a, b = load(f"load-{wl}-r{rate}-plain"), load(f"load-{wl}-r{rate}-adaptive")
            fb = b["features"]
            share = fb.get("load_reweighted", 0) / max(1, fb["decisions"])
            cells = []
            for m, q in (("ttft_ms", "mean"), ("ttft_ms", "p99"), ("tpot_ms", "mean"), ("tpot_ms", "p99")):
                cells.append(f"{f1(a[m][q])} → {f1(b[m][q])} ({delta(a[m][q], b[m][q])})")
            print(
                f"| {wl} ×{rate} | {fb.get('mean_cluster_load', 0):.2f} | {share:.0%} | "
                + " | ".join(cells)
                + " |"
            )
    print()


def tables_e5() -> None:
    print("### E5: request classes on the mixed workload (16 instances, 300 s)\n")
    print(
        "| rate | run | ttft-class TTFT mean / p99 | ttft-class TPOT mean | tpot-class TPOT mean / p99 | tpot-class TTFT mean |"
    )
    print("|---|---|---|---:|---|---:|")
    for rate in (1, 1.5, 2):
        for tag in ("plain", "classes"):
            d = load(f"mixed-r{rate}-{tag}")
            t, p = d["by_class"]["ttft"], d["by_class"]["tpot"]
            print(
                f"| ×{rate} | {tag} | {f1(t['ttft_ms']['mean'])} / {f1(t['ttft_ms']['p99'])} | {f1(t['tpot_ms']['mean'])} "
                f"| {f1(p['tpot_ms']['mean'])} / {f1(p['tpot_ms']['p99'])} | {f1(p['ttft_ms']['mean'])} |"
            )
    print()


def tables_e4b() -> None:
    print("### E4b: BS^w at every load (threshold 0), chatbot, 8 instances, 300 s\n")
    print("| rate | w | TTFT mean plain → w | TTFT p99 | TPOT mean | TPOT p99 |\n|---|---:|---|---|---|---|")
    for rate in (3, 4, 5):
        a = load(f"load-chatbot-r{rate}-plain")
        for w in (0.5, 0.25):
            b = load(f"load-chatbot-r{rate}-always-w{w}")
            cells = []
            for m, q in (("ttft_ms", "mean"), ("ttft_ms", "p99"), ("tpot_ms", "mean"), ("tpot_ms", "p99")):
                cells.append(f"{f1(a[m][q])} → {f1(b[m][q])} ({delta(a[m][q], b[m][q])})")
            print(f"| ×{rate} | {w} | " + " | ".join(cells) + " |")
    print()


def tables_e5b() -> None:
    print("### E5b: other class weights on the mixed workload\n")
    print("| rate | run | ttft-class TTFT mean / p99 | tpot-class TPOT mean / p99 |\n|---|---|---|---|")
    for rate in (1, 2):
        for tag in ("plain", "classes", "strong", "inverse"):
            d = load(f"mixed-r{rate}-{tag}")
            t, p = d["by_class"]["ttft"], d["by_class"]["tpot"]
            print(
                f"| ×{rate} | {tag} | {f1(t['ttft_ms']['mean'])} / {f1(t['ttft_ms']['p99'])} "
                f"| {f1(p['tpot_ms']['mean'])} / {f1(p['tpot_ms']['p99'])} |"
            )
    print()


TABLES = {
    "e1": tables_e1,
    "e1b": tables_e1b,
    "e2": tables_e2,
    "e4": tables_e4,
    "e4b": tables_e4b,
    "e5": tables_e5,
    "e5b": tables_e5b,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--tables", action="store_true")
    ap.add_argument("--commands", action="store_true", help="print the kvroute sim commands and exit")
    args = ap.parse_args()
    names = args.only or list(EXPERIMENTS)
    jobs = [(n, a) for e in names for n, a in EXPERIMENTS[e].items()]
    if args.commands:
        for n, a in jobs:
            print(f"{n}: {command(a)}")
        return
    RUNS.mkdir(exist_ok=True)
    if not args.tables:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda j: run_one(*j), jobs))
    for e in names:
        if e in TABLES:
            TABLES[e]()


if __name__ == "__main__":
    main()
