"""kvroute in front of two real vLLM servers (the CPU build): evidence for docs/results/real-vllm.md.

    python scripts/real_vllm_eval.py --venv .venv-vllm --model .venv-vllm/tiny-qwen3   (make vllm-eval)

Starts two ``vllm serve`` (:mod:`kvroute.integrations.vllm_launch`: prefix caching, KV events with
replay, prompt token details; ``--block-size`` tokens per block, ``--kv-blocks`` blocks each), then,
for each round and each policy in turn (interleaved: ``lmetric-kv``, ``llm-d``, ``round-robin``, then
again), starts ``kvroute serve`` as its own process in front of both (the exact view from the
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
  traffic), and over the run under load.

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from kvroute.integrations.vllm_launch import (  # noqa: E402
    VllmProcess,
    VllmSettings,
    find_vllm,
    free_port,
    start_fleet,
    stop_all,
)
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


def api_cpu_rate(procs: list[VllmProcess], seconds: float) -> list[float]:
    """CPU seconds per second of each API server over the next ``seconds``."""
    before = [cpu_seconds(p.proc.pid) for p in procs]
    time.sleep(seconds)
    return [(cpu_seconds(p.proc.pid) - b) / seconds for p, b in zip(procs, before, strict=True)]


def start_router(
    procs: list[VllmProcess], policy: str, model: str, log: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "kvroute.cli", "serve", "--port", str(port), "--policy", policy]
    argv += ["--tokenizer", model, "--explain"]
    for p in procs:
        argv += ["--backend", p.url, "--kv-events", f"{p.url}={p.endpoint.kv_events}"]
        argv += ["--kv-replay", f"{p.url}={p.endpoint.kv_replay}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
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


async def one(http: aiohttp.ClientSession, url: str, body: bytes, out: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"ok": False}
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
    url: str, requests: list[Any], text: BlockText, model: str, run: int
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    offset = (run + 1) << 40  # each run's own text: no run hits another's cache
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        tasks = []
        start = time.perf_counter()
        for req in requests:
            prompt = text.prompt(
                [b + offset for b in req.block_ids], req.block_size, req.prompt_len, req.req_id + offset
            )
            body = orjson.dumps(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": req.output_len,
                    "min_tokens": req.output_len,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            delay = start + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(http, url, body, out)))
        await asyncio.gather(*tasks)
    return out


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--model", default=str(ROOT / ".venv-vllm" / "tiny-qwen3"))
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per engine (default 512)")
    ap.add_argument("--users", type=int, default=12, help="conversations alive at once (default 12)")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run (default 60)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds per idle CPU window (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "real-vllm.md"))
    args = ap.parse_args(argv)
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
            for policy in POLICIES:
                log = logs / f"router-{rnd}-{policy}.log"
                router, url = start_router(procs, policy, model, log)
                try:
                    time.sleep(2.0)  # subscriptions join, first scrapes
                    idle_router = (
                        api_cpu_rate(procs, args.idle) if rnd == 0 and policy == POLICIES[0] else None
                    )
                    c0 = [counters(p.url) for p in procs]
                    a0 = [cpu_seconds(p.proc.pid) for p in procs]
                    r0, t0 = cpu_seconds(router.pid), time.monotonic()
                    recs = asyncio.run(replay(url, requests, text, "tiny", run))
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
                            )
                        }
                    ),
                    flush=True,
                )
                run += 1
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
        )
    )


def procs_index(procs: list[VllmProcess], url: str) -> int:
    urls = [p.url for p in procs]
    return urls.index(url) if url in urls else -1


def render(r: dict[str, Any], command: str) -> str:
    lines = [
        "# kvroute in front of real vLLM (CPU build)",
        "",
        f"Command: `{command}` (written by it; the numbers are in `real-vllm.json`).",
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
        "| round | policy | ok | vLLM prefix-cache hit rate | predicted = real | predicted − real (tokens: count) | router CPU ms/request | TTFT p50 / p90 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["runs"]:
        hist = ", ".join(f"{k}: {v}" for k, v in row["pred_minus_real"].items())
        hit = row["vllm_prefix_cache_hit_rate"]
        lines.append(
            f"| {row['round']} | {row['policy']} | {row['ok']}/{row['requests']} | "
            f"{'n/a' if hit is None else f'{hit:.1%}'} | {row['pred_exact_share']:.1%} | {hist} | "
            f"{row['router_cpu_ms_per_request']:.2f} | {row['ttft_ms_p50']:.0f} / {row['ttft_ms_p90']:.0f} |"
        )
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
