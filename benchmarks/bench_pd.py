"""P/D side by side: kvroute's P/D mode and vllm-router's on the same emulated engines and workload,
plus the simulator's colocated-vs-disaggregated table; writes ``docs/results/pd.md``.

`make bench ONLY=pd` (needs the bench extra for vllm-router; without it that row is skipped, said so).

Each router gets a fresh fleet of emulated engines (separate processes, ``kvroute engine
--kv-transfer-config`` with the NIXL roles, real time, the default profile), fronts it as its own
process, and the same open-loop workload is replayed through it by the load generator
(:mod:`kvroute.loadgen.runner`, streaming, client-side TTFT/TPOT). Neither router gets KV events
(both keep their own approximate view); vllm-router runs with its defaults (``cache_aware`` for P and
D). Then ``kvroute compare --pd`` runs in the simulator. Timing on this shared machine is noisy: the
load average is recorded beside the numbers.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import ROOT, machine, write

PREFILL, DECODE = 2, 2
WORKLOAD, RATE, DURATION = "chatbot", 0.25, 30.0
SIM_RATIOS = "1:3,2:2,3:1"
SIM_DURATION = 120.0
NIXL = '{{"kv_connector":"NixlConnector","kv_role":"{}"}}'
KVROUTE = str(Path(sys.executable).parent / "kvroute")
MODEL = "kvroute-emulated"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_router() -> str | None:
    here = Path(sys.executable).parent / "vllm-router"
    return str(here) if here.exists() else shutil.which("vllm-router")


async def wait_healthy(urls: list[str], timeout: float = 120.0) -> None:
    t0 = time.monotonic()
    async with aiohttp.ClientSession() as http:
        for url in urls:
            while True:
                try:
                    async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            break
                except (TimeoutError, aiohttp.ClientError, OSError):
                    pass
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"{url} did not become healthy")
                await asyncio.sleep(0.3)


def start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def fleet() -> tuple[list[subprocess.Popen[bytes]], list[str], list[str]]:
    procs: list[subprocess.Popen[bytes]] = []
    pre: list[str] = []
    dec: list[str] = []
    for role, urls, n in (("kv_producer", pre, PREFILL), ("kv_consumer", dec, DECODE)):
        for _ in range(n):
            port = free_port()
            argv = [KVROUTE, "engine", "--port", str(port), "--kv-transfer-config", NIXL.format(role)]
            procs.append(start(argv))
            urls.append(f"http://127.0.0.1:{port}")
    return procs, pre, dec


async def one_router(name: str, router_argv: Any) -> dict[str, Any]:
    from kvroute.loadgen.runner import run_bench
    from kvroute.loadgen.text import BlockText
    from kvroute.tokenizer import load_tokenizer
    from kvroute.workloads import open_workload

    procs, pre, dec = fleet()
    try:
        await wait_healthy(pre + dec)
        port = free_port()
        router = start(router_argv(port, pre, dec))
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        await wait_healthy([url])
        stream, _ = open_workload(None, "auto", WORKLOAD, RATE, DURATION, 0, False)
        load0 = os.getloadavg()[0]
        res = await run_bench(url, stream, BlockText(load_tokenizer()), model=MODEL)
        out = res.summary(name, PREFILL + DECODE)
        out["loadavg_1m_before"] = load0
        out["loadavg_1m_after"] = os.getloadavg()[0]
        out["engines_prefix_hits"] = await prefix_hits(pre, dec)
        return out
    finally:
        stop(procs)


async def prefix_hits(pre: list[str], dec: list[str]) -> dict[str, float]:
    """Summed prompt tokens by source over each pool, from the engines' /metrics."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as http:
        for pool, urls in (("prefill", pre), ("decode", dec)):
            for url in urls:
                async with http.get(url + "/metrics") as r:
                    text = await r.text()
                for line in text.splitlines():
                    if line.startswith("vllm:prompt_tokens_by_source_total{"):
                        source = line.split('source="', 1)[1].split('"', 1)[0]
                        key = f"{pool}.{source}"
                        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def kvroute_argv(port: int, pre: list[str], dec: list[str]) -> list[str]:
    argv = [KVROUTE, "serve", "--port", str(port), "--policy", "lmetric"]
    for u in pre:
        argv += ["--prefill", u]
    for u in dec:
        argv += ["--decode", u]
    return argv


def vllm_router_argv(binary: str) -> Any:
    def argv(port: int, pre: list[str], dec: list[str]) -> list[str]:
        out = [binary, "--vllm-pd-disaggregation", "--host", "127.0.0.1", "--port", str(port)]
        for u in pre:
            out += ["--prefill", u]
        for u in dec:
            out += ["--decode", u]
        return [*out, "--worker-startup-check-interval", "1", "--prometheus-port", str(free_port())]

    return argv


def live_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| router | requests | unfinished | TTFT mean ms | TTFT p99 ms | TPOT mean ms | TPOT p99 ms "
        "| reported KV hit rate | D tokens read from P | P tokens computed | load avg (before → after) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        h = r["engines_prefix_hits"]
        lines.append(
            f"| {r['policy']} | {r['requests']} | {r['unfinished']} | {r['ttft_ms']['mean']:.1f} "
            f"| {r['ttft_ms']['p99']:.1f} | {r['tpot_ms']['mean']:.2f} | {r['tpot_ms']['p99']:.2f} "
            f"| {r['kv_hit_rate']:.3f} | {h.get('decode.external_kv_transfer', 0):.0f} "
            f"| {h.get('prefill.local_compute', 0):.0f} "
            f"| {r['loadavg_1m_before']:.1f} → {r['loadavg_1m_after']:.1f} |"
        )
    return "\n".join(lines)


def main() -> int:
    from kvroute.cli import main as cli

    rows = [asyncio.run(one_router("kvroute lmetric (P/D mode)", kvroute_argv))]
    binary = vllm_router()
    note = ""
    if binary is None:
        note = "vllm-router is not installed here (pip install -e '.[bench]'): its row is missing.\n\n"
    else:
        rows.append(
            asyncio.run(
                one_router("vllm-router --vllm-pd-disaggregation (cache_aware)", vllm_router_argv(binary))
            )
        )
    sim_dir = ROOT / "docs" / "results" / "pd-sim"
    sim_argv = ["compare", "--workload", WORKLOAD, "--duration", str(SIM_DURATION), "--pd", SIM_RATIOS]
    sim_argv += ["--rate-scales", "1,2", "--jobs", "2", "--out", str(sim_dir), "--no-progress"]
    if cli(sim_argv) != 0:
        return 1
    sim_table = (sim_dir / "pd.md").read_text()
    live = live_table(rows)
    print(live)
    doc = ROOT / "docs" / "results" / "pd.md"
    m = machine()
    doc.write_text(
        "# Prefill/decode disaggregation: kvroute's P/D mode, vllm-router's, and the simulator\n\n"
        "Generated by `make bench ONLY=pd` (benchmarks/bench_pd.py); do not edit by hand.\n\n"
        f"## Live: {PREFILL} prefill + {DECODE} decode emulated engines, workload `{WORKLOAD}` "
        f"× {RATE} for {DURATION:.0f} s\n\n"
        "Each router fronts a fresh fleet of `kvroute engine --kv-transfer-config` processes (NIXL roles, "
        "default profile, real time); the load generator replays the same requests open-loop, streaming, "
        "and measures TTFT/TPOT at the client. Neither router gets KV events. The reported KV hit rate is "
        "the `cached_tokens` each router returned (both report P's). "
        f"Machine: {m['cpu_count']} CPUs shared with other jobs (load averages in the table).\n\n"
        + note
        + live
        + "\n\n## Simulator: colocated vs disaggregated at equal instance counts\n\n"
        f"`kvroute compare --workload {WORKLOAD} --duration {SIM_DURATION:.0f} --pd {SIM_RATIOS} "
        "--rate-scales 1,2` (lmetric on both pools; 25 GB/s link; conditional skip on):\n\n" + sim_table
    )
    print(f"wrote {doc.relative_to(ROOT)}")
    write("pd.json", {"live": rows, "sim": json.loads((sim_dir / "pd.json").read_text())})
    return 0


if __name__ == "__main__":
    sys.exit(main())
