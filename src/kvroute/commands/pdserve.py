"""`kvroute serve --prefill URL … --decode URL …`: the router's P/D mode (:mod:`kvroute.server.pd`).

The instances come from ``--prefill``/``--decode`` (vllm-router's flag names) and from the ``--config``
file's backends that carry ``role: prefill`` or ``role: decode``; ``--kv-events URL=ENDPOINT`` gives an
instance's KV events. Discovery (``--discover``, the config's ``discover``) takes a role:
``prefill=dns://NAME:PORT``, ``decode=file://PATH``, or a bare ``file://PATH`` whose backends carry
``role:``; the instances a source lists join and leave their pool as it changes. The conditional skip uses the engines' cost model (``--profile``, as
``kvroute engine`` takes it) and the link (``--kv-transfer-bandwidth`` GB/s, KV bytes per token from
the profile's model config).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any

from kvroute.errors import UserError


def add_pd_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill/decode disaggregation (vllm-router's --prefill/--decode)")
    g.add_argument(
        "--prefill", action="append", default=[], metavar="URL", help="a prefill instance (repeat)"
    )
    g.add_argument("--decode", action="append", default=[], metavar="URL", help="a decode instance (repeat)")
    g.add_argument(
        "--profile",
        default=None,
        help="with --decode: the engines' cost profile for the conditional skip (default: kvroute's default)",
    )
    g.add_argument(
        "--kv-transfer-bandwidth",
        type=float,
        default=None,
        help="with --decode: the P-to-D link in GB/s for the conditional skip (default 25)",
    )
    # --engine-max-num-batched-tokens (serve's flag, shared with the router queue): the decode engines'
    # chunk size for their modelled prefill (default 4096)
    g.add_argument("--no-conditional", action="store_true", help="with --decode: never skip P")


def wants_pd(args: argparse.Namespace, backends: Any, discover: Any = ()) -> bool:
    """P/D mode: --prefill/--decode given, a config backend with a role, or a discovery source with
    a role prefix (``prefill=`` / ``decode=``)."""
    roles = [split_role(src)[0] for src in (*(getattr(args, "discover", None) or ()), *discover)]
    return bool(args.prefill or args.decode or any(b.role for b in backends) or any(roles))


def split_role(source: str) -> tuple[str | None, str]:
    """``"prefill=dns://p:8000"`` → ``("prefill", "dns://p:8000")``; no prefix → ``(None, source)``;
    UserError for a prefix that is not a role."""
    head, sep, rest = source.partition("=")
    if not sep or "://" in head:
        return None, source
    if head not in ("prefill", "decode"):
        raise UserError(f"--discover {source!r}: the role before '=' must be prefill or decode")
    return head, rest


def pd_config(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """(PDConfig, tokenizer, cost model, transfer model) from the flags and the config file."""
    from kvroute.commands.serve import _pairs, limit_overrides
    from kvroute.commands.settings import load_config_file
    from kvroute.engine.cost import DEFAULT_PROFILE, get_profile
    from kvroute.engine.transfer import DEFAULT_BANDWIDTH_GBPS, TransferModel
    from kvroute.policies.registry import make_policy
    from kvroute.server.app import client_limits
    from kvroute.server.config import RouterConfig, parse_backend_url
    from kvroute.server.pd import PDBackend, PDConfig
    from kvroute.tokenizer import load_tokenizer

    base = load_config_file(args.config) if args.config else RouterConfig(backends=())
    base = dataclasses.replace(base, **limit_overrides(args))
    if args.backend:
        raise UserError("--backend is for a colocated fleet; in P/D mode give --prefill and --decode")
    if getattr(args, "router_queue", None) or args.queue_ttl is not None or args.queue_tick is not None:
        raise UserError("the router-side queue is for a colocated fleet; P/D mode runs without it")
    from kvroute.commands.settings import backends_from_text
    from kvroute.server.sync.discovery import make_source

    discover = tuple(split_role(s) for s in (getattr(args, "discover", None) or base.discover))
    kv_template = getattr(args, "discover_kv_events", None) or base.discover_kv_events
    for role, src in discover:
        if role is None and not src.startswith("file://"):
            raise UserError(
                f"--discover {src!r}: in P/D mode a DNS source needs a role: prefill={src} or decode={src}"
            )
        make_source(src, kv_template, parse=backends_from_text)  # fail early on a malformed source
    events = _pairs(args.kv_events, "--kv-events")
    pools: dict[str, list[str]] = {"prefill": [], "decode": []}
    for b in base.backends:
        if b.role is None:
            raise UserError(
                f"config backend {b.url}: in P/D mode every backend needs role: prefill or decode"
            )
        pools[b.role].append(b.url)
        if b.kv_events and b.url not in events:
            events[b.url] = b.kv_events
    for role in ("prefill", "decode"):
        for url in getattr(args, role):
            u = parse_backend_url(url)
            if u not in pools[role]:
                pools[role].append(u)
    known = set(pools["prefill"]) | set(pools["decode"])
    for url in events:
        if url not in known:
            raise UserError(f"--kv-events names {url}, which is neither a --prefill nor a --decode instance")
    if not pools["decode"] and not any(role in (None, "decode") for role, _ in discover):
        raise UserError("P/D mode needs at least one --decode instance (or a decode=... discovery source)")
    policy = args.policy or base.policy
    make_policy(policy)  # fail early on an unknown name
    bw = args.kv_transfer_bandwidth if args.kv_transfer_bandwidth is not None else DEFAULT_BANDWIDTH_GBPS
    if not bw > 0:
        raise UserError(f"--kv-transfer-bandwidth must be positive, got {bw}")
    chunk = args.engine_max_num_batched_tokens if args.engine_max_num_batched_tokens is not None else 4096
    if chunk <= 0:
        raise UserError("--engine-max-num-batched-tokens must be positive")
    profile = get_profile(args.profile or DEFAULT_PROFILE)
    cfg = PDConfig(
        prefill=tuple(PDBackend(u, events.get(u)) for u in pools["prefill"]),
        decode=tuple(PDBackend(u, events.get(u)) for u in pools["decode"]),
        policy=policy,
        block_size=args.block_size or base.block_size,
        conditional=not args.no_conditional,
        max_retries=args.max_retries if args.max_retries is not None else base.max_retries,
        discover=discover,
        discover_interval_s=getattr(args, "discover_interval", None) or base.discover_interval_s,
        discover_kv_events=kv_template,
        limits=client_limits(base),
        max_prompt_tokens=base.max_prompt_tokens,
        upstream_keepalive_s=base.upstream_keepalive_s,
        max_response_bytes=base.max_response_bytes,
    )
    try:
        cfg.check()
    except ValueError as exc:
        raise UserError(str(exc)) from None
    tok = load_tokenizer(
        args.tokenizer or base.tokenizer, chat_template=args.chat_template or base.chat_template
    )
    transfer = TransferModel.from_gbps(profile.model.kv_bytes_per_token, bw)
    return cfg, tok, profile.cost, transfer


async def _serve(args: argparse.Namespace) -> None:
    from kvroute.server.pd import PDServer
    from kvroute.server.run import wait_for_signal

    cfg, tok, cost, transfer = pd_config(args)
    from kvroute.commands.settings import backends_from_text

    server = PDServer(
        cfg,
        tok,
        cost,
        transfer,
        max_num_batched_tokens=args.engine_max_num_batched_tokens or 4096,
        parse=backends_from_text,
    )
    host, port = args.host or "127.0.0.1", args.port if args.port is not None else 8080
    try:
        bound = await server.start(host, port)
    except OSError as exc:
        await server.stop()
        raise UserError(f"cannot listen on {host}:{port}: {exc}") from None
    line = (
        f"kvroute serve (P/D): http://{host}:{bound}/v1 policy={cfg.policy} router-queue=off (P/D) "
        f"prefill={len(server.pools['prefill'])} decode={len(server.pools['decode'])} "
        f"discovery sources={len(cfg.discover)} conditional={cfg.conditional}"
    )
    try:  # announced once SIGINT/SIGTERM stop it cleanly (kvroute.server.run: readiness)
        await wait_for_signal(ready=lambda: print(line, file=sys.stderr, flush=True))
    finally:
        await server.stop()


def run_pd(args: argparse.Namespace) -> int:
    asyncio.run(_serve(args))
    return 0
