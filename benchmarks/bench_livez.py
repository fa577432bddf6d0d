"""``/livez`` while 30 MB token-id prompts arrive: does one huge body stall the router's event loop?

Setup: per run, a fresh ``kvroute serve`` subprocess whose one backend is a loopback port nothing
listens on (so that only the router's own work is measured: the parse, the checks, the hashing; a
request that gets through them is answered 503, no healthy backend), with one ``--parse-offload`` mode:

- ``off``: the body is parsed on the event loop;
- ``thread``: bodies of 1 MiB or more are parsed on a worker thread;
- ``process``: ... in a worker process (the default).

``capped`` runs (the default ``--max-prompt-tokens`` 262,144) answer the prompt 400 before its ids are
checked one by one or hashed; ``uncapped`` runs (``--max-prompt-tokens 8388608``) parse, check and hash
all 5,000,000 ids (then 503). ``off``/``uncapped`` is what the router did before the prompt cap and
the offload existed (with an engine behind it, it then forwarded the 30 MB).

In each run this process polls ``GET /livez`` back to back on one kept-alive connection while it
sends ``BODIES`` bodies of ``TOKENS`` token ids (about 30 MB each) one after the other, and reports the
``/livez`` latency p50/p99/max (ms) over that window, and the 30 MB requests' own latency. Runs are
interleaved (each round runs every configuration, in a rotated order) and the 1-minute load average
is recorded before each run. Writes ``benchmarks/results/livez.json``.

Environment: ``LIVEZ_ROUNDS`` (default 2), ``LIVEZ_BODIES`` (3), ``LIVEZ_TOKENS`` (5,000,000).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.common import table, write
from benchmarks.procs import Fleet, wait_http
from kvroute.server.cluster import free_port

ROUNDS = int(os.environ.get("LIVEZ_ROUNDS", "2"))
BODIES = int(os.environ.get("LIVEZ_BODIES", "3"))
TOKENS = int(os.environ.get("LIVEZ_TOKENS", "5000000"))
MODES = ("off", "thread", "process")
CAPS = {"capped": 262_144, "uncapped": 8_388_608}  # --max-prompt-tokens


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def poll(url: str, stop: asyncio.Event, out: list[float]) -> None:
    """GET /livez back to back until ``stop``; each latency (ms) into ``out``."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(url + "/livez") as r:
                await r.read()
                assert r.status == 200
            out.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.005)


async def one_run(fleet: Fleet, mode: str, cap: int, body: bytes) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load = os.getloadavg()[0]
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["serve", "--backend", dead, "--port", str(port), "--parse-offload", mode]
    router = fleet.spawn(f"router-{mode}", [*args, "--max-prompt-tokens", str(cap)], url)
    try:
        await wait_http(url, "/livez", proc=router)
        await asyncio.sleep(1.0)
        idle: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(poll(url, stop, idle))
        await asyncio.sleep(1.0)  # the idle baseline
        stop.set()
        await task
        busy: list[float] = []
        stop = asyncio.Event()
        task = asyncio.create_task(poll(url, stop, busy))
        took, statuses = [], []
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            for _ in range(BODIES):
                t0 = time.perf_counter()
                async with s.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    statuses.append(r.status)
                took.append(time.perf_counter() - t0)
        stop.set()
        await task
    finally:
        router.stop(timeout_s=20)
    return {
        "mode": mode,
        "loadavg_1m_before": load,
        "statuses": statuses,
        "request_s": took,
        "idle_livez_ms": {"p50": pct(idle, 0.5), "p99": pct(idle, 0.99), "n": len(idle)},
        "livez_ms": {"p50": pct(busy, 0.5), "p99": pct(busy, 0.99), "max": max(busy), "n": len(busy)},
    }


async def run() -> dict[str, Any]:
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(TOKENS)]
    body = orjson.dumps({"model": "emu", "prompt": ids, "max_tokens": 1})
    del ids
    fleet = Fleet(Path(tempfile.mkdtemp(prefix="kvroute-livez-")))
    runs: list[dict[str, Any]] = []
    try:
        configs = [(m, c) for c in CAPS for m in MODES]
        for k in range(ROUNDS):
            order = configs[k % len(configs) :] + configs[: k % len(configs)]
            for mode, cap in order:
                r = await one_run(fleet, mode, CAPS[cap], body)
                r.update({"cap": cap, "round": k})
                runs.append(r)
                lz = r["livez_ms"]
                print(
                    f"round {k} {mode:8s} {cap:9s} load {r['loadavg_1m_before']:.2f}: livez p50 "
                    f"{lz['p50']:.1f} p99 {lz['p99']:.1f} max {lz['max']:.1f} ms; statuses {r['statuses']}",
                    flush=True,
                )
    finally:
        fleet.stop_all()
    summary = {}
    for mode, cap in [(m, c) for c in CAPS for m in MODES]:
        mine = [r for r in runs if r["mode"] == mode and r["cap"] == cap]
        summary[f"{mode}/{cap}"] = {
            "livez_p50_ms": statistics.median(r["livez_ms"]["p50"] for r in mine),
            "livez_p99_ms": statistics.median(r["livez_ms"]["p99"] for r in mine),
            "livez_max_ms": max(r["livez_ms"]["max"] for r in mine),
            "idle_livez_p99_ms": statistics.median(r["idle_livez_ms"]["p99"] for r in mine),
            "request_s_median": statistics.median(t for r in mine for t in r["request_s"]),
            "statuses": sorted({s for r in mine for s in r["statuses"]}),
            "loadavg_1m": [r["loadavg_1m_before"] for r in mine],
        }
    return {"body_bytes": len(body), "tokens": TOKENS, "bodies_per_run": BODIES, "rounds": ROUNDS,
            "summary": summary, "runs": runs}  # fmt: skip


def main() -> int:
    data = asyncio.run(run())
    rows = [
        (
            name,
            f"{s['livez_p50_ms']:.1f}",
            f"{s['livez_p99_ms']:.1f}",
            f"{s['livez_max_ms']:.1f}",
            f"{s['idle_livez_p99_ms']:.1f}",
            f"{s['request_s_median']:.2f}",
            ",".join(map(str, s["statuses"])),
            ",".join(f"{x:.1f}" for x in s["loadavg_1m"]),
        )
        for name, s in data["summary"].items()
    ]
    table(
        rows,
        (
            "mode/cap",
            "livez p50 ms",
            "p99 ms",
            "max ms",
            "idle p99 ms",
            "30 MB request s",
            "status",
            "load 1m",
        ),
    )
    write("livez.json", data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
