"""Router replicas: what sharing reservations between replicas (``--peers``) changes.

Scenario *herding* (:func:`herding`): 2 ``kvroute serve`` replicas (lmetric, exact KV view from the
engines' events) in front of 4 emulated engines (``kvroute engine`` subprocesses, time scale 1, the
default cost profile, KV events on). A burst of ``BURST`` concurrent requests, each a new conversation
(chat: one shared system prompt of about ``PREFIX_TOKENS`` tokens that no engine has seen, then a short
user message of its own), sent at once, alternately to each replica. Without ``--peers`` each replica
sees only its own requests in flight (and the engines' /metrics every 50 ms, and their KV events once a
prefill has stored blocks); with ``--peers`` each also sees the other's reservations (+1 waiting and the
queued prefill tokens on the backend it picked) as they are made. Reported per variant: requests per
backend (both replicas together, from their ``kvroute_backend_routed_total``), client TTFT mean, p50
and p99, and the share of prompt tokens the engines served from cache (their ``cached_tokens``).
The variants alternate for ``ROUNDS`` rounds; each round uses a new prefix, so no engine has it cached.

A second burst size, ``SMALL_BURST`` = 4 (one request per engine, 2 per replica), shows the case where
each replica's own counters are thin.

What it showed on the 2-core dev machine (one run, ``results/replicas.json``): no measurable
difference. With 64 requests each replica's own reservations already spread its half evenly (8 per
engine each, 16 in all, with or without peers), and the TTFT differences (mean 134 vs 142 ms) are
within the round-to-round spread (105-179 ms). With 4 requests both variants mostly sent 2 and 2 to
two engines: the two replicas decide within about a millisecond of each other, less than it takes a
reservation to reach the other replica on a loaded machine, so the broadcast cannot inform those
decisions; it matters for decisions further apart than its propagation delay (sub-millisecond on an
idle network). Co-locating 2 requests that share a new prefix is not costly here anyway (the second
one hits the first one's cache).

Everything runs on this machine's cores (on the 2-core dev machine: 4 engines, 2 routers and this
client share them); the machine notes in the JSON say how busy it was.

Writes ``benchmarks/results/replicas.json``. Further scenarios (e.g. ``--workers``) are meant to be
added as functions beside :func:`herding`, each returning its part of the JSON.
"""

from __future__ import annotations

import asyncio
import random
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import aiohttp
import orjson

from benchmarks.common import table, write
from kvroute.server.cluster import EngineCluster, free_port
from kvroute.server.config import BackendSpec
from kvroute.tokenizer import load_tokenizer

INSTANCES = 4
REPLICAS = 2
BURST = 64
PREFIX_TOKENS = 4096
OUTPUT_TOKENS = 16
ROUNDS = 2
SMALL_BURST = 4  # one request per engine: 2 per replica
SMALL_ROUNDS = 4
TIME_SCALE = 1.0
VARIANTS = ("no-peers", "peers")


def _prefix(seed: int) -> str:
    """About PREFIX_TOKENS tokens of text that no engine has seen (random words, seeded)."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        for _ in range(512)
    ]
    tok = load_tokenizer()
    text = ""
    while len(tok.encode(text)) < PREFIX_TOKENS:
        text += " ".join(rng.choice(words) for _ in range(400)) + ". "
    return text


def _spawn_router(backends: tuple[BackendSpec, ...], port: int, flags: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--policy", "lmetric"]
    for b in backends:
        cmd += ["--backend", b.url, "--kv-events", f"{b.url}={b.kv_events}"]
        if b.kv_replay:
            cmd += ["--kv-replay", f"{b.url}={b.kv_replay}"]
    return subprocess.Popen(
        [*cmd, *flags], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


async def _metrics(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    """``name``'s samples on ``url``/metrics by their ``backend`` label (or "" without labels)."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            key = line.split('backend="', 1)[1].split('"', 1)[0] if 'backend="' in line else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _one(session: aiohttp.ClientSession, url: str, system: str, i: int) -> tuple[float, int, int]:
    """One streamed conversation start: (TTFT seconds, prompt tokens, cached tokens)."""
    body = {
        "model": "emu",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Conversation {i}: summarise the above in your own words, please."},
        ],
        "max_tokens": OUTPUT_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    prompt = cached = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: status {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
            event = orjson.loads(line[6:])
            usage = event.get("usage")
            if usage:
                prompt = usage.get("prompt_tokens", 0)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if ttft is None:
        raise RuntimeError(f"{url}: empty stream")
    return ttft, prompt, cached


async def _burst(urls: list[str], backends: tuple[BackendSpec, ...], burst: int, seed: int) -> dict[str, Any]:
    """One burst through the replicas at ``urls``; per-backend counts, TTFTs, cache hit share."""
    system = _prefix(seed)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as s:
        before = [await _metrics(s, u, "kvroute_backend_routed_total") for u in urls]
        results = await asyncio.gather(*(_one(s, urls[i % len(urls)], system, i) for i in range(burst)))
        after = [await _metrics(s, u, "kvroute_backend_routed_total") for u in urls]
    counts = [
        int(sum(a.get(b.url, 0.0) - p.get(b.url, 0.0) for a, p in zip(after, before, strict=True)))
        for b in backends
    ]
    ttfts = sorted(r[0] * 1000.0 for r in results)
    return {
        "per_backend": counts,
        "ttft_ms": ttfts,
        "prompt_tokens": sum(r[1] for r in results),
        "cached_tokens": sum(r[2] for r in results),
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = sorted(t for r in runs for t in r["ttft_ms"])
    prompt = sum(r["prompt_tokens"] for r in runs)
    return {
        "per_backend_by_round": [r["per_backend"] for r in runs],
        "ttft_ms": {
            "mean": round(statistics.fmean(ttfts), 1),
            "p50": round(ttfts[len(ttfts) // 2], 1),
            "p99": round(ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))], 1),
            "max": round(ttfts[-1], 1),
        },
        "kv_hit_rate": round(sum(r["cached_tokens"] for r in runs) / prompt, 3) if prompt else None,
        "requests": len(ttfts),
    }


async def herding(backends: tuple[BackendSpec, ...], burst: int, rounds: int, seed: int) -> dict[str, Any]:
    """The herding scenario (see the module docstring): ``rounds`` bursts of ``burst`` requests per
    variant, the variants alternating (fresh replicas each time, a new prefix each burst)."""
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rnd in range(rounds):
        for variant in VARIANTS:
            ports = [free_port() for _ in range(REPLICAS)]
            binds = [f"tcp://127.0.0.1:{free_port()}" for _ in range(REPLICAS)]
            procs = []
            for k in range(REPLICAS):
                flags = ["--peer-bind", binds[k], "--peers", ",".join(binds)] if variant == "peers" else []
                procs.append(_spawn_router(backends, ports[k], flags))
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            try:
                await asyncio.gather(*(_healthy(u) for u in urls))
                await asyncio.sleep(2.0)  # KV event subscriptions, first scrapes, peers' first refresh
                res = await _burst(urls, backends, burst, seed=seed + 1000 * rnd + VARIANTS.index(variant))
            finally:
                for p in procs:
                    _stop(p)
            runs[variant].append(res)
            ttft = statistics.fmean(res["ttft_ms"])
            print(
                f"  burst {burst} round {rnd + 1} {variant:8s}: per backend {res['per_backend']}, "
                f"TTFT mean {ttft:.0f} ms, max {res['ttft_ms'][-1]:.0f} ms",
                flush=True,
            )
            await asyncio.sleep(1.0)
    return {
        "setup": {
            "replicas": REPLICAS,
            "engines": INSTANCES,
            "burst": burst,
            "prefix_tokens": PREFIX_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "rounds": rounds,
            "engine_time_scale": TIME_SCALE,
            "policy": "lmetric",
            "competing_for_cores": f"{INSTANCES} engine processes, {REPLICAS} router processes, the client",
        },
        "variants": {v: _summary(r) for v, r in runs.items()},
    }


async def _scenarios() -> dict[str, Any]:
    cluster = EngineCluster(INSTANCES, ["--time-scale", str(TIME_SCALE), "--model", "emu"], kv_events=True)
    backends = await cluster.start()
    try:
        return {
            "herding": await herding(backends, BURST, ROUNDS, seed=1),
            "herding_small": await herding(backends, SMALL_BURST, SMALL_ROUNDS, seed=2),
        }
    finally:
        cluster.stop()


def main() -> int:
    t0 = time.perf_counter()
    result: dict[str, Any] = asyncio.run(_scenarios())
    rows = []
    for name in ("herding", "herding_small"):
        for v, s in result[name]["variants"].items():
            counts = " / ".join(",".join(str(c) for c in r) for r in s["per_backend_by_round"])
            t = s["ttft_ms"]
            rows.append(
                (
                    f"{result[name]['setup']['burst']} req, {v}",
                    counts,
                    f"{t['mean']:.0f} / {t['p50']:.0f} / {t['p99']:.0f}",
                    f"{s['kv_hit_rate']:.2f}",
                )
            )
    table(rows, ("burst", "requests per backend (by round)", "TTFT mean / p50 / p99 ms", "KV hit"))
    result["wall_seconds"] = round(time.perf_counter() - t0, 1)
    write("replicas.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
