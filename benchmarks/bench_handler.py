"""The live router's whole request handler, in one process: CPU per request through every stage.

``bench_stages`` times the routing work (parse, prepare, decide) outside the handler; this one runs
whole requests through the router's own handler (read, parse, prepare, decide, reserve, forward,
relay, settle, the decision record) over real HTTP on loopback, with the backends answered by the
in-memory transport of the unit tests (``tests/server/fakes.py``: a three-chunk SSE stream per
request, no engine process). The client (aiohttp, ``CONCURRENCY`` requests at a time) runs in the same
process, so the figure is the router's CPU plus the client's: compare it only with itself (e.g.
before/after a change, interleaved), not with ``bench_proxy``'s.

``REQUESTS`` streamed ``/v1/completions`` (``WARMUP`` more first, not counted) over 4 backends, the
``lmetric`` policy, the bundled tokenizer; prompts of the proxy benchmark's workload as synthetic text
(conversations share prefixes). Reports the process CPU (user + system, ``time.process_time``) per
request in µs and the router's own routing time per request; writes ``benchmarks/results/handler.json``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from tests.server.fakes import FakeTransport, Scripted

from benchmarks.bench_proxy import _requests
from benchmarks.common import table, write
from kvroute.loadgen import BlockText
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import load_tokenizer

REQUESTS = 2000
WARMUP = 200
CONCURRENCY = 8
BACKENDS = 4


async def _run(requests: int, warmup: int) -> dict[str, Any]:
    tok = load_tokenizer()
    text = BlockText(tok)
    reqs = _requests(requests + warmup, 20.0, seed=7)
    bodies = [
        orjson.dumps(
            {
                "model": "m",
                "prompt": text.prompt(r.block_ids, r.block_size, r.prompt_len, r.req_id),
                "max_tokens": 4,
                "stream": True,
            }
        )
        for r in reqs
    ]
    urls = [f"http://127.0.0.1:{9000 + i}" for i in range(BACKENDS)]
    transport = FakeTransport({u: [Scripted()] for u in urls})
    # without the router-side queue, as its committed results ran (the wait stage's cost: bench_queue)
    config = RouterConfig(backends=tuple(BackendSpec(u) for u in urls), port=0, router_queue=None)
    server = RouterServer(config, transport=transport, tokenizer=tok, background=False)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:

            async def send(body: bytes) -> None:
                async with session.post(
                    server.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
                ) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"router answered {r.status}")

            async def batch(items: list[bytes]) -> None:
                queue = list(reversed(items))

                async def worker() -> None:
                    while queue:
                        await send(queue.pop())

                await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

            await batch(bodies[:warmup])
            transport.calls.clear()
            transport.responses.clear()
            route0, n0 = server.proxy.route_seconds_sum, server.proxy.route_count
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await batch(bodies[warmup:])
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            routed = server.proxy.route_count - n0
            route_s = server.proxy.route_seconds_sum - route0
    finally:
        await server.stop()
    return {
        "requests": requests,
        "concurrency": CONCURRENCY,
        "cpu_us_per_request": cpu / requests * 1e6,
        "wall_us_per_request": wall / requests * 1e6,
        "routing_us_per_request": route_s / max(1, routed) * 1e6,
    }


def measure(requests: int = REQUESTS, warmup: int = WARMUP) -> dict[str, Any]:
    """One run (module docstring)."""
    return asyncio.run(_run(requests, warmup))


def main() -> int:
    out = measure()
    table(
        [
            ("process CPU per request (router + client), µs", f"{out['cpu_us_per_request']:.0f}", ""),
            ("wall per request, µs", f"{out['wall_us_per_request']:.0f}", ""),
            (
                "routing (parse + prepare + decide) per request, µs",
                f"{out['routing_us_per_request']:.0f}",
                "",
            ),
        ],
        headers=("metric", "measured", ""),
    )
    write("handler.json", out)
    return 0
