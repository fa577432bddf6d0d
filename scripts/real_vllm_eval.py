"""kvroute in front of two real vLLM servers (the CPU build): evidence for docs/results/real-vllm.md.

    python scripts/real_vllm_eval.py --venv .venv-vllm --model .venv-vllm/tiny-qwen3   (make vllm-eval)

Starts two ``vllm serve`` (:mod:`kvroute.integrations.vllm_launch`: prefix caching, KV events with
replay, prompt token details; ``--block-size`` tokens per block, 128 by default as on the CPU build,
``--kv-blocks`` blocks each), then, for each round and each policy in turn (interleaved:
``lmetric-kv``, ``llm-d``, ``round-robin``, then again; ``--policies``), and for each
``--router-src LABEL=DIR`` in turn within a policy (kvroute from another source folder, e.g. an older
commit's ``src``: a before/after on the same engines), starts ``kvroute serve`` (16-token blocks) as its
own process in front of both (the exact view from the
engines' events, the model folder's tokenizer), replays the ``multiturn`` workload through it open
loop (``--duration`` seconds of arrivals, ``--users`` conversations at once; every request a
streamed ``/v1/completions`` with ``ignore_eos``; each run's prompt text is its own, so no run hits
another's cache), and stops the router. Measured per run:

- vLLM's own prefix-cache hit rate: the change of ``vllm:prefix_cache_hits_total`` over
  ``vllm:prefix_cache_queries_total``, both engines summed, over the run;
- the router's prediction error: ``x-kvroute-cached-tokens`` (predicted) − ``usage``'s
  ``cached_tokens`` (vLLM's), per response: its distribution;
- the router's CPU per request: user + system CPU seconds of the router process over the run
  (``/proc/PID/stat``, its idle background work included) / requests answered;
- the scrape cost on the engines: CPU seconds per second of each vLLM API server process (the
  ``vllm serve`` process; the engine core is a child and not counted) over ``--idle`` seconds with
  no router, then with the router attached and idle (its scrapes and health checks are the only
  traffic), and over the run under load;
- why a prediction differs from what vLLM served: the script subscribes to the engines' KV events
  itself and keeps vLLM's prefix cache as they describe it (engine blocks, their copies, the salt in
  a prompt's first block). For each request, the engine blocks of its prompt that the events
  received *before it was sent* say are cached (vLLM's own rule: whole engine blocks, never the
  prompt's last token) is the prediction a router with a perfect view of the events would make.
  A router prediction equal to it but not to what vLLM served is vLLM's timing (the cache changed
  between the decision and the scheduling: blocks of requests still in flight, whose events come
  after their step, or evictions after the decision); one that differs from it is the router's.

Half the conversations (odd session ids) carry a ``cache_salt`` of their own. A last case, the
*salted chat*, runs on one engine with ``lmetric-kv``: two chats under one ``cache_salt`` sharing a
system prompt, then fillers sent to the engine directly, each followed by the second chat again,
until the engine has cycled its KV pool (the first chat's first block is evicted, the second's
stays): every round's prediction against what vLLM served.

Writes ``--out`` (markdown) and the same numbers as JSON beside it (``.json``). The machine and its
load (the 1-minute load average before and after) are recorded: on a shared machine the latencies and
CPU figures move with the neighbours' load; the prediction error and the hit rates do not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvroute.engine.types import BlockRemoved, BlockStored, KVEvent  # noqa: E402
from kvroute.integrations.vllm_launch import (  # noqa: E402
    VllmProcess,
    VllmSettings,
    find_vllm,
    free_port,
    start_fleet,
    stop_all,
)
from kvroute.kvevents import decode_batch  # noqa: E402
from kvroute.loadgen.text import BlockText  # noqa: E402
from kvroute.tokenizer import load_tokenizer  # noqa: E402
from kvroute.workloads.synthetic import make_workload  # noqa: E402

POLICIES = ("lmetric-kv", "llm-d", "round-robin")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def counters(url: str) -> dict[str, float]:
    """vLLM's prefix-cache counters (tokens) from one /metrics page."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        for key, name in (
            ("hits", "vllm:prefix_cache_hits_total"),
            ("queries", "vllm:prefix_cache_queries_total"),
        ):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


class EventLog:
    """Every KV event batch the engines publish, with the monotonic time it arrived here (a SUB
    socket of our own per engine, on the running event loop)."""

    def __init__(self, endpoints: list[str]) -> None:
        self.batches: list[tuple[float, int, list[KVEvent]]] = []
        self._ctx = zmq.asyncio.Context()
        self._socks = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(ep)
            self._socks.append(sock)
        self._tasks = [asyncio.create_task(self._run(i, s)) for i, s in enumerate(self._socks)]

    async def _run(self, engine: int, sock: Any) -> None:
        while True:
            parts = await sock.recv_multipart()
            self.batches.append((time.monotonic(), engine, decode_batch(parts[-1])[1]))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in self._socks:
            sock.close(0)
        self._ctx.term()


class EngineCache:
    """vLLM's prefix cache of one engine as its KV events describe it: engine blocks by hash (with
    their copies), findable by (parent hash, tokens, the salt of a prompt's first block)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, tuple[int | None, tuple[int, ...], str | None]]] = {}
        self.index: dict[tuple[int | None, tuple[int, ...], str | None], set[int]] = {}

    def apply(self, ev: KVEvent) -> None:
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            ebs = ev.block_size
            for i, eh in enumerate(ev.block_hashes):
                keys = ev.extra_keys[i] if ev.extra_keys else None
                key = (parent, tuple(ev.token_ids[i * ebs : (i + 1) * ebs]), str(keys[0]) if keys else None)
                copies, _ = self.blocks.get(eh, (0, key))
                self.blocks[eh] = (copies + 1, key)
                self.index.setdefault(key, set()).add(eh)
                parent = eh
        elif isinstance(ev, BlockRemoved):
            for eh in ev.block_hashes:
                held = self.blocks.get(eh)
                if held is None:
                    continue
                copies, key = held
                if copies > 1:
                    self.blocks[eh] = (copies - 1, key)
                    continue
                del self.blocks[eh]
                hashes = self.index.get(key)
                if hashes is not None:
                    hashes.discard(eh)
                    if not hashes:
                        del self.index[key]
        else:  # AllBlocksCleared
            self.blocks.clear()
            self.index.clear()

    def hit(self, ids: list[int], salt: str | None, ebs: int) -> int:
        """Prompt tokens vLLM would serve from this cache: whole engine blocks, never the last token."""
        parent: int | None = None
        n = 0
        while n < (len(ids) - 1) // ebs:
            found = self.index.get((parent, tuple(ids[n * ebs : (n + 1) * ebs]), salt if n == 0 else None))
            if not found:
                break
            parent = next(iter(found))
            n += 1
        return n * ebs


def explain(recs: list[dict[str, Any]], log: EventLog, engines: int, ebs: int) -> dict[str, Any]:
    """For each answered request, the prediction a perfect view of the events received before it was
    sent would make (``events_before``), and why the router's prediction differs from vLLM's."""
    caches = [EngineCache() for _ in range(engines)]
    batches = sorted(log.batches, key=lambda b: b[0])
    k = 0
    out: Counter[str] = Counter()
    router_off: list[dict[str, int]] = []
    for rec in sorted((r for r in recs if r["ok"] and r["engine"] >= 0), key=lambda r: r["t_send"]):
        while k < len(batches) and batches[k][0] <= rec["t_send"]:
            _, i, events = batches[k]
            for ev in events:
                caches[i].apply(ev)
            k += 1
        before = caches[rec["engine"]].hit(rec["ids"], rec.get("salt"), ebs)
        if rec["predicted"] == rec["cached"]:
            out["exact"] += 1
        elif rec["predicted"] == before:
            out["vllm_after_decision"] += 1
        else:
            out["view_differs_from_events"] += 1
            router_off.append(
                {"predicted": rec["predicted"], "events_before": before, "served": rec["cached"]}
            )
    return {"classes": dict(out), "view_differs": router_off[:20]}


async def chat_conversations(
    url: str, procs: list[VllmProcess], tok: Any, model: str, run: int, convs: int, turns: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``convs`` chat conversations at once, ``turns`` turns each, every turn sent as soon as the
    last reply came (each carrying the replies as vLLM gave them); every third conversation shares a
    system prompt, odd ones carry a ``cache_salt`` of their own. Records and :func:`explain`'s account."""
    out: list[dict[str, Any]] = []
    log = EventLog([p.endpoint.kv_events for p in procs])
    await asyncio.sleep(0.5)
    headers = {"content-type": "application/json"}

    async def conversation(http: aiohttp.ClientSession, c: int) -> None:
        history = [{"role": "system", "content": words(run * 1000 + c % 3, 60)}]
        salt = f"c{run}-{c}" if c % 2 else None
        await asyncio.sleep(c * 0.2)
        for t in range(turns):
            history.append({"role": "user", "content": words(run * 1000 + 100 + c * 50 + t, 40)})
            body: dict[str, Any] = {"model": model, "messages": history, "max_tokens": 16, "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            rec: dict[str, Any] = {"ok": False, "salt": salt, "ids": tok.encode_chat(history)}
            rec["t_send"] = time.monotonic()
            async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as r:
                data = await r.json(content_type=None)
                rec["backend"] = r.headers.get("x-kvroute-backend", "")
                rec["predicted"] = int(r.headers.get("x-kvroute-cached-tokens", "-1"))
            out.append(rec)
            if r.status != 200:
                return
            usage = data["usage"]
            rec |= {
                "ok": True,
                "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
            }
            rec["prompt"] = usage["prompt_tokens"]
            history.append({"role": "assistant", "content": data["choices"][0]["message"]["content"] or "ok"})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await asyncio.gather(*(conversation(http, c) for c in range(convs)))
    await asyncio.sleep(1.0)
    await log.close()
    urls = [p.url for p in procs]
    for rec in out:
        rec["engine"] = urls.index(rec["backend"]) if rec.get("backend") in urls else -1
    return out, explain(out, log, len(procs), procs[0].settings.block_size or 128)


def api_cpu_rate(procs: list[VllmProcess], seconds: float) -> list[float]:
    """CPU seconds per second of each API server over the next ``seconds``."""
    before = [cpu_seconds(p.proc.pid) for p in procs]
    time.sleep(seconds)
    return [(cpu_seconds(p.proc.pid) - b) / seconds for p, b in zip(procs, before, strict=True)]


def start_router(
    procs: list[VllmProcess], policy: str, model: str, log: Path, src: Path = ROOT / "src"
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--policy", policy]
    argv += ["--tokenizer", model, "--explain"]
    for p in procs:
        argv += ["--backend", p.url, "--kv-events", f"{p.url}={p.endpoint.kv_events}"]
        argv += ["--kv-replay", f"{p.url}={p.endpoint.kv_replay}"]
    env = dict(os.environ, PYTHONPATH=str(src))
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvroute serve exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"kvroute serve did not start; see {log}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one(
    http: aiohttp.ClientSession, url: str, body: bytes, out: list[dict[str, Any]], rec: dict[str, Any]
) -> None:
    t0 = time.perf_counter()
    rec |= {"ok": False, "t_send": time.monotonic()}
    try:
        async with http.post(
            url + "/v1/completions", data=body, headers={"content-type": "application/json"}
        ) as r:
            rec["status"] = r.status
            rec["predicted"] = int(r.headers.get("x-kvroute-cached-tokens", "-1"))
            rec["backend"] = r.headers.get("x-kvroute-backend", "")
            usage = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    obj = orjson.loads(line[6:])
                    if "ttft" not in rec and obj.get("choices") and obj["choices"][0].get("text"):
                        rec["ttft"] = time.perf_counter() - t0
                    if obj.get("usage"):
                        usage = obj["usage"]
        if r.status == 200 and usage is not None:
            rec.update(
                ok=True,
                prompt=usage["prompt_tokens"],
                cached=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                e2e=time.perf_counter() - t0,
            )
    except (aiohttp.ClientError, OSError) as exc:
        rec["error"] = type(exc).__name__
    out.append(rec)


async def replay(
    url: str, requests: list[Any], text: BlockText, model: str, run: int, procs: list[VllmProcess]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The workload through the router; the requests' records and :func:`explain`'s account."""
    out: list[dict[str, Any]] = []
    offset = (run + 1) << 40  # each run's own text: no run hits another's cache
    prompts = [
        text.prompt([b + offset for b in req.block_ids], req.block_size, req.prompt_len, req.req_id + offset)
        for req in requests
    ]
    ids = text.tokenizer.encode_many(prompts)
    log = EventLog([p.endpoint.kv_events for p in procs])
    await asyncio.sleep(0.5)  # the SUB sockets join
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = []
        start = time.perf_counter()
        for req, prompt, toks in zip(requests, prompts, ids, strict=True):
            salt = f"s{run}-{req.session}" if req.session % 2 else None
            fields: dict[str, Any] = {
                "model": model,
                "prompt": prompt,
                "max_tokens": req.output_len,
                "min_tokens": req.output_len,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if salt is not None:
                fields["cache_salt"] = salt
            delay = start + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = {"ids": toks, "salt": salt}
            tasks.append(asyncio.create_task(one(http, url, orjson.dumps(fields), out, rec)))
        await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)  # the last events in
    await log.close()
    urls = [p.url for p in procs]
    for rec in out:
        rec["engine"] = urls.index(rec["backend"]) if rec.get("backend") in urls else -1
    return out, explain(out, log, len(procs), procs[0].settings.block_size or 128)


def words(seed: int, n: int) -> str:
    """``n`` words of text of its own for ``seed``."""
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(n))


async def salted_chat(
    url: str, engine: VllmProcess, model: str, pool_tokens: int, run: int
) -> list[dict[str, int]]:
    """The salted-chat case (module docstring) through the router at ``url`` (in front of
    ``engine`` alone): one record per round, predicted and served cached tokens."""
    salt = f"tenant-{run}"
    system = {"role": "system", "content": words(run * 100, 12)}
    rounds: list[dict[str, int]] = []
    timeout = aiohttp.ClientTimeout(total=600)
    headers = {"content-type": "application/json"}

    async def ask(
        http: aiohttp.ClientSession, target: str, path: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        async with http.post(target + path, data=orjson.dumps(body), headers=headers) as r:
            data = await r.json(content_type=None)
            if r.status != 200:
                raise RuntimeError(f"{path}: {r.status} {data}")
            usage = data["usage"]
            return {
                "predicted": int(r.headers.get("x-kvroute-cached-tokens", "-1")),
                "cached": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                "prompt": usage["prompt_tokens"],
            }

    def chat(user: str) -> dict[str, Any]:
        msgs = [system, {"role": "user", "content": user}]
        return {"model": model, "messages": msgs, "max_tokens": 1, "cache_salt": salt}

    async with aiohttp.ClientSession(timeout=timeout) as http:
        await ask(http, url, "/v1/chat/completions", chat(words(run * 100 + 1, 60)))
        body = chat(words(run * 100 + 2, 150))
        await ask(http, url, "/v1/chat/completions", body)
        filler = 0
        for i in range(60):
            await asyncio.sleep(0.5)  # the engine's events in
            rounds.append({"round": i, **await ask(http, url, "/v1/chat/completions", body)})
            if filler > 2 * pool_tokens:
                break
            f = await ask(
                http,
                engine.url,
                "/v1/completions",
                {"model": model, "prompt": words(run * 100 + 10 + i, 220), "max_tokens": 1},
            )
            filler += f["prompt"]
    return rounds


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--model", default=str(ROOT / ".venv-vllm" / "tiny-qwen3"))
    ap.add_argument(
        "--block-size", type=int, default=128, help="engine block size (default 128: the CPU build's)"
    )
    ap.add_argument(
        "--kv-blocks", type=int, default=0, help="KV blocks per engine (default: 16,384 tokens' worth)"
    )
    ap.add_argument(
        "--chat",
        default="12x8",
        metavar="CONVSxTURNS",
        help="the concurrent multi-turn chat case, per router source (default 12x8; 0 to skip)",
    )
    ap.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated (default {','.join(POLICIES)})"
    )
    ap.add_argument(
        "--router-src",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="run kvroute from this source folder (its src/), labelled LABEL; repeatable: the runs interleave "
        "them round by round, policy by policy, on the same engines (default: this checkout's)",
    )
    ap.add_argument("--users", type=int, default=12, help="conversations alive at once (default 12)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run (default 60)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds per idle CPU window (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "real-vllm.md"))
    args = ap.parse_args(argv)
    if not args.kv_blocks:
        args.kv_blocks = 16384 // args.block_size
    policies = [p for p in args.policies.split(",") if p]
    sources = [(lab, Path(d).absolute()) for lab, _, d in (x.partition("=") for x in args.router_src)]
    sources = sources or [("this", ROOT / "src")]
    exe = find_vllm(args.venv)
    if exe is None or not (Path(args.model) / "config.json").is_file():
        print(
            f"real_vllm_eval: no vllm in {args.venv} or no model at {args.model} (make vllm-venv)",
            file=sys.stderr,
        )
        return 2
    model = str(Path(args.model).absolute())
    tok = load_tokenizer(model)
    text = BlockText(tok)
    # the multiturn workload with --users conversations alive at once (about users / 5.6 requests/s:
    # 5 s think time between a conversation's turns), contexts capped to fit --max-model-len
    max_len = 8192
    stream = make_workload(
        "multiturn", args.seed, 1.0, args.duration, users=args.users, max_context_tokens=max_len - 512
    )
    requests = [r for r in stream if r.prompt_len + r.output_len <= max_len]
    logs = Path(args.out).with_suffix(".logs")
    logs.mkdir(parents=True, exist_ok=True)
    settings = [
        VllmSettings(
            vllm=exe.absolute(),
            model=model,
            served_model_name="tiny",
            block_size=args.block_size,
            num_blocks=args.kv_blocks,
            max_model_len=max_len,
            kv_cache_bytes=256 << 20,
        )
        for _ in range(2)
    ]
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared), Python {platform.python_version()}",
        "vllm": subprocess.run(
            [str(exe), "--version"],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
        )
        .stdout.strip()
        .splitlines()[-1:],
        "model": "tiny random-weight Qwen3 (scripts/tiny_qwen3/config.json)",
        "engines": {
            "count": 2,
            "block_size": args.block_size,
            "kv_blocks": args.kv_blocks,
        },
        "workload": {
            "name": "multiturn",
            "seed": args.seed,
            "users": args.users,
            "rate": round(len(requests) / args.duration, 2),
            "duration_s": args.duration,
            "requests": len(requests),
        },
        "runs": [],
    }
    load_before = os.getloadavg()[0]
    t_start = time.monotonic()
    procs = start_fleet(settings, logs)
    startup_s = time.monotonic() - t_start
    result["engines"]["startup_s"] = round(startup_s, 1)
    result["load_avg_1m_before"] = load_before
    try:
        idle_alone = api_cpu_rate(procs, args.idle)
        result["api_cpu_idle_no_router"] = idle_alone
        run = 0
        for rnd in range(args.rounds):
            for (label, src), policy in [(s, p) for p in policies for s in sources]:
                log = logs / f"router-{rnd}-{policy}-{label}.log"
                router, url = start_router(procs, policy, model, log, src)
                try:
                    time.sleep(2.0)  # subscriptions join, first scrapes
                    idle_router = api_cpu_rate(procs, args.idle) if rnd == 0 and run == 0 else None
                    c0 = [counters(p.url) for p in procs]
                    a0 = [cpu_seconds(p.proc.pid) for p in procs]
                    r0, t0 = cpu_seconds(router.pid), time.monotonic()
                    recs, why = asyncio.run(replay(url, requests, text, "tiny", run, procs))
                    r1, t1 = cpu_seconds(router.pid), time.monotonic()
                    a1 = [cpu_seconds(p.proc.pid) for p in procs]
                    c1 = [counters(p.url) for p in procs]
                finally:
                    stop(router)
                ok = [r for r in recs if r["ok"]]
                diffs = [r["predicted"] - r["cached"] for r in ok]
                hits = sum(b["hits"] - a["hits"] for a, b in zip(c0, c1, strict=True))
                queries = sum(b["queries"] - a["queries"] for a, b in zip(c0, c1, strict=True))
                row = {
                    "round": rnd,
                    "policy": policy,
                    "router": label,
                    "requests": len(recs),
                    "ok": len(ok),
                    "errors": dict(
                        Counter(r.get("error") or f"http_{r.get('status')}" for r in recs if not r["ok"])
                    ),
                    "vllm_prefix_cache_hit_rate": hits / queries if queries else None,
                    "client_cached_share": sum(r["cached"] for r in ok)
                    / max(1, sum(r["prompt"] for r in ok)),
                    "pred_minus_real": {str(k): v for k, v in sorted(Counter(diffs).items())},
                    "pred_exact_share": sum(1 for d in diffs if d == 0) / max(1, len(diffs)),
                    "router_cpu_ms_per_request": (r1 - r0) * 1e3 / max(1, len(ok)),
                    "wall_s": t1 - t0,
                    "api_cpu_s_per_s_under_load": [(b - a) / (t1 - t0) for a, b in zip(a0, a1, strict=True)],
                    "ttft_ms_p50": pct([r["ttft"] * 1e3 for r in ok if "ttft" in r], 0.5),
                    "ttft_ms_p90": pct([r["ttft"] * 1e3 for r in ok if "ttft" in r], 0.9),
                    "per_engine": dict(Counter(procs_index(procs, r["backend"]) for r in ok)),
                    "salted_requests": sum(1 for r in ok if r.get("salt")),
                    "why": why,
                }
                if idle_router is not None:
                    result["api_cpu_idle_router_attached"] = idle_router
                result["runs"].append(row)
                write(result, args.out, argv)  # after every run: a cut-short evaluation keeps its runs
                print(
                    json.dumps(
                        {
                            k: row[k]
                            for k in (
                                "round",
                                "policy",
                                "ok",
                                "vllm_prefix_cache_hit_rate",
                                "pred_exact_share",
                                "router_cpu_ms_per_request",
                                "why",
                            )
                        }
                    ),
                    flush=True,
                )
                run += 1
        # concurrent multi-turn chats over both engines (round-robin: both serve), each source in turn
        result["chat"] = []
        convs, _, turns = args.chat.partition("x")
        for label, src in sources if int(convs) > 0 else ():
            log = logs / f"router-chat-{label}.log"
            router, url = start_router(procs, "round-robin", model, log, src)
            try:
                time.sleep(2.0)
                recs, why = asyncio.run(
                    chat_conversations(url, procs, tok, "tiny", run, int(convs), int(turns or 8))
                )
            finally:
                stop(router)
            run += 1
            ok = [r for r in recs if r["ok"]]
            off = Counter(r["predicted"] - r["cached"] for r in ok)
            result["chat"].append(
                {
                    "router": label,
                    "conversations": int(convs),
                    "turns": int(turns or 8),
                    "requests": len(recs),
                    "ok": len(ok),
                    "salted_requests": sum(1 for r in ok if r.get("salt")),
                    "pred_minus_real": {str(k): v for k, v in sorted(off.items())},
                    "why": why,
                }
            )
            write(result, args.out, argv)
            print(json.dumps({"chat": result["chat"][-1]}), flush=True)
        # the salted chat on engine 0 alone, each router source in turn
        result["salted_chat"] = []
        for label, src in sources:
            log = logs / f"router-salted-{label}.log"
            router, url = start_router(procs[:1], "lmetric-kv", model, log, src)
            try:
                time.sleep(2.0)
                rounds = asyncio.run(
                    salted_chat(url, procs[0], "tiny", args.kv_blocks * args.block_size, run)
                )
            finally:
                stop(router)
            run += 1
            off = Counter(r["predicted"] - r["cached"] for r in rounds)
            result["salted_chat"].append(
                {
                    "router": label,
                    "rounds": len(rounds),
                    "pred_minus_real": {str(k): v for k, v in sorted(off.items())},
                    "served": {str(k): v for k, v in sorted(Counter(r["cached"] for r in rounds).items())},
                    "prompt_tokens": rounds[0]["prompt"] if rounds else None,
                }
            )
            write(result, args.out, argv)
            print(json.dumps({"salted_chat": result["salted_chat"][-1]}), flush=True)
    finally:
        stop_all(procs)
    write(result, args.out, argv)
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}")
    return 0


def write(result: dict[str, Any], out_path: str, argv: list[str] | None) -> None:
    """The markdown and the JSON of the runs so far."""
    result["load_avg_1m_after"] = os.getloadavg()[0]
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.write_text(
        render(
            result,
            " ".join(["python", "scripts/real_vllm_eval.py", *(argv if argv is not None else sys.argv[1:])]),
            out.with_suffix(".json").name,
        )
    )


def procs_index(procs: list[VllmProcess], url: str) -> int:
    urls = [p.url for p in procs]
    return urls.index(url) if url in urls else -1


def render(r: dict[str, Any], command: str, json_name: str = "real-vllm.json") -> str:
    lines = [
        "# kvroute in front of real vLLM (CPU build)",
        "",
        f"Command: `{command}` (written by it; the numbers are in `{json_name}`).",
        "",
        f"- Machine: {r['machine']}; 1-minute load average {r['load_avg_1m_before']:.1f} before, "
        f"{r['load_avg_1m_after']:.1f} after (other agents' jobs share the cores).",
        f"- Engines: 2 × `vllm serve` ({', '.join(r['vllm'])}, CPU build), {r['model']}, block size "
        f"{r['engines']['block_size']}, {r['engines']['kv_blocks']} KV blocks each, prefix caching, KV events "
        f"with replay; healthy after {r['engines']['startup_s']} s.",
        f"- Workload: `multiturn` (seed {r['workload']['seed']}, {r['workload']['users']} conversations at once), "
        f"{r['workload']['rate']} requests/s for "
        f"{r['workload']['duration_s']:.0f} s = {r['workload']['requests']} requests per run, streamed "
        "`/v1/completions`; policies interleaved round by round, each run with its own text.",
        "",
        "| round | policy | router | ok | vLLM prefix-cache hit rate | predicted = real | predicted − real (tokens: count) | router CPU ms/request | TTFT p50 / p90 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["runs"]:
        hist = ", ".join(f"{k}: {v}" for k, v in row["pred_minus_real"].items())
        hist = hist.replace("-", "−")
        hit = row["vllm_prefix_cache_hit_rate"]
        lines.append(
            f"| {row['round']} | {row['policy']} | {row.get('router', 'this')} | {row['ok']}/{row['requests']} | "
            f"{'n/a' if hit is None else f'{hit:.1%}'} | {row['pred_exact_share']:.1%} | {hist} | "
            f"{row['router_cpu_ms_per_request']:.2f} | {row['ttft_ms_p50']:.0f} / {row['ttft_ms_p90']:.0f} |"
        )
    lines += [
        "",
        "Why predictions differ from what vLLM served (events before: what the engines' KV events received "
        "before the request was sent say is cached, in vLLM's own whole blocks):",
        "",
        "| round | policy | router | salted requests | exact | = events before, vLLM changed after the decision | ≠ events before (the router's) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in r["runs"]:
        c = row["why"]["classes"]
        lines.append(
            f"| {row['round']} | {row['policy']} | {row.get('router', 'this')} | {row['salted_requests']} | {c.get('exact', 0)} | "
            f"{c.get('vllm_after_decision', 0)} | {c.get('view_differs_from_events', 0)} |"
        )
    for ch in r.get("chat", []):
        c = ch["why"]["classes"]
        diffs = ", ".join(f"{k}: {v}" for k, v in ch["pred_minus_real"].items()).replace("-", "−")
        lines += [
            "",
            f"Concurrent multi-turn chat, router `{ch['router']}` (`round-robin` over both engines; "
            f"{ch['conversations']} conversations of {ch['turns']} turns at once, each turn sent when the last reply came, every third sharing a system "
            f"prompt, {ch['salted_requests']} salted requests): {ch['ok']}/{ch['requests']} answered; predicted − "
            f"served (tokens: count) {diffs}; exact {c.get('exact', 0)}, = events before but vLLM changed "
            f"after the decision {c.get('vllm_after_decision', 0)}, ≠ events before (the router's) "
            f"{c.get('view_differs_from_events', 0)}.",
        ]
    for sc in r.get("salted_chat", []):
        diffs = ", ".join(f"{k}: {v}" for k, v in sc["pred_minus_real"].items()).replace("-", "−")
        served = ", ".join(f"{k}: {v}" for k, v in sc["served"].items())
        lines += [
            "",
            f"Salted chat, router `{sc['router']}` (one engine, `lmetric-kv`; two chats under one `cache_salt` "
            f"sharing a system prompt, the second one ({sc['prompt_tokens']} prompt tokens) repeated after each "
            f"filler until the engine cycled its pool): {sc['rounds']} rounds; predicted − served (tokens: "
            f"rounds) {diffs}; served (tokens: rounds) {served}.",
        ]
    idle = r.get("api_cpu_idle_no_router", [])
    attached = r.get("api_cpu_idle_router_attached", [])
    lines += [
        "",
        "Scrape cost on the engines (vLLM API server process, CPU seconds per second, engine 0 / engine 1):",
        "",
        f"- idle, no router: {' / '.join(f'{x * 1e3:.1f} ms/s' for x in idle)}",
        f"- idle, router attached (its scrapes and health checks only): {' / '.join(f'{x * 1e3:.1f} ms/s' for x in attached)}",
    ]
    for row in r["runs"]:
        lines.append(
            f"- under load, round {row['round']} {row['policy']}: "
            f"{' / '.join(f'{x * 1e3:.0f} ms/s' for x in row['api_cpu_s_per_s_under_load'])}"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
