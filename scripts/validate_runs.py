"""Validate the engine model on every real vLLM run in ``../shared``; write JSON per run and a table.

Usage: ``python scripts/validate_runs.py [SHARED_DIR] [--out DIR]`` (defaults: ``../shared`` next to the
repo root, ``docs/results/validate``). Needs ``kvroute`` importable (``PYTHONPATH=src``).

Every run folder under ``profiles/llmservingsim/bench`` (a folder holding ``vllm/meta.json``) must have an
entry in :data:`PLAN` (the profile it is replayed with), and every entry a run: the script stops with an
error otherwise, so the committed results cover each real run. For each it runs
``kvroute validate --bench RUN <profile flags> --json OUT/<hardware>-<model>.json`` and then writes
``OUT/README.md``: the command lines and a table of measured vs simulated TTFT/TPOT/e2e means and p99s.
The replay is deterministic (no random numbers; a rerun writes identical JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from kvroute.cli import main as kvroute

REPO = Path(__file__).resolve().parents[1]
BENCH = "profiles/llmservingsim/bench"
PERF = "profiles/llmservingsim/profiler/perf"
PACKAGED = "src/kvroute/engine/profiles"

# Run folder (relative to BENCH) → profile flags, relative paths under {shared} or the repo root. Why each:
PLAN: dict[str, list[str]] = {
    # the v1 profile of the same model on the same GPU; its HF config is the packaged one
    "examples/RTXPRO6000/Qwen3-30B-A3B-Instruct-2507": [
        "--profile-dir",
        f"{{shared}}/{PERF}/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16",
        "--model-config",
        f"{PACKAGED}/qwen3-30b-a3b-instruct-2507.config.json",
    ],
    # ../shared has no RTX PRO 6000 profile of Llama-3.1-8B (upstream's was not copied): the only
    # Llama-3.1-8B profile is the packaged H100 one (v0 tables + roofline attention), so this row measures
    # the model plus the H100 → RTX PRO 6000 hardware difference, not the model alone.
    "examples/RTXPRO6000/Llama-3.1-8B": ["--profile", "llama31-8b-h100-tp1"],
}


def discover(bench_root: Path) -> list[str]:
    return sorted(str(p.parent.parent.relative_to(bench_root)) for p in bench_root.rglob("vllm/meta.json"))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shared", nargs="?", default=str(REPO.parent / "shared"))
    ap.add_argument("--out", default=str(REPO / "docs" / "results" / "validate"))
    args = ap.parse_args(argv[1:])
    out = Path(args.out).resolve()
    os.chdir(REPO)  # paths in the commands and the JSON relative to the repo root: the same on any machine
    shared = Path(os.path.relpath(Path(args.shared).resolve(), REPO))
    runs = discover(shared / BENCH)
    if not runs:
        print(f"no bench runs under {shared / BENCH}", file=sys.stderr)
        return 2
    unplanned = [r for r in runs if r not in PLAN]
    missing = [r for r in PLAN if r not in runs]
    if unplanned or missing:
        print(
            f"PLAN out of date: runs without an entry {unplanned}, entries without a run {missing}",
            file=sys.stderr,
        )
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rows, commands = [], []
    for run in runs:
        flags = [f.format(shared=shared) for f in PLAN[run]]
        stem = run.split("/", 1)[-1].replace("/", "-")
        path = Path(os.path.relpath(out / f"{stem}.json", REPO))
        argv_v = ["validate", "--bench", str(shared / BENCH / run), *flags, "--json", str(path)]
        commands.append("kvroute " + " ".join(argv_v))
        if kvroute(argv_v) != 0:
            return 1
        data = json.loads(path.read_text())
        rows.append((stem, data))
    lines = [
        "# `kvroute validate` on every real vLLM run in `../shared`",
        "",
        f"Written by `python scripts/validate_runs.py` on {platform.machine()} "
        f"({platform.system()}, Python {platform.python_version()}). The replay is deterministic: a rerun "
        "on any machine gives the same figures (no random numbers; wall time is not measured).",
        "Measured = the vLLM 0.19 run's own timestamps (300 ShareGPT-derived requests at ~10 req/s);",
        "simulated = the engine model replaying the same arrivals and lengths. Means and p99 in ms; error =",
        "(simulated − measured) / measured.",
        "",
        "| run | GPU (run / profile) | dp / tp / ep | TTFT mean: measured, simulated, error | TTFT p99 error "
        "| TPOT mean: measured, simulated, error | TPOT p99 error | e2e mean: measured, simulated, error |",
        "|---|---|---|---|---:|---|---:|---|",
    ]
    for stem, d in rows:
        r, m, s, e = d["run"], d["measured"], d["simulated"], d["error_pct"]

        def mean(k: str, m: dict = m, s: dict = s, e: dict = e) -> str:
            return f"{m[k]['mean']:,.1f} · {s[k]['mean']:,.1f} · **{e[k]['mean']:+.1f} %**"

        lines.append(
            f"| {stem} ({r['model']}) | {r['run_hardware']} / {r['profile_hardware']} "
            f"| {r['dp']} / {r['tp']} / {r['ep']} | {mean('ttft_ms')} | {e['ttft_ms']['p99']:+.1f} % "
            f"| {mean('tpot_ms')} | {e['tpot_ms']['p99']:+.1f} % | {mean('e2e_ms')} |"
        )
    lines += ["", "Profiles (`profile` in each JSON):", ""]
    lines += [f"- {stem}: `{d['run']['profile']}` — {d['run']['profile_source']}" for stem, d in rows]
    lines += ["", "Commands:", "", "```sh", *commands, "```", ""]
    (out / "README.md").write_text("\n".join(lines))
    print((out / "README.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
