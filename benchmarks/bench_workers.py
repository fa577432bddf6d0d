"""`kvroute serve --workers 1` vs `--workers 2`: requests/s at the router's own limit, CPU per request.

Setup (all on loopback, every process on this machine's cores): 4 emulated engines (``kvroute engine``
subprocesses, time scale 1000, KV events on), as in ``bench_proxy``; two routers over them at once,
``kvroute serve --workers 1`` (one process, the default) and ``--workers 2`` (a supervisor and two
worker processes sharing the port and the in-flight table), both lmetric with the exact KV view from
the engines' events. The load generator is this process (``kvroute.loadgen``, open loop, every
response streamed, a new connection per request), with ``bench_proxy``'s chatbot prompts.

1. **Capacity**, interleaved: offered rates from ``RATES`` (req/s, ``STEP_S`` seconds each); at each
   rate every router still sustaining gets a step, in turn (the order alternates between rates), so
   that the shared machine's drifts fall on both alike; ``ROUNDS`` times over. A step is sustained
   when every request finishes and the last one within ``DRAIN_S`` s of the last arrival. Reported:
   the highest sustained rate per router (best of the rounds) and, per step, the CPU time (user +
   system, ``/proc``) per request of **the router** (all its processes: supervisor, workers,
   multiprocessing's resource tracker), **the load generator** and **the engines** — the other
   processes that competed for the same cores.
2. **Idle CPU** of each router (ms per second, no traffic): health checks, /metrics scrapes of the 4
   engines every 50 ms, per worker.
3. **KV event cost** (the choice between receiving events once per machine or once per worker, see
   :mod:`kvroute.server.workers`): µs to decode and to apply one engine event batch (the blocks one
   chatbot request newly stored), in process, over ``EVENT_REQUESTS`` requests.

Writes ``benchmarks/results/workers.json``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from benchmarks.bench_proxy import _cpu_seconds, _requests, _spawn, _stop, _wait_http
from benchmarks.common import write
from kvroute.loadgen import BlockText, run_bench
from kvroute.loadgen.runner import fetch_model
from kvroute.server.cluster import EngineCluster, free_port
from kvroute.tokenizer import load_tokenizer

INSTANCES = 4
TIME_SCALE = 1000.0
WORKERS = (1, 2)
RATES = (100, 200, 300, 400, 500, 600, 700, 800, 1000, 1200)
STEP_S = 3.0
DRAIN_S = 2.0
ROUNDS = 2
IDLE_S = 3.0
EVENT_REQUESTS = 600
EVENT_WARMUP = 100


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc/PID/task/TID/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                todo.extend(int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split())
    return out


def _cpu(pids: list[int]) -> float:
    """Summed user+system CPU seconds of ``pids`` (ones that are gone count 0)."""
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError, IndexError):
            total += _cpu_seconds(p)
    return total


async def _step(
    url: str, rate: int, text: BlockText, model: str, who: dict[str, list[int]]
) -> dict[str, Any]:
    reqs = _requests(int(rate * STEP_S), float(rate), seed=rate)
    c0 = {k: _cpu(v) for k, v in who.items()}
    res = await run_bench(url, reqs, text, model, drain_timeout_s=30.0)
    n = max(res.requests, 1)
    cpu = {k: round(1000.0 * (_cpu(v) - c0[k]) / n, 3) for k, v in who.items()}
    finished = res.requests - res.unfinished
    return {
        "offered_rps": rate,
        "requests": res.requests,
        "finished": finished,
        "wall_s": round(res.wall_seconds, 3),
        "achieved_rps": round(finished / max(res.wall_seconds, 1e-9), 1),
        "sustained": res.unfinished == 0 and res.wall_seconds <= reqs[-1].arrival + DRAIN_S,
        "ttft_p50_ms": res.recorder.summary()["ttft_ms"]["p50"],
        "cpu_ms_per_request": cpu,
    }


async def _measure() -> dict[str, Any]:
    tok = load_tokenizer()
    text = BlockText(tok)
    cluster = EngineCluster(
        INSTANCES, ["--time-scale", str(TIME_SCALE), "--kv-blocks", "65536"], kv_events=True
    )
    backends = await cluster.start()
    procs: dict[int, subprocess.Popen[bytes]] = {}
    urls: dict[int, str] = {}
    try:
        for w in WORKERS:
            port = free_port()
            cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--workers", str(w)]
            cmd += ["--policy", "lmetric", "--drain-grace", "0"]
            for b in backends:
                cmd += ["--backend", b.url, "--kv-events", f"{b.url}={b.kv_events}"]
            procs[w] = _spawn(cmd)
            urls[w] = f"http://127.0.0.1:{port}"
        for url in urls.values():
            await _wait_http(url, "/health")
        await asyncio.sleep(3.0)  # every worker up (the supervisor waits for them before it idles)
        trees = {w: _tree(p.pid) for w, p in procs.items()}
        engines = [e.proc.pid for e in cluster.engines]
        async with aiohttp.ClientSession() as session:
            model = await fetch_model(session, backends[0].url)
        out: dict[str, Any] = {"routers": {str(w): {"processes": len(trees[w])} for w in WORKERS}}
        i0 = {w: _cpu(t) for w, t in trees.items()}
        await asyncio.sleep(IDLE_S)
        for w, t in trees.items():
            out["routers"][str(w)]["idle_cpu_ms_per_s"] = round(1000.0 * (_cpu(t) - i0[w]) / IDLE_S, 1)
        for url in urls.values():  # warm-up (connections, caches)
            await run_bench(url, _requests(40, 50.0, seed=99), text, model)
        steps: dict[int, list[dict[str, Any]]] = {w: [] for w in WORKERS}
        for rnd in range(ROUNDS):
            alive = set(WORKERS)
            for i, rate in enumerate(RATES):
                order = [w for w in (WORKERS if (i + rnd) % 2 == 0 else WORKERS[::-1]) if w in alive]
                if not order:
                    break
                for w in order:
                    who = {"router": trees[w], "loadgen": [os.getpid()], "engines": engines}
                    st = await _step(urls[w], rate, text, model, who)
                    st["round"] = rnd
                    steps[w].append(st)
                    print(
                        f"  round {rnd} --workers {w}: {rate:5d} req/s offered: {st['finished']}/"
                        f"{st['requests']} in {st['wall_s']:.2f} s -> "
                        f"{'sustained' if st['sustained'] else 'NOT sustained'}; CPU ms/req "
                        + ", ".join(f"{k} {v:.2f}" for k, v in st["cpu_ms_per_request"].items()),
                        flush=True,
                    )
                    if not st["sustained"]:
                        alive.discard(w)
                    await asyncio.sleep(0.5)
        for w in WORKERS:
            r = out["routers"][str(w)]
            r["steps"] = steps[w]
            ok = [s for s in steps[w] if s["sustained"]]
            r["max_sustained_rps"] = max((s["offered_rps"] for s in ok), default=0)
            r["max_sustained_rps_per_round"] = [
                max((s["offered_rps"] for s in ok if s["round"] == rnd), default=0) for rnd in range(ROUNDS)
            ]
        common = min(out["routers"][str(w)]["max_sustained_rps"] for w in WORKERS)
        out["common_rate_rps"] = common
        for w in WORKERS:  # CPU per request at the highest rate both sustained (mean over rounds)
            at = [s for s in steps[w] if s["offered_rps"] == common and s["sustained"]]
            out["routers"][str(w)]["cpu_ms_per_request_at_common_rate"] = (
                {
                    k: round(statistics.fmean(s["cpu_ms_per_request"][k] for s in at), 3)
                    for k in at[0]["cpu_ms_per_request"]
                }
                if at
                else None
            )
        return out
    finally:
        for p in procs.values():
            _stop(p)
        cluster.stop()


def event_costs(requests: int = EVENT_REQUESTS, warmup: int = EVENT_WARMUP) -> dict[str, float]:
    """Mean µs to decode and to apply one KV event batch: the blocks each routed chatbot request newly
    stores on its engine (``bench_stages``' prompts, 4 exact backends, lmetric), in process."""
    from benchmarks.bench_stages import BACKENDS
    from kvroute.kvevents import BlockStored, decode_batch, encode_batch
    from kvroute.policies.registry import make_policy
    from kvroute.prepare.tokenize import RequestTokenizer
    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.server.stages.decide import decide
    from kvroute.server.stages.prepare import prepare_inline
    from kvroute.server.state.router import RouterState
    from kvroute.server.wire.validate import parse_request

    tok = load_tokenizer()
    text = BlockText(tok)
    config = RouterConfig(
        backends=tuple(
            BackendSpec(url=f"http://127.0.0.1:{9000 + i}", kv_events=f"tcp://127.0.0.1:{9100 + i}")
            for i in range(BACKENDS)
        )
    )
    core = RouterState(config, RequestTokenizer(tok, config.tokenizer_cache_entries), make_policy("lmetric"))
    bs = config.block_size
    stored: list[set[int]] = [set() for _ in range(BACKENDS)]
    dec, app, blocks = [], [], []
    for n, r in enumerate(_requests(requests, 20.0, seed=7)):
        prompt = text.prompt(r.block_ids, r.block_size, r.prompt_len, r.req_id)
        parsed = parse_request(orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 4}), False)
        prep = prepare_inline(core, parsed)
        ids = prep.ids
        plan = decide(core, parsed, prep, {})
        idx = plan.order[0]
        have = stored[idx]
        first = next((i for i, h in enumerate(plan.chain) if h not in have), len(plan.chain))
        new = plan.chain[first:]
        have.update(new)
        events = [
            BlockStored(
                block_hashes=new,
                parent_block_hash=plan.chain[first - 1] if first else None,
                token_ids=tuple(ids[first * bs : (first + len(new)) * bs]),
                block_size=bs,
            )
        ]
        payload = encode_batch(0.0, events if new else [])
        t0 = time.perf_counter()
        _ts, decoded, _rank = decode_batch(payload)
        t1 = time.perf_counter()
        core.kv.apply_events(idx, decoded)
        t2 = time.perf_counter()
        if n >= warmup:
            dec.append((t1 - t0) * 1e6)
            app.append((t2 - t1) * 1e6)
            blocks.append(len(new))
    return {
        "decode_us": round(statistics.fmean(dec), 2),
        "apply_us": round(statistics.fmean(app), 2),
        "blocks_per_batch": round(statistics.fmean(blocks), 2),
    }


def main() -> int:
    t0 = time.perf_counter()
    events = event_costs()
    print(
        f"KV event batch ({events['blocks_per_batch']:.0f} blocks): decode {events['decode_us']:.1f} µs, "
        f"apply {events['apply_us']:.1f} µs",
        flush=True,
    )
    try:
        import uvloop

        out = uvloop.run(_measure())
    except ImportError:
        out = asyncio.run(_measure())
    out["event_batch_us"] = events
    out["setup"] = {
        "instances": INSTANCES,
        "time_scale": TIME_SCALE,
        "rates": list(RATES),
        "step_s": STEP_S,
        "drain_s": DRAIN_S,
        "rounds": ROUNDS,
        "cpus": len(os.sched_getaffinity(0)),
        "competing": "the load generator (this process) and the 4 emulated engines run on the same cores "
        "as the router under test; the other router idles meanwhile",
    }
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    write("workers.json", out)
    print(
        "\n| router | processes | max sustained req/s (per round) | CPU ms/req at common rate: router "
        "| loadgen | engines | idle CPU ms/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for w, r in out["routers"].items():
        cpu = r["cpu_ms_per_request_at_common_rate"] or {}
        print(
            f"| --workers {w} | {r['processes']} | {r['max_sustained_rps']} ({r['max_sustained_rps_per_round']}) | "
            f"{cpu.get('router', float('nan')):.2f} | {cpu.get('loadgen', float('nan')):.2f} | "
            f"{cpu.get('engines', float('nan')):.2f} | {r['idle_cpu_ms_per_s']:.0f} |"
        )
    print(f"common rate (highest both sustained): {out['common_rate_rps']} req/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
