"""Proxy overhead and capacity: direct to one engine vs kvroute vs sglang-router, in one run.

Setup (all on loopback, all processes on this machine's cores): 4 emulated engines (``kvroute
engine`` subprocesses, time scale 1000 so that modelled compute is ~negligible, KV events on); a
``kvroute serve`` subprocess (lmetric, exact KV view from the engines' events, default
``--tokenize exact``), a second one with ``--tokenize defer`` (path ``kvroute-defer``: new text
tokenized after the request is sent); an ``sglang-router`` subprocess (pip ``sglang-router``, ``--policy
cache_aware``) over the same 4 engines. The load generator is this process (``kvroute.loadgen``,
open loop, every response streamed).

Workload: the ``chatbot`` synthetic workload's prompts (block ids → stable synthetic text), outputs
cut to ``OUTPUT_TOKENS`` tokens so that the run measures the proxies, not token generation:

1. **Latency** at a light load (``LAT_RATE`` req/s for ``LAT_REQUESTS`` requests) on each path: client
   TTFT p50/p99; *added TTFT* = path − direct (same requests, same order). The requests go in
   ``ROUNDS`` rounds, every path in turn within a round, so that slow drifts of this shared machine
   fall on all paths alike.
   On a machine with 2+ CPUs the latency phase runs a second time with the engines pinned apart: the
   router under test and the load generator on the last CPU, the engines and the idle routers on the
   others (affinity set on every thread): *added TTFT, engines pinned apart*. In production the
   engines' CPUs are not the router's; on a 2-core machine the shared phase mostly measures the router
   queueing behind the engines for a core. The router shares its core with the client rather than
   having one alone, so that its work stays on the measured path instead of overlapping the client's.
   sglang-router gets the same treatment.
2. **Capacity**: offered rates from ``RATES`` (req/s, constant spacing, ``STEP_S`` seconds each) until
   a step fails; a step is sustained when every request finishes and the last one finishes within
   ``DRAIN_S`` seconds after the last arrival. Reported: the highest sustained rate.
3. **Routing stages**: each kvroute router's mean wall time per request in parse, split, tokenize,
   hash and plan (its ``kvroute_routing_stage_seconds`` on /metrics), over both phases.
4. **Router CPU per request**: the router process's user+system CPU time (``/proc/PID/stat``) during
   its own phases (latency and capacity) / requests it served there, milliseconds. Background work
   (health checks, /metrics scrapes, KV events of *all* engine traffic) is included; the idle CPU of
   each router (ms per second, no traffic at all) is reported separately, and so is the CPU per
   request in the highest sustained capacity step, where the background work weighs least.

Writes ``benchmarks/results/proxy.json``. Skips (returns 0 with a note) if sglang-router is not
installed (``pip install -e '.[bench]'``); kvroute and direct are still measured then.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.loadgen import BlockText, run_bench
from kvroute.loadgen.runner import BenchResult, fetch_model
from kvroute.server.cluster import EngineCluster, free_port
from kvroute.tokenizer import load_tokenizer
from kvroute.workloads import make_workload
from kvroute.workloads.request import Request

RESULTS = Path(__file__).resolve().parent / "results"
INSTANCES = 4
TIME_SCALE = 1000.0
OUTPUT_TOKENS = 4
MAX_PROMPT_TOKENS = 2048
LAT_RATE = 20.0
LAT_REQUESTS = 200
ROUNDS = 5
RATES = (25, 50, 100, 200, 400, 700, 1000, 1400)
STEP_S = 3.0
DRAIN_S = 2.0
IDLE_S = 3.0
TARGET_ADDED_P50_MS = 1.0
TARGET_RPS = 1000.0


def _requests(n: int, rate: float, seed: int) -> list[Request]:
    """``n`` chatbot prompts (capped at MAX_PROMPT_TOKENS), re-timed to a constant ``rate``."""
    out = []
    for i, r in enumerate(make_workload("chatbot", seed=seed, rate_scale=8.0, duration=3600.0)):
        if i >= n:
            break
        blocks = r.block_ids[: MAX_PROMPT_TOKENS // r.block_size]
        plen = min(r.prompt_len, MAX_PROMPT_TOKENS)
        out.append(
            dataclasses.replace(
                r, req_id=i, arrival=i / rate, prompt_len=plen, block_ids=blocks, output_len=OUTPUT_TOKENS
            )
        )
    return out


def _merge(into: BenchResult, res: BenchResult) -> None:
    into.requests += res.requests
    into.unfinished += res.unfinished
    for k, v in res.errors.items():
        into.errors[k] = into.errors.get(k, 0) + v
    into.recorder.merge(res.recorder)


def _pin(pid: int, cpus: set[int]) -> None:
    """Set the CPU affinity of every thread of process ``pid`` (on Linux affinity is per thread, and
    threads started later inherit it from the thread that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError, PermissionError):
            os.sched_setaffinity(int(tid), cpus)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _wait_http(url: str, path: str, timeout_s: float = 60.0) -> None:
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                async with s.get(url + path) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}{path} did not come up")


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _capacity(
    url: str, text: BlockText, model: str, pid: int | None
) -> tuple[float, list[dict[str, Any]]]:
    """Offered rates until one is not sustained; ``pid``: the router's process, whose CPU time per
    request is recorded for each step."""
    best = 0.0
    steps = []
    for rate in RATES:
        reqs = _requests(int(rate * STEP_S), float(rate), seed=rate)
        c0 = _cpu_seconds(pid) if pid is not None else 0.0
        res = await run_bench(url, reqs, text, model, drain_timeout_s=30.0)
        cpu_ms = 1000.0 * (_cpu_seconds(pid) - c0) / max(res.requests, 1) if pid is not None else None
        finished = res.requests - res.unfinished
        ok = res.unfinished == 0 and res.wall_seconds <= reqs[-1].arrival + DRAIN_S
        steps.append(
            {
                "offered_rps": rate,
                "finished": finished,
                "requests": res.requests,
                "wall_s": round(res.wall_seconds, 3),
                "sustained": ok,
                "ttft_p50_ms": res.recorder.summary()["ttft_ms"]["p50"],
                "router_cpu_ms_per_request": cpu_ms,
            }
        )
        print(
            f"    {rate:5d} req/s offered: {finished}/{res.requests} in {res.wall_seconds:.2f} s "
            f"-> {'sustained' if ok else 'NOT sustained'}",
            flush=True,
        )
        if not ok:
            break
        best = float(rate)
        await asyncio.sleep(0.5)
    return best, steps


async def _measure() -> dict[str, Any]:
    tok = load_tokenizer()
    text = BlockText(tok)
    cluster = EngineCluster(
        INSTANCES, ["--time-scale", str(TIME_SCALE), "--kv-blocks", "65536"], kv_events=True
    )
    backends = await cluster.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls = {"direct": backends[0].url}
    try:
        port = free_port()
        cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--policy", "lmetric"]
        for b in backends:
            cmd += ["--backend", b.url, "--kv-events", f"{b.url}={b.kv_events}"]
        procs["kvroute"] = _spawn(cmd)
        urls["kvroute"] = f"http://127.0.0.1:{port}"
        port = free_port()
        cmd = [*cmd[:4], "--port", str(port), *cmd[6:], "--tokenize", "defer"]
        procs["kvroute-defer"] = _spawn(cmd)
        urls["kvroute-defer"] = f"http://127.0.0.1:{port}"
        sglang = shutil.which("sglang-router") is not None or _has_module("sglang_router")
        if sglang:
            sport = free_port()
            procs["sglang-router"] = _spawn(
                [
                    sys.executable,
                    "-m",
                    "sglang_router.launch_router",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(sport),
                    "--policy",
                    "cache_aware",
                    "--log-level",
                    "error",
                    "--worker-urls",
                    *[b.url for b in backends],
                ]
            )
            urls["sglang-router"] = f"http://127.0.0.1:{sport}"
        for name, url in urls.items():
            await _wait_http(url, "/v1/models" if name == "sglang-router" else "/health")
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as session:
            model = await fetch_model(session, backends[0].url)  # sglang-router lists "unknown"
        out: dict[str, Any] = {"paths": {name: {} for name in urls}}
        idle0 = {n: _cpu_seconds(p.pid) for n, p in procs.items()}
        await asyncio.sleep(IDLE_S)
        for name, p in procs.items():
            out["paths"][name]["router_idle_cpu_ms_per_s"] = (
                1000.0 * (_cpu_seconds(p.pid) - idle0[name]) / IDLE_S
            )
        lat_reqs = _requests(LAT_REQUESTS, LAT_RATE, seed=7)
        cpu = dict.fromkeys(procs, 0.0)
        served = dict.fromkeys(procs, 0)
        routers = {p.pid for p in procs.values()}
        everyone = [os.getpid(), *(e.proc.pid for e in cluster.engines), *routers]
        all_cpus = sorted(os.sched_getaffinity(0))
        phases = ["latency"] + (["latency_pinned"] if len(all_cpus) >= 2 else [])
        for phase in phases:
            for url in urls.values():  # warm-up (connections, caches)
                await run_bench(url, _requests(20, 50.0, seed=99), text, model)
            merged = {name: BenchResult() for name in urls}
            per = LAT_REQUESTS // ROUNDS
            print(
                f"  {phase}: {LAT_REQUESTS} requests per path at {LAT_RATE:.0f} req/s, {ROUNDS} rounds",
                flush=True,
            )
            for r in range(ROUNDS):
                part = lat_reqs[r * per : (r + 1) * per]
                part = [dataclasses.replace(q, arrival=q.arrival - part[0].arrival) for q in part]
                for name, url in urls.items():
                    if phase == "latency_pinned":  # the router under test and this process on the last CPU
                        near = {os.getpid(), procs[name].pid} if name in procs else {os.getpid()}
                        for pid in everyone:
                            _pin(pid, {all_cpus[-1]} if pid in near else set(all_cpus[:-1]))
                    c0 = _cpu_seconds(procs[name].pid) if name in procs else 0.0
                    res = await run_bench(url, part, text, model)
                    _merge(merged[name], res)
                    if name in procs:
                        cpu[name] += _cpu_seconds(procs[name].pid) - c0
                        served[name] += res.requests
            for name, res in merged.items():
                s = res.summary(name, INSTANCES if name != "direct" else 1)
                out["paths"][name][phase] = {
                    k: s[k] for k in ("requests", "unfinished", "ttft_ms", "e2e_ms", "kv_hit_rate")
                }
        for pid in everyone:
            _pin(pid, set(all_cpus))
        for name, url in urls.items():
            print(f"  capacity: {name}", flush=True)
            c0 = _cpu_seconds(procs[name].pid) if name in procs else 0.0
            best, steps = await _capacity(url, text, model, procs[name].pid if name in procs else None)
            out["paths"][name]["max_sustained_rps"] = best
            out["paths"][name]["capacity_steps"] = steps
            top = [st for st in steps if st["sustained"] and st["offered_rps"] == best]
            if name in procs and top:
                out["paths"][name]["router_cpu_ms_per_request_at_max"] = top[0]["router_cpu_ms_per_request"]
            if name in procs:
                cpu[name] += _cpu_seconds(procs[name].pid) - c0
                served[name] += sum(st["requests"] for st in steps)
        for name in procs:
            out["paths"][name]["router_cpu_ms_per_request"] = 1000.0 * cpu[name] / max(served[name], 1)
            if name.startswith("kvroute"):
                out["paths"][name]["routing_stage_us_mean"] = await _stage_means(urls[name])
        for phase, key in (("latency", "added_ttft_ms"), ("latency_pinned", "added_ttft_pinned_ms")):
            if phase not in phases:
                continue
            direct = out["paths"]["direct"][phase]["ttft_ms"]
            for name in procs:
                lat = out["paths"][name][phase]["ttft_ms"]
                out["paths"][name][key] = {q: lat[q] - direct[q] for q in ("p50", "p99")}
        out["sglang_router"] = "measured" if sglang else "not installed (pip install -e '.[bench]')"
        return out
    finally:
        for p in procs.values():
            _stop(p)
        cluster.stop()


async def _stage_means(url: str) -> dict[str, float]:
    """Mean wall time per routed request of each routing stage, from the router's /metrics (µs)."""
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    stages: dict[str, float] = {}
    routed = 0.0
    for line in text.splitlines():
        if line.startswith("kvroute_routing_stage_seconds_total{"):
            stages[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith("kvroute_routed_total "):
            routed = float(line.split()[-1])
    return {k: 1e6 * v / max(routed, 1.0) for k, v in stages.items()}


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def main() -> int:
    t0 = time.perf_counter()
    try:
        import uvloop

        out = uvloop.run(_measure())
    except ImportError:
        out = asyncio.run(_measure())
    paths = out["paths"]
    k = paths["kvroute"]
    out.update(
        {
            "setup": {
                "instances": INSTANCES,
                "time_scale": TIME_SCALE,
                "output_tokens": OUTPUT_TOKENS,
                "max_prompt_tokens": MAX_PROMPT_TOKENS,
                "latency_rate_rps": LAT_RATE,
                "latency_requests": LAT_REQUESTS,
                "capacity_rates": list(RATES),
                "step_s": STEP_S,
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
            },
            "targets": {"added_ttft_p50_ms": TARGET_ADDED_P50_MS, "min_streamed_rps": TARGET_RPS},
            "meets": {
                "added_ttft_p50": k["added_ttft_ms"]["p50"] <= TARGET_ADDED_P50_MS,
                "not_worse_than_sglang": (
                    "sglang-router" not in paths
                    or k["added_ttft_ms"]["p50"] <= paths["sglang-router"]["added_ttft_ms"]["p50"]
                ),
                "rps": k["max_sustained_rps"] >= TARGET_RPS,
            },
            "meets_engines_pinned_apart": None
            if "added_ttft_pinned_ms" not in k
            else {
                "added_ttft_p50": k["added_ttft_pinned_ms"]["p50"] <= TARGET_ADDED_P50_MS,
                "not_worse_than_sglang": (
                    "sglang-router" not in paths
                    or k["added_ttft_pinned_ms"]["p50"]
                    <= paths["sglang-router"]["added_ttft_pinned_ms"]["p50"]
                ),
            },
            "wall_seconds": time.perf_counter() - t0,
        }
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "proxy.json").write_text(json.dumps(out, indent=2) + "\n")
    print(
        "\n| path | TTFT p50 (ms) | TTFT p99 (ms) | added p50 (ms) | added p99 (ms) "
        "| added p50, engines pinned apart (ms) | max req/s | CPU ms/req | CPU ms/req at max req/s "
        "| idle CPU ms/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, p in paths.items():
        lat = p["latency"]["ttft_ms"]
        add = p.get("added_ttft_ms", {"p50": 0.0, "p99": 0.0})
        own = p.get("added_ttft_pinned_ms", {"p50": 0.0} if "latency_pinned" in p else None)
        cpu = p.get("router_cpu_ms_per_request")
        at_max = p.get("router_cpu_ms_per_request_at_max")
        idle = p.get("router_idle_cpu_ms_per_s")
        print(
            f"| {name} | {lat['p50']:.2f} | {lat['p99']:.2f} | {add['p50']:+.2f} | {add['p99']:+.2f} | "
            f"{'-' if own is None else format(own['p50'], '+.2f')} | "
            f"{p['max_sustained_rps']:.0f} | {'-' if cpu is None else f'{cpu:.2f}'} | "
            f"{'-' if at_max is None else f'{at_max:.2f}'} | "
            f"{'-' if idle is None else f'{idle:.0f}'} |"
        )
    for name, p in paths.items():
        if "routing_stage_us_mean" in p:
            stages = ", ".join(f"{k} {v:.0f}" for k, v in p["routing_stage_us_mean"].items())
            print(f"{name}: routing stages, mean µs per request over both phases: {stages}")
    print(
        f"\ntargets: added TTFT p50 <= {TARGET_ADDED_P50_MS} ms and <= sglang-router's; "
        f">= {TARGET_RPS:.0f} streamed req/s -> {out['meets']}; engines pinned apart: "
        f"{out['meets_engines_pinned_apart']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
