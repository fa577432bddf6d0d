"""`kvroute serve`: the live KV-aware router in front of OpenAI-compatible engines."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from typing import Any

from kvroute.commands import port_number, seconds
from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY, make_policy, policy_names
from kvroute.server.config import BackendSpec, RouterConfig, parse_backend_url

HELP = "run the KV-cache-aware router (OpenAI-compatible proxy) in front of engines"

# flag dest -> RouterConfig field (flags left unset keep the config file's value or the default)
_SIMPLE = {
    "policy": "policy",
    "host": "host",
    "port": "port",
    "tokenizer": "tokenizer",
    "chat_template": "chat_template",
    "tokenize": "tokenize",
    "block_size": "block_size",
    "max_body_bytes": "max_body_bytes",
    "max_response_bytes": "max_response_bytes",
    "scrape_interval": "scrape_interval_s",
    "scrape_idle_interval": "scrape_idle_interval_s",
    "health_interval": "health_interval_s",
    "max_retries": "max_retries",
    "eject_after": "eject_after",
    "drain_grace": "drain_grace_s",
    "drain_timeout": "drain_timeout_s",
    "admin_token": "admin_token",
    "discover_interval": "discover_interval_s",
    "discover_kv_events": "discover_kv_events",
    "peer_bind": "peer_bind",
    "peer_expiry": "peer_expiry_s",
    "peer_refresh": "peer_refresh_s",
    "explain": "explain",
    "decisions_kept": "decisions_kept",
    "access_log": "access_log",
    "record": "record",
    "otel": "otel",
    "max_connections": "max_connections",
    "header_timeout": "header_timeout_s",
    "body_timeout": "body_timeout_s",
    "keepalive_timeout": "keepalive_timeout_s",
    "write_timeout": "write_timeout_s",
    "upstream_keepalive": "upstream_keepalive_s",
    "worker_start_timeout": "worker_start_timeout_s",
    "max_prompt_tokens": "max_prompt_tokens",
    "parse_offload": "parse_offload",
}
_LIMITS = (
    "max_connections",
    "header_timeout",
    "body_timeout",
    "keepalive_timeout",
    "write_timeout",
    "upstream_keepalive",
)

ADMIN_TOKEN_ENV = "KVROUTE_ADMIN_TOKEN"
"""The admin API's bearer token when ``--admin-token`` is not given (keeps it out of ``ps``)."""


def add_router_arguments(p: argparse.ArgumentParser, backends: bool = True) -> None:
    """Flags shared by `serve` and `up`."""
    p.add_argument(
        "--engine-max-num-batched-tokens",
        type=int,
        default=None,
        metavar="N",
        help="the engines' chunk budget (vLLM's --max-num-batched-tokens), for the router-side queue"
        + ("" if backends else " (--engine vllm; the emulated engines' own are known)"),
    )
    p.add_argument(
        "--engine-max-num-seqs",
        type=int,
        default=None,
        metavar="N",
        help="the engines' batch limit (vLLM's --max-num-seqs), for the router-side queue"
        + ("" if backends else " (--engine vllm; the emulated engines' own are known)"),
    )
    if backends:
        p.add_argument(
            "--backend",
            action="append",
            default=[],
            metavar="URL",
            help="engine base URL, e.g. http://127.0.0.1:8000 (repeat for each engine)",
        )
        p.add_argument(
            "--kv-events",
            action="append",
            default=[],
            metavar="URL=ENDPOINT",
            help="exact KV view for backend URL from its ZMQ KV events, e.g. "
            "http://127.0.0.1:8000=tcp://127.0.0.1:5557",
        )
        p.add_argument(
            "--kv-replay",
            action="append",
            default=[],
            metavar="URL=ENDPOINT",
            help="replay socket of backend URL's KV events (gap recovery)",
        )
        p.add_argument(
            "--config",
            metavar="FILE",
            help="YAML config (see kvroute.server.config); SIGHUP re-reads it (backends, policy, features)",
        )
        p.add_argument(
            "--discover",
            action="append",
            default=[],
            metavar="SOURCE",
            help="discover backends: dns://NAME:PORT (A/AAAA records, e.g. a Kubernetes headless "
            "Service) or file://PATH (YAML or one URL a line, re-read when it changes); repeatable",
        )
        p.add_argument(
            "--discover-interval",
            type=seconds,
            metavar="S",
            help="seconds between DNS lookups / file checks (default 5)",
        )
        p.add_argument(
            "--discover-kv-events",
            metavar="TEMPLATE",
            help="KV event endpoint of a DNS-discovered backend, e.g. 'tcp://{host}:5557' "
            "(default: approximate KV view)",
        )
    p.add_argument("--policy", help=f"routing policy (default {DEFAULT_POLICY}): {', '.join(policy_names())}")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, help="port to listen on (default 8080)")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: bundled Qwen3)")
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template, as the engines render chats (default: the tokenizer folder's "
        "own, else ChatML)",
    )
    p.add_argument(
        "--tokenize",
        choices=("defer", "exact"),
        help="exact (default): tokenize the whole prompt before routing; defer: route long new text "
        "on the known token blocks plus an estimate, tokenize it once the request is sent",
    )
    p.add_argument("--block-size", type=int, help="KV block size in tokens (default 16)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body (default 32 MiB)")
    p.add_argument(
        "--max-response-bytes",
        type=int,
        help="largest engine answer read whole, not streamed (default 256 MiB); beyond: a 502",
    )
    p.add_argument(
        "--scrape-interval",
        type=float,
        help="seconds between /metrics scrapes while load moves (default 0.05)",
    )
    p.add_argument(
        "--scrape-idle-interval",
        type=float,
        help="longest seconds between scrapes while nothing moves (default 1.0; one scraper per machine)",
    )
    p.add_argument("--health-interval", type=float, help="seconds between health checks (default 1)")
    p.add_argument("--max-retries", type=int, help="retries on other backends before the first byte (2)")
    p.add_argument("--eject-after", type=int, help="failed health checks before ejection (default 3)")
    p.add_argument(
        "--drain-grace",
        type=seconds,
        metavar="S",
        help="on SIGTERM: /health answers 503 at once; new requests are still served for S seconds "
        "(default 2), then refused",
    )
    p.add_argument(
        "--drain-timeout",
        type=seconds,
        metavar="S",
        help="on SIGTERM: wait up to S seconds (default 30) for requests in flight, then end them "
        "(streams with an SSE error event)",
    )
    p.add_argument(
        "--admin-token",
        metavar="TOKEN",
        help=f"turn the admin API on (/admin/backends), with this bearer token (or set {ADMIN_TOKEN_ENV}); "
        "without one the admin API is off",
    )
    add_limit_arguments(p)
    add_peer_arguments(p)
    add_observe_arguments(p)
    from kvroute.commands.settings import add_feature_arguments

    add_feature_arguments(p)


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """Limits on clients (kvroute.server.wire.limits) and on idle upstream connections
    (kvroute.server.wire.h1); also the config's keys of the same names."""
    g = p.add_argument_group(
        "limits on clients and idle upstream connections (also the config's max_connections, *_timeout_s, "
        "upstream_keepalive_s keys)"
    )
    g.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="client connections at once (default 1024); beyond: 503",
    )
    for flag, default, what in (
        ("header", 10, "for a request's head, from its first byte; then 408 and closed"),
        ("body", 60, "for a request's body, from its head; then 408 and closed"),
        ("keepalive", 75, "an idle client connection is kept open"),
        ("write", 30, "for a client to take a write of its stream; then the request is ended"),
    ):
        g.add_argument(
            f"--{flag}-timeout", type=seconds, metavar="S", help=f"seconds {what} (default {default})"
        )
    g.add_argument(
        "--upstream-keepalive",
        type=seconds,
        metavar="S",
        help="seconds an idle pooled connection to an engine is kept open (default 15); then closed",
    )
    g.add_argument(
        "--max-prompt-tokens",
        type=int,
        metavar="N",
        help="longest prompt when no backend lists max_model_len (default 262144); beyond: 400",
    )
    g.add_argument(
        "--parse-offload",
        choices=("process", "thread", "off"),
        help="where bodies of 1 MiB or more are parsed: a worker process (default), a thread, or the loop",
    )


def limit_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The limit flags given (RouterConfig field → value), for P/D mode."""
    names = (*_LIMITS, "max_prompt_tokens")
    return {_SIMPLE[n]: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """Router replicas sharing their reservations (kvroute.server.sync.peers)."""
    g = p.add_argument_group("router replicas (also the config's peer_* keys)")
    g.add_argument(
        "--peer-bind",
        metavar="tcp://HOST:PORT",
        help="receive the other replicas' reservations here (ZMQ SUB)",
    )
    g.add_argument(
        "--peers",
        metavar="ENDPOINTS",
        help="announce this replica's reservations to these, comma-separated: tcp://HOST:PORT, or "
        "dns://NAME:PORT for every address of NAME (re-resolved every 5 s; a headless Service)",
    )
    g.add_argument(
        "--peer-expiry",
        type=seconds,
        metavar="S",
        help="forget a peer's reservations after S seconds without a message from it (default 3)",
    )
    g.add_argument(
        "--peer-refresh",
        type=seconds,
        metavar="S",
        help="re-announce this replica's whole load every S seconds (default 1)",
    )


def add_observe_arguments(p: argparse.ArgumentParser) -> None:
    """Seeing decisions (kvroute.server.observe.observer)."""
    g = p.add_argument_group("seeing decisions (also the config's explain, decisions_kept, ... keys)")
    g.add_argument(
        "--explain",
        action="store_const",
        const=True,
        help="every response carries x-kvroute-backend/-policy/-reason/-score/-cached-tokens headers "
        "(without it, only requests sending 'x-kvroute-explain: 1')",
    )
    g.add_argument(
        "--decisions-kept",
        type=int,
        metavar="N",
        help="decision records kept for GET /debug/decisions (default 1000; needs --admin-token)",
    )
    g.add_argument(
        "--access-log", metavar="FILE", help="append one JSON line per request to FILE (- for stdout)"
    )
    p.add_argument(
        "--record",
        metavar="FILE",
        help="write the routed traffic to FILE as a replayable trace (kvroute sim --trace FILE); "
        "block chains and ids keyed with a secret per-file salt",
    )
    g.add_argument(
        "--shadow",
        metavar="POLICIES",
        help="comma-separated policies computed beside the real one for every request, from the same "
        "views (agreement and differences on /metrics, e.g. vllm,llm-d,round-robin)",
    )
    g.add_argument(
        "--otel",
        action="store_const",
        const=True,
        help="OpenTelemetry traces over OTLP/HTTP (OTEL_EXPORTER_OTLP_ENDPOINT; needs kvroute[otel])",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvroute.commands.pdserve import add_pd_arguments

    add_router_arguments(p)
    add_pd_arguments(p)
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="router processes sharing the port (SO_REUSEPORT) and one in-flight load table "
        "(default 1: this process); see kvroute.server.workers",
    )
    p.add_argument(
        "--worker-start-timeout",
        type=seconds,
        metavar="S",
        help="with --workers: seconds each worker has to start listening, else serve exits with an "
        "error (default 120)",
    )


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items:
        url, sep, endpoint = item.rpartition("=")
        if not sep or not url or not endpoint.startswith(("tcp://", "ipc://")):
            raise UserError(f"{flag} {item!r}: expected URL=tcp://host:port")
        out[parse_backend_url(url)] = endpoint
    return out


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """RouterConfig fields set by flags (and the admin token from ``KVROUTE_ADMIN_TOKEN`` when
    ``--admin-token`` is absent). Flags a command does not have count as absent."""
    out = {
        field: getattr(args, dest) for dest, field in _SIMPLE.items() if getattr(args, dest, None) is not None
    }
    if "admin_token" not in out and os.environ.get(ADMIN_TOKEN_ENV):
        out["admin_token"] = os.environ[ADMIN_TOKEN_ENV]
    if getattr(args, "discover", None):
        out["discover"] = tuple(args.discover)
    if getattr(args, "shadow", None):
        from kvroute.routing.shadow import parse_shadow_names

        out["shadow"] = parse_shadow_names(args.shadow)
    if getattr(args, "peers", None) is not None:
        out["peers"] = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    return out


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router config from ``--config`` (if any) overridden by flags; raises UserError."""
    from kvroute.commands.settings import load_config_file

    base = load_config_file(args.config) if args.config else RouterConfig(backends=())
    events = _pairs(args.kv_events, "--kv-events")
    replays = _pairs(args.kv_replay, "--kv-replay")
    backends = list(base.backends)
    known = {b.url for b in backends}
    for url in args.backend:
        u = parse_backend_url(url)
        if u not in known:
            backends.append(BackendSpec(u))
            known.add(u)
    for url in [*events, *replays]:
        if url not in known:
            raise UserError(f"--kv-events/--kv-replay name {url}, which is not a --backend")
    backends = [
        dataclasses.replace(
            b, kv_events=events.get(b.url, b.kv_events), kv_replay=replays.get(b.url, b.kv_replay)
        )
        for b in backends
    ]
    more = {"workers": args.workers} if getattr(args, "workers", None) is not None else {}
    cfg = dataclasses.replace(base, backends=tuple(backends), **overrides(args), **more).validate()
    cfg = with_feature_flags(cfg, args)
    from kvroute.server.sync.discovery import make_source

    for src in cfg.discover:
        make_source(src, cfg.discover_kv_events)  # fail early on a malformed source
    return cfg


def with_feature_flags(cfg: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    """``cfg`` with the feature flags applied; fails early on a bad policy or feature combination."""
    from kvroute.commands.settings import features_from_args, queue_from_args
    from kvroute.routing.guarded import Guarded

    cfg = dataclasses.replace(
        cfg,
        features=features_from_args(args, cfg.features),
        router_queue=queue_from_args(args, cfg.router_queue),
    )
    tokens, seqs = cfg.engine_limits
    for flag, value in (
        ("--engine-max-num-batched-tokens", getattr(args, "engine_max_num_batched_tokens", None)),
        ("--engine-max-num-seqs", getattr(args, "engine_max_num_seqs", None)),
    ):
        if value is not None and value < 0:
            raise UserError(f"{flag} must be >= 0 (got {value})")
    tokens = getattr(args, "engine_max_num_batched_tokens", None) or tokens
    seqs = getattr(args, "engine_max_num_seqs", None) or seqs
    cfg = dataclasses.replace(cfg, engine_limits=(tokens, seqs))
    policy = make_policy(cfg.policy)  # fail early on an unknown policy name
    if cfg.features is not None and cfg.features.any:
        Guarded(policy, cfg.features)  # e.g. classes need lmetric
    return cfg


def run(args: argparse.Namespace) -> int:
    from kvroute.commands.pdserve import run_pd, wants_pd
    from kvroute.commands.settings import backends_from_text, load_config_file
    from kvroute.server.run import Reloader, serve_forever

    base = load_config_file(args.config) if args.config else None
    if wants_pd(args, base.backends if base else (), base.discover if base else ()):
        return run_pd(args)
    for flag in ("profile", "kv_transfer_bandwidth", "no_conditional"):
        if getattr(args, flag, None):
            raise UserError(f"--{flag.replace('_', '-')} goes with --prefill/--decode (P/D mode)")
    cfg = config_from_args(args)
    # SIGHUP: the same merge as here (the file, then the flags over it); picklable for the workers
    reloader = Reloader(args.config, functools.partial(config_from_args, args))
    if cfg.workers > 1:
        from kvroute.server.workers import serve_workers

        return serve_workers(cfg, cfg.workers, reloader, backends_from_text)
    return serve_forever(cfg, reloader, backends_from_text)
