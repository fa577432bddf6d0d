"""Interleaved A/B of two kvroute source trees through :mod:`benchmarks.bench_peers`' kvroute path.

``python -m benchmarks.peers_ab BASE_SRC NEW_SRC`` starts the peers benchmark's engines and two
``kvroute serve`` processes with the same flags, one importing ``BASE_SRC`` (e.g. ``git archive main
src | tar -x -C /tmp/base`` then ``/tmp/base/src``) and one ``NEW_SRC``, plus the direct path, and runs
``bench_peers``' rounds over them (order rotated each round, same arrivals, own text salt each), so
both trees see the same load on the same machine in alternation. ``AB_RATES`` (comma-separated
req/s, default 50) and ``AB_ROUNDS`` (default 4) set the schedule; ``AB_OUT`` the JSON written
(default ``benchmarks/results/peers-ab.json``). Prints each path's router CPU ms per request (all
rounds and each), TTFT and KV hit. The router CPU is the peers benchmark's (``/proc`` over each
router's process group); background work that the two routers on one machine share (the engines'
``/metrics`` scraper is one per machine) falls on whichever does it, so compare the per-round
figures, not only the totals.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import benchmarks.bench_peers as bp


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m benchmarks.peers_ab BASE_SRC NEW_SRC", file=sys.stderr)
        return 2
    base, new = (str(Path(a).resolve()) for a in argv)
    for tree in (base, new):
        if not (Path(tree) / "kvroute" / "cli.py").exists():
            print(f"error: {tree} holds no kvroute package (kvroute/cli.py)", file=sys.stderr)
            return 2
    router_cmds = bp._router_cmds

    def cmds(backends: list[Any], model: str, logs: Path) -> dict[str, tuple[list[str], str, str]]:
        cmd, url, ready = router_cmds(backends, model, logs)["kvroute"]
        port = bp.free_port()
        other = list(cmd)
        other[other.index("--port") + 1] = str(port)
        return {
            "kvroute": (["env", f"PYTHONPATH={new}", *cmd], url, ready),
            "kvroute-base": (["env", f"PYTHONPATH={base}", *other], f"http://127.0.0.1:{port}", ready),
        }

    bp._router_cmds = cmds
    bp.PATHS = ("kvroute", "kvroute-base", "direct")
    bp.RATES = tuple(int(r) for r in os.environ.get("AB_RATES", "50").split(","))
    bp.ROUNDS = int(os.environ.get("AB_ROUNDS", "4"))
    logs = Path(os.environ.get("PEERS_LOGS", "/tmp")) / f"kvroute-peers-ab-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    try:
        import uvloop

        out = uvloop.run(bp._measure(logs))
    except ImportError:
        import asyncio

        out = asyncio.run(bp._measure(logs))
    out["trees"] = {"kvroute": new, "kvroute-base": base}
    out["machine"] = {
        "nproc": os.cpu_count(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }
    for name, path in out["paths"].items():
        for rate, v in path["rates"].items():
            cpu = v["router_cpu_ms_per_request"]
            rounds = " ".join(f"{c:.2f}" for c in v["router_cpu_ms_per_request_rounds"] if c is not None)
            print(
                f"{name:14s} {rate:>4s} req/s  CPU {'-' if cpu is None else f'{cpu:.2f}'} ms/req (rounds {rounds})  "
                f"TTFT p50 {v['ttft_ms']['p50']:.1f} p99 {v['ttft_ms']['p99']:.1f} ms  hit {v['engine_kv_hit_rate']:.3f}"
            )
    dest = Path(os.environ.get("AB_OUT", str(bp.RESULTS / "peers-ab.json")))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
