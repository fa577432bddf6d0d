"""`kvroute serve`: the live KV-aware router in front of OpenAI-compatible engines."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from kvroute.commands import port_number, seconds
from kvroute.errors import UserError
from kvroute.policies.registry import make_policy, policy_names
from kvroute.server.config import BackendSpec, RouterConfig, parse_backend_url

HELP = "run the KV-cache-aware router (OpenAI-compatible proxy) in front of engines"

# flag dest -> RouterConfig field (flags left unset keep the config file's value or the default)
_SIMPLE = {
    "policy": "policy",
    "host": "host",
    "port": "port",
    "tokenizer": "tokenizer",
    "tokenize": "tokenize",
    "block_size": "block_size",
    "max_body_bytes": "max_body_bytes",
    "scrape_interval": "scrape_interval_s",
    "health_interval": "health_interval_s",
    "max_retries": "max_retries",
    "eject_after": "eject_after",
    "drain_grace": "drain_grace_s",
    "drain_timeout": "drain_timeout_s",
}


def add_router_arguments(p: argparse.ArgumentParser, backends: bool = True) -> None:
    """Flags shared by `serve` and `up`."""
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
        p.add_argument("--config", metavar="FILE", help="YAML config (see kvroute.server.config)")
    p.add_argument("--policy", help=f"routing policy (default lmetric): {', '.join(policy_names())}")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port_number, help="port to listen on (default 8080)")
    p.add_argument("--tokenizer", help="tokenizer.json or folder (default: bundled Qwen3)")
    p.add_argument(
        "--tokenize",
        choices=("defer", "exact"),
        help="exact (default): tokenize the whole prompt before routing; defer: route long new text "
        "on the known token blocks plus an estimate, tokenize it once the request is sent",
    )
    p.add_argument("--block-size", type=int, help="KV block size in tokens (default 16)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body (default 32 MiB)")
    p.add_argument("--scrape-interval", type=float, help="seconds between /metrics scrapes (default 0.05)")
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
    from kvroute.commands.settings import add_feature_arguments

    add_feature_arguments(p)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_router_arguments(p)
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="router processes sharing the port (SO_REUSEPORT) and one in-flight load table "
        "(default 1: this process); see kvroute.server.workers",
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
    """RouterConfig fields set by flags."""
    return {field: getattr(args, dest) for dest, field in _SIMPLE.items() if getattr(args, dest) is not None}


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
    return cfg


def with_feature_flags(cfg: RouterConfig, args: argparse.Namespace) -> RouterConfig:
    """``cfg`` with the feature flags applied; fails early on a bad policy or feature combination."""
    from kvroute.commands.settings import features_from_args
    from kvroute.routing.guarded import Guarded

    cfg = dataclasses.replace(cfg, features=features_from_args(args, cfg.features))
    policy = make_policy(cfg.policy)  # fail early on an unknown policy name
    if cfg.features is not None and cfg.features.any:
        Guarded(policy, cfg.features)  # e.g. classes need lmetric
    return cfg


def run(args: argparse.Namespace) -> int:
    from kvroute.server.run import serve_forever

    cfg = config_from_args(args)
    if cfg.workers > 1:
        from kvroute.server.workers import serve_workers

        return serve_workers(cfg, cfg.workers)
    return serve_forever(cfg)
