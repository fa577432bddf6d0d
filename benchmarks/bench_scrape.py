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
(its idle CPU is in ``bench_proxy``). Writes ``benchmarks/results/scrape.json``.
"""

from __future__ import annotations

import asyncio
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
from kvroute.server.state.backends import SCRAPE_PATH
from kvroute.server.state.router import RouterState
from kvroute.server.sync.monitor import Monitor
from kvroute.server.wire.h1 import H1Transport
from kvroute.tokenizer import load_tokenizer

SCRAPES = 400
WARMUP = 50
ROUNDS = 4
PAGES = {"filtered": SCRAPE_PATH, "whole": "/metrics"}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure() -> dict[str, Any]:
    cluster = EngineCluster(1, ["--time-scale", "1000"], kv_events=False)
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
    write("scrape.json", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
