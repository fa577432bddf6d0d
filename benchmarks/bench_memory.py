"""Memory bounded over a long run: ``kvroute serve`` (one process) in front of 4 emulated engines with KV
events, driven over loopback by a seeded mix (multi-turn chats whose conversations keep growing and
restarting with new text, completions with new text, half streamed, clients that leave mid-stream,
and every 50th request a bad one, some of them multi-MB bodies); the router's RSS sampled every
``SAMPLE_EVERY`` requests.

What bounds it: the tokenizer's piece cache and the block-hash memo hold at most
``tokenizer_cache_tokens`` tokens each (2M by default, about 40 bytes per token in the piece cache);
the KV view at most the engines' block pools; the decision records ``decisions_kept``. The check: the
RSS over the run's second half grows by less than ``PLATEAU_GROWTH`` of the half-way figure, and stays
under ``BOUND_MIB``.

``KVROUTE_MEMORY_REQUESTS`` sets the run's length (default 100,000). Writes
``benchmarks/results/memory.json``.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import table, write
from benchmarks.procs import Fleet, Traffic, rss_mib, send, wait_http
from kvroute.server.cluster import free_port

REQUESTS = int(os.environ.get("KVROUTE_MEMORY_REQUESTS", "100000"))
CONCURRENCY = 32
SAMPLE_EVERY = 2000
BOUND_MIB = 600.0
PLATEAU_GROWTH = 0.10
ENGINES = 4


def _bad(i: int) -> tuple[str, bytes]:
    """A bad request body: multi-MB JSON (over the 4 MiB limit here, or just under it), bad JSON, deep
    nesting, wrong types."""
    kinds: list[tuple[str, bytes]] = [
        ("/v1/completions", b'{"prompt": "' + b"x" * (5 << 20) + b'"}'),
        ("/v1/completions", b'{"prompt": ' + b"[" * 500 + b"]" * 500 + b', "max_tokens": 1}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
        ("/v1/completions", b'{"prompt": "unterminated'),
        ("/v1/chat/completions", b'{"messages": "' + b"y" * (3 << 20) + b'"}'),
    ]
    return kinds[i % len(kinds)]


async def _drive(url: str, n: int, router_pid: int) -> tuple[list[dict[str, Any]], dict[str, int]]:
    traffic = Traffic(seed=7, users=2000, max_turns=8, words=200)
    samples: list[dict[str, Any]] = []
    statuses: dict[str, int] = {}
    done = 0
    t0 = time.monotonic()
    conn = aiohttp.TCPConnector(limit=CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)

        async def worker() -> None:
            nonlocal done
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                if i % 50 == 49:
                    path, raw = _bad(i // 50)
                    try:
                        async with session.post(
                            url + path, data=raw, headers={"Content-Type": "application/json"}
                        ) as r:
                            await r.read()
                            status = r.status
                    except (aiohttp.ClientError, OSError):
                        status = -1
                else:
                    path, body = traffic.next()
                    status, _ = await send(session, url, path, body, leave_after=64 if i % 40 == 7 else None)
                statuses[str(status)] = statuses.get(str(status), 0) + 1
                done += 1
                if done % SAMPLE_EVERY == 0:
                    rss = rss_mib(router_pid)
                    samples.append(
                        {"requests": done, "rss_mib": round(rss, 1), "s": round(time.monotonic() - t0, 1)}
                    )
                    print(
                        f"  {done:>7} requests  router RSS {rss:6.1f} MiB  {time.monotonic() - t0:6.0f} s",
                        flush=True,
                    )

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return samples, statuses


async def _run(logs: Path) -> dict[str, Any]:
    fleet = Fleet(logs)
    try:
        engines = [fleet.engine(f"engine{k}") for k in range(ENGINES)]
        for e in engines:
            await wait_http(e.url, proc=e)
        port = free_port()
        args = ["serve", "--port", str(port), "--policy", "lmetric-kv", "--max-body-bytes", str(4 << 20)]
        for e in engines:
            assert e.kv is not None
            args += [
                "--backend",
                e.url,
                "--kv-events",
                f"{e.url}={e.kv[0]}",
                "--kv-replay",
                f"{e.url}={e.kv[1]}",
            ]
        router = fleet.spawn("router", args, f"http://127.0.0.1:{port}")
        await wait_http(router.url, proc=router)
        start_rss = rss_mib(router.pid)
        t0 = time.monotonic()
        samples, statuses = await _drive(router.url, REQUESTS, router.pid)
        wall = time.monotonic() - t0
        tracebacks = fleet.tracebacks()
        return {
            "start_rss_mib": round(start_rss, 1),
            "samples": samples,
            "statuses": statuses,
            "wall_s": round(wall, 1),
            "tracebacks": tracebacks,
        }
    finally:
        fleet.stop_all()


def main() -> int:
    logs = Path(tempfile.mkdtemp(prefix="kvroute-memory-"))
    print(f"{REQUESTS} requests, concurrency {CONCURRENCY}, {ENGINES} emulated engines; logs in {logs}")
    res = asyncio.run(_run(logs))
    samples = res["samples"]
    rss = [s["rss_mib"] for s in samples]
    peak = max(rss) if rss else 0.0
    half = rss[len(rss) // 2] if rss else 0.0
    end = rss[-1] if rss else 0.0
    growth = (end - half) / half if half else 0.0
    ok_plateau = growth < PLATEAU_GROWTH
    ok_bound = peak < BOUND_MIB
    fivexx = sum(v for k, v in res["statuses"].items() if k.startswith("5"))
    table(
        [
            ("requests", str(REQUESTS), ""),
            ("router RSS at start", f"{res['start_rss_mib']:.0f} MiB", ""),
            ("router RSS half-way", f"{half:.0f} MiB", ""),
            ("router RSS at the end", f"{end:.0f} MiB", ""),
            ("growth over the second half", f"{growth:+.1%}", f"< {PLATEAU_GROWTH:.0%}"),
            ("peak", f"{peak:.0f} MiB", f"< {BOUND_MIB:.0f} MiB"),
            ("5xx answers", str(fivexx), "0"),
            ("tracebacks in logs", str(sum(res["tracebacks"].values())), "0"),
        ]
    )
    write(
        "memory.json",
        {
            "requests": REQUESTS,
            "concurrency": CONCURRENCY,
            "engines": ENGINES,
            "wall_s": res["wall_s"],
            "start_rss_mib": res["start_rss_mib"],
            "half_rss_mib": half,
            "end_rss_mib": end,
            "peak_rss_mib": peak,
            "second_half_growth": round(growth, 4),
            "bound_mib": BOUND_MIB,
            "plateau_growth_limit": PLATEAU_GROWTH,
            "statuses": res["statuses"],
            "tracebacks": res["tracebacks"],
            "samples": samples,
            "ok": ok_plateau and ok_bound and not fivexx and not res["tracebacks"],
        },
    )
    return 0 if ok_plateau and ok_bound and not fivexx and not res["tracebacks"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
