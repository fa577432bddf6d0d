"""`kvroute up`: N emulated engines with KV events on, and the router in front, on loopback."""

from __future__ import annotations

import argparse
import dataclasses
import secrets
import sys

from kvroute.commands.serve import add_router_arguments, overrides, with_feature_flags
from kvroute.errors import UserError
from kvroute.policies.registry import make_policy

HELP = "start N emulated engines (KV events on) and the router in front of them; Ctrl-C stops all"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=4, help="number of emulated engines (default 4)")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="engine model seconds per wall second (default 1: real time)",
    )
    p.add_argument("--profile", help="engine cost profile (see `kvroute profiles`)")
    p.add_argument("--kv-blocks", type=int, help="KV cache blocks per engine (default: from the profile)")
    p.add_argument(
        "--approximate",
        action="store_true",
        help="do not use the engines' KV events (approximate KV view from routing history)",
    )
    add_router_arguments(p, backends=False)


def engine_args(args: argparse.Namespace) -> list[str]:
    out = ["--time-scale", str(args.time_scale)]
    if args.profile:
        out += ["--profile", args.profile]
    if args.kv_blocks:
        out += ["--kv-blocks", str(args.kv_blocks)]
    if args.block_size:
        out += ["--block-size", str(args.block_size)]
    if args.tokenizer:
        out += ["--tokenizer", args.tokenizer]
    if args.chat_template:
        out += ["--chat-template", args.chat_template]
    return out


def run(args: argparse.Namespace) -> int:
    from kvroute.engine.types import EngineConfig
    from kvroute.server.app import RouterServer
    from kvroute.server.cluster import EngineCluster
    from kvroute.server.config import RouterConfig
    from kvroute.server.run import run_loop, serve_until_signal

    if args.instances < 1:
        raise UserError("--instances must be >= 1")
    if not args.time_scale > 0:
        raise UserError("--time-scale must be positive")
    make_policy(args.policy or "lmetric-kv")

    async def main() -> int:
        cluster = EngineCluster(args.instances, engine_args(args), kv_events=not args.approximate)
        backends = await cluster.start()
        try:
            given = overrides(args)
            # the dashboard and /debug need the admin token: a random one unless one was given
            made = "admin_token" not in given
            token = given.setdefault("admin_token", secrets.token_urlsafe(16))
            # the emulated engines run with the engine model's default limits: the queue reads them
            ecfg = EngineConfig()
            limits = (ecfg.max_num_batched_tokens, ecfg.max_num_seqs)
            cfg = dataclasses.replace(
                RouterConfig(backends=backends, engine_limits=limits), **given
            ).validate()
            cfg = with_feature_flags(cfg, args)
            server = RouterServer(cfg)
            try:
                url = await server.start()
            except OSError as exc:
                await server.stop()
                raise UserError(f"cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}") from None
            print(f"kvroute up: {args.instances} emulated engines, policy={cfg.policy}", file=sys.stderr)
            for b in backends:
                print(f"  engine {b.url}  kv_events={b.kv_events or 'off'}", file=sys.stderr)
            # a token made here is printed (it opens the page directly); a given one is not echoed
            shown = token if made else "<admin token>"
            page = (
                f"{url}/dashboard#token={token}" if made else f"{url}/dashboard (asks for your admin token)"
            )
            print(f"dashboard: {page}", file=sys.stderr)
            print(
                "explanations: send 'x-kvroute-explain: 1' (or start with --explain); decisions: "
                f'curl -H "Authorization: Bearer {shown}" {url}/debug/decisions',
                file=sys.stderr,
            )
            print(f"router: {url}/v1", flush=True)
            await serve_until_signal(server)
        finally:
            cluster.stop()
        return 0

    return run_loop(main)
