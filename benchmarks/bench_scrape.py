"""What one ``/metrics`` scrape costs the router and the engine: the filtered page vs the whole page.

The router scrapes every backend every 50 ms by default (20 times a second per backend, per router
replica), so the cost of one scrape is paid all the time, with or without traffic. Since this
session the router asks for the 5 samples it reads (``backends.SCRAPE_PATH``, prometheus_client's
``name[]`` filter, which vLLM serves); a backend that ignores the filter sends the whole page.

Setup: one emulated engine (``kvroute engine`` subprocess, time scale 1000, a few requests served
first so that its histograms hold samples) and, in this process, the router's
:class:`~kvroute.server.sync.monitor.Monitor` with the router's HTTP transport. For each page, ``SCRAPES``
scrapes back to back (after ``WARMUP``), alternating the two pages in ``ROUNDS`` rounds:

- ``router_cpu_us``: this process's CPU time per scrape (``time.process_time``), µs;
- ``engine_cpu_us``: the engine process's CPU time per scrape (``/proc/PID/stat``, 10 ms ticks, so
  only meaningful over many scrapes), µs;
- ``wall_us``: wall time per scrape, µs; ``bytes``: size of the page.

Back-to-back scrapes keep caches warm: a router that sleeps 50 ms between scrapes pays more per scrape
(its idle CPU is in ``bench_proxy``). The engine runs with ``--metrics-name-filter`` for this part
(vLLM 0.32 ignores ``name[]`` and always renders the whole page; so does ``kvroute engine`` by default).

**Schedules** (issue 21, fix 3): what the router's scraping costs the engine per second, on a fresh
engine serving the whole page (as vLLM 0.32), for ``WORKERS`` router workers of one machine, idle and
under load (``LOAD_STREAMS`` clients back to back, each request held as a lease in the first worker's
row of the machine's load table, as the router holds it), ``PHASE_S`` seconds each:

- ``none``: nobody scrapes (the engine's own CPU);
- ``before``: every worker scrapes every 50 ms (the fixed interval before this fix);
- ``after``: the workers' :class:`~kvroute.server.sync.scrape.Scraper` over one shared table (one
  scraper per machine, 50 ms while requests are in flight, up to 1 s idle).

Each gives ``scrapes_per_s`` (over all workers) and ``engine_cpu_ms_per_s`` (the engine process's CPU,
``/proc``, 10 ms ticks). ``vllm_projection_ms_per_s`` multiplies the scrape rate by the 4.5 ms of API
server CPU one scrape of vLLM 0.32's 53 KB page costs (measured on its CPU build, see ANCHORS). Writes
``benchmarks/results/scrape.json``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import write
from kvroute.policies.registry import make_policy
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.server.cluster import EngineCluster
from kvroute.server.config import RouterConfig
from kvroute.server.state.backends import SCRAPE_PATH, BackendState, Lease
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.state.router import RouterState
from kvroute.server.sync.monitor import Monitor
from kvroute.server.sync.scrape import Scraper, ScrapeSchedule
from kvroute.server.wire.h1 import H1Transport
from kvroute.tokenizer import load_tokenizer

SCRAPES = 400
WARMUP = 50
ROUNDS = 4
PAGES = {"filtered": SCRAPE_PATH, "whole": "/metrics"}
WORKERS = 2
LOAD_STREAMS = 2
PHASE_S = 6.0
FIXED_S = 0.05  # the scrape interval before fix 3, per worker
VLLM_SCRAPE_CPU_S = 0.0045  # one scrape of vLLM 0.32's whole page, API server CPU (ANCHORS)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _fixed_loop(monitor: Monitor, backend: BackendState) -> None:
    """The scrape loop before fix 3: every ``FIXED_S``, whatever the load."""
    while True:
        await monitor.scrape(backend)
        await asyncio.sleep(FIXED_S)


async def _load(url: str, backend: BackendState, stop: asyncio.Event) -> int:
    """One client, back to back until ``stop``; each request in flight is a lease (the router's
    in-flight counter). Returns the requests completed."""
    done = 0
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            lease = Lease(backend, 300)
            try:
                body = {"prompt": list(range(1000 + done, 1300 + done)), "max_tokens": 16}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
            finally:
                lease.release()
            done += 1
    return done


async def _phase(
    url: str, pid: int, monitors: list[Monitor], states: list[RouterState], mode: str, loaded: bool
) -> dict[str, float]:
    tasks: list[asyncio.Task[Any]] = []
    if mode == "before":
        tasks = [
            asyncio.create_task(_fixed_loop(m, st.backends[0]))
            for m, st in zip(monitors, states, strict=True)
        ]
    elif mode == "after":
        sched = ScrapeSchedule.of(FIXED_S, 1.0)
        tasks = [
            asyncio.create_task(Scraper(st, m, sched).run()) for m, st in zip(monitors, states, strict=True)
        ]
    stop = asyncio.Event()
    clients = [
        asyncio.create_task(_load(url, states[0].backends[0], stop))
        for _ in range(LOAD_STREAMS if loaded else 0)
    ]
    await asyncio.sleep(1.0)  # settle: the adaptive interval reaches its level
    n0, e0, t0 = sum(m.scrapes for m in monitors), _cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(PHASE_S)
    n1, e1, t1 = sum(m.scrapes for m in monitors), _cpu_seconds(pid), time.perf_counter()
    stop.set()
    served = sum(await asyncio.gather(*clients))
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    rate = (n1 - n0) / (t1 - t0)
    return {
        "scrapes_per_s": rate,
        "engine_cpu_ms_per_s": 1e3 * (e1 - e0) / (t1 - t0),
        "vllm_projection_ms_per_s": 1e3 * rate * VLLM_SCRAPE_CPU_S,
        "requests": served,
    }


async def _schedules() -> dict[str, Any]:
    cluster = EngineCluster(1, ["--time-scale", "10"], kv_events=False)
    specs = await cluster.start()
    lock = mp.get_context("spawn").Lock()
    parent, spec = LoadTable.create_shared(WORKERS + 1, lock)
    tables = [LoadTable.attach(spec, k + 1, lock) for k in range(WORKERS)]
    transport = H1Transport()
    try:
        url = specs[0].url
        tok = RequestTokenizer(load_tokenizer())
        cfg = RouterConfig(backends=tuple(specs))
        states = [RouterState(cfg, tok, make_policy("lmetric"), table=t) for t in tables]
        monitors = [Monitor(st, transport) for st in states]
        pid = cluster.engines[0].proc.pid
        out: dict[str, Any] = {"workers": WORKERS, "load_streams": LOAD_STREAMS, "phase_s": PHASE_S}
        for load in ("idle", "load"):
            out[load] = {}
            for mode in ("none", "before", "after"):
                out[load][mode] = await _phase(url, pid, monitors, states, mode, load == "load")
        return out
    finally:
        await transport.close()
        for t in tables:
            t.close()
        parent.close(unlink=True)
        cluster.stop()


async def _measure() -> dict[str, Any]:
    cluster = EngineCluster(1, ["--time-scale", "1000", "--metrics-name-filter"], kv_events=False)
    specs = await cluster.start()
    try:
        url = specs[0].url
        async with aiohttp.ClientSession() as s:
            for i in range(20):  # fill the histograms
                body = {"prompt": list(range(100 + i, 400 + i)), "max_tokens": 4}
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
            sizes = {}
            for name, path in PAGES.items():
                async with s.get(url + path) as r:
                    sizes[name] = len(await r.read())
        core = RouterState(
            RouterConfig(backends=tuple(specs)), RequestTokenizer(load_tokenizer()), make_policy("lmetric")
        )
        transport = H1Transport()
        monitor = Monitor(core, transport)
        backend = core.backends[0]
        engine_pid = cluster.engines[0].proc.pid
        totals = {name: [0.0, 0.0, 0.0] for name in PAGES}  # router cpu, engine cpu, wall (s)
        for path in PAGES.values():
            for _ in range(WARMUP):
                await monitor.scrape(backend, path)
        per_round = SCRAPES // ROUNDS
        for _ in range(ROUNDS):
            for name, path in PAGES.items():
                c0, e0, w0 = time.process_time(), _cpu_seconds(engine_pid), time.perf_counter()
                for _ in range(per_round):
                    await monitor.scrape(backend, path)
                t = totals[name]
                t[0] += time.process_time() - c0
                t[1] += _cpu_seconds(engine_pid) - e0
                t[2] += time.perf_counter() - w0
        await transport.close()
        if monitor.scrape_failures:
            raise RuntimeError(f"{monitor.scrape_failures} scrapes failed")
        n = per_round * ROUNDS
        return {
            "scrapes_per_page": n,
            "pages": {
                name: {
                    "bytes": sizes[name],
                    "router_cpu_us": 1e6 * t[0] / n,
                    "engine_cpu_us": 1e6 * t[1] / n,
                    "wall_us": 1e6 * t[2] / n,
                }
                for name, t in totals.items()
            },
        }
    finally:
        cluster.stop()


def main() -> int:
    out = asyncio.run(_measure())
    out["schedules"] = asyncio.run(_schedules())
    rows = []
    for name, p in out["pages"].items():
        rows.append(
            (
                f"{name} ({p['bytes']} bytes)",
                f"{p['router_cpu_us']:.0f}",
                f"{p['engine_cpu_us']:.0f}",
                f"{p['wall_us']:.0f}",
            )
        )
    from rich.console import Console
    from rich.table import Table

    t = Table("page", "router CPU µs/scrape", "engine CPU µs/scrape", "wall µs/scrape")
    for r in rows:
        t.add_row(*r)
    Console().print(t)
    sched = out["schedules"]
    t = Table(
        "load",
        "schedule",
        "scrapes/s",
        "engine CPU ms/s",
        "vLLM 0.32 projection ms/s",
        title=f"{WORKERS} workers",
    )
    for load in ("idle", "load"):
        for mode, r in sched[load].items():
            t.add_row(
                load,
                mode,
                f"{r['scrapes_per_s']:.1f}",
                f"{r['engine_cpu_ms_per_s']:.1f}",
                f"{r['vllm_projection_ms_per_s']:.1f}",
            )
    Console().print(t)
    write("scrape.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
