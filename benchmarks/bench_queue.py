"""The router-side queue's cost and the design's batched decisions (§3.1), on the live router's code.

CPU per request of the decide stage in one process (no HTTP; the setup of ``bench_stages``: a
:class:`~kvroute.server.state.router.RouterState` with 4 backends, exact KV views, ``lmetric``, the
bundled tokenizer, the proxy benchmark's prompts), measured with ``time.process_time`` over
``REQUESTS`` requests, each followed by a lease on its first choice (taken and released, as the
reserve stage does):

- ``direct``: the decide stage (``--router-queue`` off), in a task of its own per request (the
  handler's task, which the other modes have too);
- ``queue``: through the wait stage (:class:`~kvroute.server.stages.wait.WaitingRoom`), ``tick_s`` 0:
  nothing saturated, so each request is routed at once (the queue's overhead);
- ``tick/k``: ``tick_s`` > 0, ``k`` requests arriving within one tick, decided together by one drain
  (each still routed against the views with the holds of those before it).

The TTFT cost of ticks comes from the simulator (the same queue code): ``kvroute sim`` on ``chatbot``
(4 instances, 60 s, rate ×1) with ``--router-queue --queue-tick 0.01`` against ``--router-queue``:
a request waits for the next tick boundary, half a tick on average. Writes
``benchmarks/results/queue.json``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import orjson

from benchmarks.bench_proxy import _requests
from benchmarks.common import table, write
from kvroute.loadgen import BlockText
from kvroute.policies.registry import make_policy
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.queue import QueueConfig
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.stages.decide import decide
from kvroute.server.stages.prepare import Prepared, extra_key, hashed, split
from kvroute.server.stages.wait import WaitingRoom
from kvroute.server.state.backends import Lease
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import ParsedRequest, parse_request
from kvroute.sim.runner import RunSpec, run_spec
from kvroute.tokenizer import load_tokenizer

REQUESTS = 800
BACKENDS = 4
BATCHES = (1, 8, 32)
TICK_S = 0.01


def _state() -> tuple[RouterState, list[tuple[ParsedRequest, Prepared]]]:
    tok = load_tokenizer()
    text = BlockText(tok)
    config = RouterConfig(
        backends=tuple(
            BackendSpec(url=f"http://127.0.0.1:{9000 + i}", kv_events=f"tcp://127.0.0.1:{9100 + i}")
            for i in range(BACKENDS)
        ),
    )
    state = RouterState(config, RequestTokenizer(tok, config.tokenizer_cache_entries), make_policy("lmetric"))
    prepared = []
    for r in _requests(REQUESTS, 20.0, seed=7):
        raw = orjson.dumps(
            {
                "model": "m",
                "prompt": text.prompt(r.block_ids, r.block_size, r.prompt_len, r.req_id),
                "max_tokens": 4,
            }
        )
        parsed = parse_request(raw, False)
        key = extra_key(state, parsed)
        pending = split(state, parsed)
        ids, chain = hashed(state, state.tokenizer.finish_pieces(pending), pending.suffix, key)
        prepared.append((parsed, Prepared(key, ids, chain)))
    return state, prepared


def _lease(state: RouterState, plan: Any) -> None:
    first = plan.order[0]
    Lease(state.backends[first], plan.new_prefill[first], 1).release()


async def direct(state: RouterState, reqs: list[tuple[ParsedRequest, Prepared]]) -> float:
    """The decide stage per request, each in its own task (as each request has its handler task)."""

    async def one(parsed: ParsedRequest, prep: Prepared) -> None:
        _lease(state, decide(state, parsed, prep, {}))

    t0 = time.process_time()
    for parsed, prep in reqs:
        await asyncio.gather(asyncio.ensure_future(one(parsed, prep)))
    return (time.process_time() - t0) / len(reqs) * 1e6


async def queued(
    state: RouterState, reqs: list[tuple[ParsedRequest, Prepared]], batch: int, tick: float
) -> float:
    room = WaitingRoom(state, QueueConfig(tick_s=tick))
    t0 = time.process_time()
    for i in range(0, len(reqs), batch):
        tasks = [asyncio.ensure_future(room.decide(p, prep, {})) for p, prep in reqs[i : i + batch]]
        await asyncio.sleep(0)  # every task offered its request
        if tick:
            room._drain()  # the tick (its timer would fire it)
        for plan, hold in await asyncio.gather(*tasks):
            if hold is not None:
                hold.release()
            _lease(state, plan)
    if room._timer is not None:
        room._timer.cancel()
    return (time.process_time() - t0) / len(reqs) * 1e6


def ttft_cost() -> dict[str, Any]:
    base = RunSpec(policy="lmetric", instances=4, workload="chatbot", rate_scale=1.0, duration=60.0)
    out = {}
    for name, q in (("queue", QueueConfig()), ("tick", QueueConfig(tick_s=TICK_S))):
        r = run_spec(RunSpec(**{**{f: getattr(base, f) for f in base.__slots__}, "router_queue": q}))
        out[name] = {"ttft_mean_ms": r["ttft_ms"]["mean"], "ttft_p99_ms": r["ttft_ms"]["p99"]}
    return out


def main() -> int:
    state, reqs = _state()
    asyncio.run(direct(state, reqs[:100]))  # warm-up
    rounds: dict[str, list[float]] = {"direct": [], "queue": []}
    rounds |= {f"tick/{k}": [] for k in BATCHES}
    for _ in range(3):  # interleaved, to share the machine's load
        rounds["direct"].append(asyncio.run(direct(state, reqs)))
        rounds["queue"].append(asyncio.run(queued(state, reqs, 1, 0.0)))
        for k in BATCHES:
            rounds[f"tick/{k}"].append(asyncio.run(queued(state, reqs, k, TICK_S)))
    cpu = {name: statistics.median(v) for name, v in rounds.items()}
    ttft = ttft_cost()
    rows = [(f"decide CPU per request, {name} (µs)", f"{us:.1f}", "") for name, us in cpu.items()]
    rows += [
        (f"sim TTFT mean / p99 with {name} (ms)", f"{v['ttft_mean_ms']:.1f} / {v['ttft_p99_ms']:.1f}", "")
        for name, v in ttft.items()
    ]
    table(rows)
    write(
        "queue.json",
        {
            "requests": REQUESTS,
            "backends": BACKENDS,
            "cpu_us_per_request": cpu,
            "rounds": rounds,
            "tick_s": TICK_S,
            "sim_ttft": ttft,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
