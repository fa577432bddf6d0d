"""kvroute side by side with the Rust routers, in front of the same emulated engines.

Setup (all on loopback, all processes on this machine's cores): 4 emulated engines (``kvroute
engine`` subprocesses, time scale 1000 so that modelled compute is negligible, 65,536 blocks of 16
tokens, KV events on ZMQ in vLLM's map encoding); five paths to them, all started before the first
request and all running for the whole run:

- ``kvroute``: ``kvroute serve --policy lmetric`` with each engine's KV events (exact KV view) and
  the default ``--tokenize exact``;
- ``sglang-router``: pip ``sglang-router``, ``--policy cache_aware`` (its approximate radix tree over
  request text);
- ``vllm-router cache_aware``: pip ``vllm-router``, ``--policy cache_aware`` (the same family);
- ``vllm-router kv_aware``: pip ``vllm-router``, ``--policy kv_aware`` with ``--kv-event-source`` for
  each engine and ``--kv-event-block-size 16`` (it gets each prompt's token ids from the engines'
  ``/v1/chat/completions/render``);
- ``direct``: no router; the client sends each conversation to engine ``system prompt id mod 4``
  (perfect affinity by hand: the floor for TTFT, the ceiling for hits).

Workload (:mod:`kvroute.loadgen.chat`): streamed multi-turn chat; conversations of ``TURNS`` turns
``GAP_S`` apart, opening with one of 8 shared 1,024-token system prompts, user messages of 32–256
tokens, ``OUTPUT_TOKENS`` output tokens per turn (the run measures the routers, not generation).
For each offered rate in ``RATES`` there are ``ROUNDS`` rounds; in each round every path runs the
same structure (same seed: lengths, sharing, arrival times) with its own text salt, so no path hits
the cache another path warmed; the order of the paths rotates from round to round. A path that
lost requests at a rate is not offered the higher ones; one that only lagged still is (its CPU per
request stays comparable; it is marked not sustained).

Per path and rate:
- **router CPU ms per request**: user+system CPU time (``/proc/PID/stat``) summed over every
  process in the router's process group (each router is started in a session of its own, so its
  children count too) during its own segments / requests it served there. It includes the router's
  background work over those seconds (health checks, /metrics scrapes, KV events); each router's
  idle CPU (ms per second, no traffic) is reported separately, and *above idle* subtracts the idle
  rate over the segments' wall time (the work the requests themselves cost). The 4 engines' CPU
  per request is measured the same way: a router that asks the engines for token ids (vllm-router
  renders every chat request on them) moves work there.
- **sustained**: every request finished with a 200 and no send lagged more than ``MAX_LAG_S``
  behind its planned time; the highest sustained rate is reported.
- **TTFT** p50 and p99 (client side), and added over ``direct`` in the same rounds.
- **KV hit**: Σ prefix-cache hits / Σ queries over the 4 engines' /metrics during the path's
  segments (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``); and the busiest engine's
  share of the prompt tokens (0.25 is an even spread over 4).

Writes ``benchmarks/results/peers.json`` with the machine (CPUs, CPU model, load average before
and after, the processes that used the most CPU during the run besides this benchmark's). Paths
whose package is not installed (``pip install -e '.[bench]'``) are skipped with a note.
``PEERS_RATES`` (comma-separated req/s) and ``PEERS_ROUNDS`` change the schedule,
``PEERS_KVROUTE_ARGS`` adds ``kvroute serve`` flags (experiments; the JSON records them).
``PEERS_PYSPY=FILE`` records a py-spy profile (speedscope JSON) of the kvroute router during its
segments at the highest rate, when py-spy is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
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

from kvroute.loadgen.chat import ChatLoad, ChatResult, ChatTurn, run_chat
from kvroute.loadgen.text import BlockText
from kvroute.server.cluster import EngineCluster, free_port
from kvroute.tokenizer import load_tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
INSTANCES = 4
TIME_SCALE = 1000.0
BLOCK_SIZE = 16
OUTPUT_TOKENS = 4
TURNS = 4
GAP_S = 1.0
RATES = tuple(int(r) for r in os.environ.get("PEERS_RATES", "50,125,250").split(","))
ROUNDS = int(os.environ.get("PEERS_ROUNDS", "2"))
MAX_LAG_S = 0.5
IDLE_S = 5.0
PATHS: tuple[str, ...] = (
    "kvroute",
    "sglang-router",
    "vllm-router cache_aware",
    "vllm-router kv_aware",
    "direct",
)


def _group_cpu_s(pgid: int) -> float:
    """User+system CPU seconds of every live process in process group ``pgid`` (threads included),
    plus what its leader's waited-for children used."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            f = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if int(f[2]) != pgid:  # field 5 (pgrp), after the state field
            continue
        total += int(f[11]) + int(f[12])
        if int(d) == pgid:
            total += int(f[13]) + int(f[14])
    return total / tck


def _top_cpu(exclude: set[int], since: dict[int, tuple[str, int]]) -> list[dict[str, Any]]:
    """Processes outside ``exclude`` (process groups) by CPU used since the ``since`` snapshot."""
    now = _snapshot()
    tck = os.sysconf("SC_CLK_TCK")
    rows: list[dict[str, Any]] = []
    for pid, (name, ticks) in now.items():
        pg = _pgid(pid)
        if pg in exclude:
            continue
        used = ticks - since.get(pid, (name, 0))[1]
        if used > 0:
            rows.append({"pid": pid, "name": name, "cpu_s": used / tck})
    rows.sort(key=lambda r: -r["cpu_s"])
    return rows[:8]


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def _snapshot() -> dict[int, tuple[str, int]]:
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            raw = Path(f"/proc/{d}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        name = raw[raw.find("(") + 1 : raw.rfind(")")]
        f = raw.rsplit(")", 1)[1].split()
        out[int(d)] = (name, int(f[11]) + int(f[12]))
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def _wait_ready(url: str, path: str, proc: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    async with aiohttp.ClientSession() as s:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: the router exited with status {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with s.get(url + path) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}{path} did not come up within {timeout_s:.0f} s")


async def _engine_hits(urls: list[str]) -> list[tuple[float, float]]:
    """Each engine's prefix-cache hits and queries (tokens) from its /metrics."""
    out = []
    async with aiohttp.ClientSession() as s:
        for url in urls:
            hits = queries = 0.0
            async with s.get(url + "/metrics") as r:
                text = await r.text()
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
            out.append((hits, queries))
    return out


def _router_cmds(backends: list[Any], model: str, logs: Path) -> dict[str, tuple[list[str], str, str]]:
    """Path name → (command, base URL, readiness path), for the routers whose package is present."""
    out: dict[str, tuple[list[str], str, str]] = {}
    urls = [b.url for b in backends]
    port = free_port()
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", "lmetric"]
    for b in backends:
        cmd += ["--backend", b.url, "--kv-events", f"{b.url}={b.kv_events}"]
    cmd += os.environ.get("PEERS_KVROUTE_ARGS", "").split()
    out["kvroute"] = (cmd, f"http://127.0.0.1:{port}", "/health")
    if importlib.util.find_spec("sglang_router") is not None:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        cmd += ["--policy", "cache_aware", "--log-level", "warn", "--prometheus-port", str(free_port())]
        cmd += ["--worker-urls", *urls]
        out["sglang-router"] = (cmd, f"http://127.0.0.1:{port}", "/v1/models")
    vllm_router = shutil.which("vllm-router") or (
        str(Path(sys.executable).with_name("vllm-router"))
        if Path(sys.executable).with_name("vllm-router").exists()
        else None
    )
    if vllm_router is not None:
        for policy in ("cache_aware", "kv_aware"):
            port = free_port()
            cmd = [vllm_router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy]
            cmd += ["--log-level", "warning", "--prometheus-port", str(free_port()), "--worker-urls", *urls]
            if policy == "kv_aware":
                for b in backends:
                    cmd += ["--kv-event-source", f"{b.url}={b.kv_events}"]
                cmd += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", model]
            out[f"vllm-router {policy}"] = (cmd, f"http://127.0.0.1:{port}", "/v1/models")
    return out


def _summary(res: ChatResult) -> dict[str, Any]:
    s = res.recorder.summary()
    return {
        "requests": res.requests,
        "unfinished": res.unfinished,
        "errors": dict(res.errors),
        "max_lag_s": round(res.lag_s, 3),
        "wall_s": round(res.wall_seconds, 3),
        "ttft_ms": s["ttft_ms"],
        "client_kv_hit_rate": s["kv_hit_rate"],
    }


async def _segment(
    name: str,
    target: str | Any,
    load: ChatLoad,
    seed: int,
    salt: int,
    text: BlockText,
    model: str,
    pgid: int | None,
    engines: list[str],
    engine_pgids: list[int],
    pyspy: tuple[str, Path] | None,
) -> dict[str, Any]:
    before = await _engine_hits(engines)
    e0 = sum(_group_cpu_s(g) for g in engine_pgids)
    c0 = _group_cpu_s(pgid) if pgid is not None else 0.0
    spy = None
    if pyspy is not None and pgid is not None:
        spy = subprocess.Popen(
            [
                *(pyspy[0], "record", "--pid", str(pgid), "--rate", "200", "--format", "speedscope"),
                *("--nonblocking", "--duration", str(int(load.duration_s + 2)), "--output", str(pyspy[1])),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    res = await run_chat(target, load, text, model, seed=seed, salt=salt)
    cpu = _group_cpu_s(pgid) - c0 if pgid is not None else None
    engines_cpu = sum(_group_cpu_s(g) for g in engine_pgids) - e0
    if spy is not None:
        spy.wait(timeout=30)
    after = await _engine_hits(engines)
    hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    out = _summary(res)
    out["engine_kv_hit_rate"] = sum(hits) / sum(queries) if sum(queries) else 0.0
    out["engine_prompt_token_share"] = [round(q / sum(queries), 3) if sum(queries) else 0.0 for q in queries]
    out["router_cpu_s"] = cpu
    out["router_cpu_ms_per_request"] = 1000.0 * cpu / max(res.requests, 1) if cpu is not None else None
    out["engines_cpu_s"] = engines_cpu
    out["sustained"] = res.unfinished == 0 and res.lag_s <= MAX_LAG_S
    print(
        f"    {name:24s} {res.requests - res.unfinished:4d}/{res.requests:<4d} "
        f"TTFT p50 {out['ttft_ms']['p50']:6.2f} p99 {out['ttft_ms']['p99']:7.2f} ms  "
        f"hit {out['engine_kv_hit_rate']:.3f}  busiest engine {max(out['engine_prompt_token_share']):.2f}  "
        f"lag {res.lag_s:5.2f} s  "
        + (f"CPU {out['router_cpu_ms_per_request']:.2f} ms/req" if cpu is not None else ""),
        flush=True,
    )
    return out


async def _measure(logs: Path) -> dict[str, Any]:
    tok = load_tokenizer()
    text = BlockText(tok)
    cluster = EngineCluster(
        INSTANCES,
        [
            *("--time-scale", str(TIME_SCALE), "--kv-blocks", "65536", "--block-size", str(BLOCK_SIZE)),
            *("--kv-events-format", "map"),
        ],
        kv_events=True,
    )
    backends = list(await cluster.start())
    engines = [b.url for b in backends]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    skipped: dict[str, str] = {}
    try:
        async with aiohttp.ClientSession() as s, s.get(engines[0] + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        cmds = _router_cmds(backends, model, logs)
        for name in PATHS[:-1]:
            if name not in cmds:
                skipped[name] = "not installed (pip install -e '.[bench]')"
                continue
            cmd, url, _ready = cmds[name]
            procs[name] = _spawn(cmd, logs / f"{name.replace(' ', '_')}.log")
            urls[name] = url
        for name, p in procs.items():
            await _wait_ready(urls[name], cmds[name][2], p)
        await asyncio.sleep(2.0)
        paths = [n for n in PATHS if n in procs or n == "direct"]
        out: dict[str, Any] = {"paths": {n: {"rates": {}} for n in paths}, "skipped": skipped}
        idle0 = {n: _group_cpu_s(p.pid) for n, p in procs.items()}
        await asyncio.sleep(IDLE_S)
        for n, p in procs.items():
            out["paths"][n]["idle_cpu_ms_per_s"] = 1000.0 * (_group_cpu_s(p.pid) - idle0[n]) / IDLE_S

        def direct(turn: ChatTurn) -> str:
            return engines[turn.system % len(engines)]

        for n in paths:  # warm-up: connections, tokenizer caches, the routers' first requests
            load = ChatLoad(conversations=10, turns=2, gap_s=0.5, output_tokens=OUTPUT_TOKENS)
            await run_chat(direct if n == "direct" else urls[n], load, text, model, seed=1, salt=999)
        failed: set[str] = set()
        pyspy_bin = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        pyspy_out = os.environ.get("PEERS_PYSPY")
        for rate in RATES:
            load = ChatLoad(
                conversations=int(rate * GAP_S), turns=TURNS, gap_s=GAP_S, output_tokens=OUTPUT_TOKENS
            )
            live = [n for n in paths if n not in failed]
            if not live:
                break
            print(
                f"  {rate} req/s offered ({load.conversations} conversations x {TURNS} turns), {ROUNDS} rounds"
            )
            segs: dict[str, list[dict[str, Any]]] = {n: [] for n in live}
            for rnd in range(ROUNDS):
                order = live[rnd % len(live) :] + live[: rnd % len(live)]
                for n in order:
                    salt = 1000 * rate + 10 * rnd + PATHS.index(n)
                    spy = None
                    if (
                        pyspy_out
                        and n == "kvroute"
                        and rate == RATES[-1]
                        and rnd == 0
                        and Path(pyspy_bin).exists()
                    ):
                        spy = (pyspy_bin, Path(pyspy_out))
                    seg = await _segment(
                        n,
                        direct if n == "direct" else urls[n],
                        load,
                        seed=rate * 100 + rnd,
                        salt=salt,
                        text=text,
                        model=model,
                        pgid=procs[n].pid if n in procs else None,
                        engines=engines,
                        engine_pgids=[e.proc.pid for e in cluster.engines],
                        pyspy=spy,
                    )
                    segs[n].append(seg)
                    await asyncio.sleep(0.5)
            for n in live:
                out["paths"][n]["rates"][str(rate)] = _merge_segments(segs[n])
                if any(s["unfinished"] for s in segs[n]):  # lost requests: not offered more
                    failed.add(n)
        for n in paths:
            rates = out["paths"][n]["rates"]
            ok = [int(r) for r, v in rates.items() if v["sustained"]]
            out["paths"][n]["max_sustained_rps"] = max(ok) if ok else 0
            for r, v in rates.items():
                d = out["paths"]["direct"]["rates"].get(r)
                if n != "direct" and d is not None:
                    v["added_ttft_ms"] = {q: v["ttft_ms"][q] - d["ttft_ms"][q] for q in ("p50", "p99")}
                idle = out["paths"][n].get("idle_cpu_ms_per_s")
                if idle is not None and v["router_cpu_ms_per_request"] is not None:
                    v["router_cpu_ms_per_request_above_idle"] = (
                        v["router_cpu_ms_per_request"] - idle * v["wall_s"] / v["requests"]
                    )
        return out
    finally:
        for p in procs.values():
            _stop(p)
        cluster.stop()


def _merge_segments(segs: list[dict[str, Any]]) -> dict[str, Any]:
    """One rate's rounds together: sums, request-weighted means, and the p50/p99 of the rounds'
    quantiles averaged (each round has the same number of requests)."""
    n = sum(s["requests"] for s in segs)
    cpu = [s["router_cpu_ms_per_request"] for s in segs]
    return {
        "requests": n,
        "unfinished": sum(s["unfinished"] for s in segs),
        "errors": {k: sum(s["errors"].get(k, 0) for s in segs) for s in segs for k in s["errors"]},
        "max_lag_s": max(s["max_lag_s"] for s in segs),
        "sustained": all(s["sustained"] for s in segs),
        "ttft_ms": {q: sum(s["ttft_ms"][q] for s in segs) / len(segs) for q in ("mean", "p50", "p90", "p99")},
        "engine_kv_hit_rate": sum(s["engine_kv_hit_rate"] for s in segs) / len(segs),
        "client_kv_hit_rate": sum(s["client_kv_hit_rate"] for s in segs) / len(segs),
        "busiest_engine_share": max(max(s["engine_prompt_token_share"]) for s in segs),
        "router_cpu_ms_per_request": None
        if cpu[0] is None
        else sum(s["router_cpu_s"] for s in segs) * 1000.0 / n,
        "router_cpu_ms_per_request_rounds": cpu,
        "wall_s": sum(s["wall_s"] for s in segs),
        "engines_cpu_ms_per_request": sum(s["engines_cpu_s"] for s in segs) * 1000.0 / n,
    }


def main() -> int:
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    logs = Path(os.environ.get("PEERS_LOGS", "/tmp")) / f"kvroute-bench-peers-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    snap = _snapshot()
    try:
        import uvloop

        out = uvloop.run(_measure(logs))
    except ImportError:
        out = asyncio.run(_measure(logs))
    own = {os.getpgid(0)}
    out["machine"] = {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "other_processes_top_cpu": _top_cpu(own, snap),
    }
    out["setup"] = {
        "instances": INSTANCES,
        "time_scale": TIME_SCALE,
        "block_size": BLOCK_SIZE,
        "turns": TURNS,
        "gap_s": GAP_S,
        "output_tokens": OUTPUT_TOKENS,
        "rates": list(RATES),
        "rounds": ROUNDS,
        "max_lag_s": MAX_LAG_S,
        "kvroute_extra_args": os.environ.get("PEERS_KVROUTE_ARGS", ""),
        "versions": {
            n: _version(n) for n in ("kvroute", "sglang-router", "vllm-router") if _version(n) is not None
        },
    }
    out["wall_seconds"] = time.perf_counter() - t0
    out["logs"] = str(logs)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "peers.json").write_text(json.dumps(out, indent=2) + "\n")
    _print(out)
    return 0


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _print(out: dict[str, Any]) -> None:
    m = out["machine"]
    print(
        f"\nmachine: {m['nproc']} CPUs ({m['cpu_model']}), load average before "
        f"{m['loadavg_before'][0]:.2f}, after {m['loadavg_after'][0]:.2f}"
    )
    print(
        "\n| path | offered req/s | CPU ms/req | above idle | TTFT p50 (ms) | TTFT p99 (ms) | added p50 | added p99 "
        "| engines' CPU ms/req | engines' KV hit | busiest engine | sustained |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, p in out["paths"].items():
        for r, v in p["rates"].items():
            cpu = v["router_cpu_ms_per_request"]
            above = v.get("router_cpu_ms_per_request_above_idle")
            add = v.get("added_ttft_ms")
            print(
                f"| {n} | {r} | {'-' if cpu is None else f'{cpu:.2f}'} | "
                f"{'-' if above is None else f'{above:.2f}'} | {v['ttft_ms']['p50']:.2f} | "
                f"{v['ttft_ms']['p99']:.2f} | {'-' if add is None else format(add['p50'], '+.2f')} | "
                f"{'-' if add is None else format(add['p99'], '+.2f')} | {v['engines_cpu_ms_per_request']:.2f} | "
                f"{v['engine_kv_hit_rate']:.3f} | "
                f"{v['busiest_engine_share']:.2f} | {'yes' if v['sustained'] else 'no'} |"
            )
    print("\n| path | highest sustained req/s | idle CPU ms/s |")
    print("|---|---:|---:|")
    for n, p in out["paths"].items():
        idle = p.get("idle_cpu_ms_per_s")
        print(f"| {n} | {p['max_sustained_rps']} | {'-' if idle is None else f'{idle:.1f}'} |")
    for n, why in out["skipped"].items():
        print(f"skipped {n}: {why}")


if __name__ == "__main__":
    sys.exit(main())
