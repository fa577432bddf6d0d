"""``python -m benchmarks.soak_heap``: where a router process's memory goes as requests pass.

One router (:class:`~kvroute.server.app.RouterServer`, what each ``--workers`` worker runs, with its
real upstream transport) in this process, in front of 2 emulated engines with KV events (real
processes), under the soak's traffic mix (:class:`benchmarks.procs.Traffic`: multi-turn chats and
completions with new text, half streamed) from 8 clients. ``tracemalloc`` traces every allocation
made after the router started; every ``--every`` requests a snapshot is diffed against the previous
one (growth by source line, the router's and its libraries' lines only: the load generator's own are
left out) and the live objects are counted by type (``gc``). So a cache that fills shows as its
line growing and then not, and a leak as a line that keeps growing.

Writes ``benchmarks/results/soak-heap.json`` (``--out`` another name): per checkpoint the traced total, RSS, the top lines by
growth and the object types that grew most. Slow (tracemalloc costs the router several times its
CPU); the figures are memory, not speed.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import tempfile
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import write
from benchmarks.procs import Fleet, Traffic, rss_mib, send, wait_http
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig

CLIENTS = 8
_CLIENT_SIDE = ("benchmarks/", "/aiohttp/client", "/aiohttp/connector", "tracemalloc")


def _router_line(tb: tracemalloc.Traceback) -> bool:
    name = tb[0].filename
    return not any(part in name for part in _CLIENT_SIDE)


def _types() -> Counter[str]:
    return Counter(type(o).__name__ for o in gc.get_objects())


async def _run(requests: int, every: int, cache_tokens: int, logs: Path) -> dict[str, Any]:
    fleet = Fleet(logs)
    try:
        engines = [fleet.engine(f"engine{k}", time_scale=100.0) for k in range(2)]
        for e in engines:
            await wait_http(e.url, proc=e)
        specs = tuple(BackendSpec(e.url, e.kv[0], e.kv[1]) for e in engines if e.kv is not None)
        # without the router-side queue, as its committed results ran
        config = RouterConfig(backends=specs, port=0, tokenizer_cache_tokens=cache_tokens, router_queue=None)
        server = RouterServer(config)
        url = await server.start()
        pid = os.getpid()
        gc.collect()
        tracemalloc.start(1)
        prev = tracemalloc.take_snapshot()
        prev_types = _types()
        first_rss = rss_mib(pid)
        checkpoints: list[dict[str, Any]] = []
        traffic = Traffic(seed=11, users=300, max_turns=6, words=150)
        done = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

            async def client(until: int) -> None:
                nonlocal done
                while done < until:
                    done += 1
                    path, body = traffic.next()
                    await send(session, url, path, body)

            for mark in range(every, requests + 1, every):
                await asyncio.gather(*(client(mark) for _ in range(CLIENTS)))
                await asyncio.sleep(0.5)
                gc.collect()
                snap = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)]
                )
                stats = [s for s in snap.compare_to(prev, "lineno") if _router_line(s.traceback)]
                stats.sort(key=lambda s: s.size_diff, reverse=True)
                types = _types()
                grew = (types - prev_types).most_common(8)
                traced = sum(s.size for s in snap.statistics("filename") if _router_line(s.traceback))
                top = [
                    (
                        f"{s.traceback[0].filename.split('site-packages/')[-1].split('src/')[-1]}:"
                        f"{s.traceback[0].lineno}",
                        round(s.size_diff / 1024, 1),
                        s.count_diff,
                    )
                    for s in stats[:8]
                ]
                traced_mib, rss_now = round(traced / (1 << 20), 2), round(rss_mib(pid), 1)
                checkpoints.append(
                    {
                        "requests": mark,
                        "traced_router_mib": traced_mib,
                        "rss_mib": rss_now,
                        "top_growth": [{"line": ln, "kib": kib, "count": n} for ln, kib, n in top],
                        "types_grew": grew,
                    }
                )
                print(
                    f"{mark:6d} requests: traced {traced_mib:7.2f} MiB, RSS {rss_now:6.1f};"
                    f" top {[(ln, kib) for ln, kib, _ in top[:3]]}",
                    flush=True,
                )
                prev, prev_types = snap, types
        await server.stop()
        tracemalloc.stop()
        return {
            "requests": requests,
            "every": every,
            "rss_start_mib": round(first_rss, 1),
            "checkpoints": checkpoints,
        }
    finally:
        fleet.stop_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.soak_heap", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--every", type=int, default=1000, help="requests between two snapshots")
    default = RouterConfig(backends=()).tokenizer_cache_tokens
    parser.add_argument(
        "--tokenizer-cache-tokens",
        type=int,
        default=default,
        help=f"the router's tokenizer_cache_tokens (default {default:,}, the router's)",
    )
    parser.add_argument("--out", default="soak-heap.json", help="results file under benchmarks/results")
    args = parser.parse_args(argv)
    if args.every < 1 or args.requests < args.every:
        parser.error("--every must be at least 1 and at most --requests")
    logs = Path(tempfile.mkdtemp(prefix="kvroute-heap-"))
    out = asyncio.run(_run(args.requests, args.every, args.tokenizer_cache_tokens, logs))
    out["tokenizer_cache_tokens"] = args.tokenizer_cache_tokens
    out["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    write(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
