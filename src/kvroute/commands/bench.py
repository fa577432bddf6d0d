"""`kvroute bench`: open-loop load generator for any OpenAI-compatible URL (same JSON as `sim`)."""

from __future__ import annotations

import argparse
from typing import Any

from kvroute.errors import UserError

HELP = "replay a trace or synthetic workload open-loop against an OpenAI-compatible URL, streaming"

WAIT_READY_S = 120.0
"""Default bound (seconds) on the wait for the server to be ready (``--wait-ready``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.commands.sim import add_workload_arguments

    p.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8080")
    add_workload_arguments(p)
    p.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--label", help="the 'policy' field of the result (default: the router's policy, from /health)"
    )
    p.add_argument("--tokenizer", help="tokenizer for the synthetic prompt text (default: bundled Qwen3)")
    p.add_argument(
        "--drain-timeout", type=float, default=600.0, help="seconds to wait for the last responses"
    )
    p.add_argument(
        "--wait-ready",
        type=float,
        default=WAIT_READY_S,
        metavar="SECONDS",
        help="wait up to this long for the server's /health to answer 200 before the first request, "
        f"e.g. while `kvroute up` starts its engines (default {WAIT_READY_S:g}; 0: check once)",
    )
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON")


async def _server_info(url: str) -> tuple[str, int | None]:
    import aiohttp

    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            data = await r.json(content_type=None)
    except (aiohttp.ClientError, OSError, ValueError):
        return "unknown", None
    if not isinstance(data, dict):
        return "unknown", None
    backends = data.get("backends")
    return str(data.get("policy", "unknown")), backends if isinstance(backends, int) else None


def bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark described by ``args`` against ``url``; returns the summary dict."""
    from kvroute.loadgen import BlockText, run_bench, wait_ready
    from kvroute.server.run import run_loop
    from kvroute.tokenizer import load_tokenizer
    from kvroute.workloads import open_workload

    stream, _stats = open_workload(
        args.trace, args.format, args.workload, args.rate_scale, args.duration, args.seed, args.skip_bad_lines
    )
    text = BlockText(load_tokenizer(args.tokenizer))
    out: dict[str, Any] = {}

    async def main() -> int:
        try:
            await wait_ready(url, args.wait_ready)
        except TimeoutError:
            raise UserError(
                f"{url} did not answer ready (/health 200) within {args.wait_ready:g} s (--wait-ready)"
            ) from None
        policy, instances = await _server_info(url)
        try:
            result = await run_bench(url, stream, text, args.model, args.drain_timeout)
        except (OSError, RuntimeError) as exc:
            raise UserError(f"benchmark against {url} failed: {exc}") from None
        out.update(result.summary(args.label or policy, instances))
        return 0

    run_loop(main)
    return out


def run(args: argparse.Namespace) -> int:
    from kvroute.commands.sim import write_json
    from kvroute.metrics import comparison_table

    url = args.url.rstrip("/").removesuffix("/v1")
    if not url.startswith(("http://", "https://")):
        raise UserError("--url must start with http:// or https://")
    if args.trace is None and args.workload is None:
        raise UserError("give --trace FILE or --workload NAME")
    if not args.wait_ready >= 0:
        raise UserError("--wait-ready must be a number of seconds >= 0")
    out = bench(url, args)
    print(comparison_table([out]))
    print(
        f"\n{out['requests']:,} requests ({out['unfinished']} unfinished) in {out['wall_seconds']:.1f} s, "
        f"{out['throughput_rps']:.1f} req/s" + (f"; errors: {out['errors']}" if out["errors"] else "")
    )
    if args.json:
        write_json(args.json, out)
    return 0
