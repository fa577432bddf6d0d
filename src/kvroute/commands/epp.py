"""`kvroute epp`: the router as a Gateway API endpoint picker behind Envoy (ext_proc over gRPC).

The same flags as `kvroute serve` (backends, KV events, policy, features, discovery, admin token),
plus the gRPC port. Needs the ``gateway`` extra (``pip install 'kvroute[gateway]'``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

from kvroute.commands import port_number
from kvroute.commands.serve import add_router_arguments, config_from_args
from kvroute.errors import UserError

HELP = "run the router as a Gateway API endpoint picker (Envoy ext_proc, gRPC) in front of engines"

DEFAULT_GRPC_PORT = 9002
DEFAULT_HTTP_PORT = 9090
"""The picker's ports unless given: ext_proc and gRPC health; metrics, health and the dashboard."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_router_arguments(p)
    p.add_argument(
        "--grpc-host", default="127.0.0.1", help="address of the ext_proc gRPC port (default 127.0.0.1)"
    )
    p.add_argument(
        "--grpc-port",
        type=port_number,
        default=DEFAULT_GRPC_PORT,
        help=f"ext_proc and gRPC health port (default {DEFAULT_GRPC_PORT}); --port is the HTTP one "
        f"(metrics, /health, dashboard; default {DEFAULT_HTTP_PORT})",
    )
    p.add_argument(
        "--metadata-only",
        action="store_true",
        help="pass the picked endpoints only as the envoy.lb metadata (remove the "
        "x-gateway-destination-endpoint header); Envoy must route by the metadata",
    )


def require_gateway() -> None:
    """Raise UserError unless the ``gateway`` extra (grpcio, xds-protos, health) is installed."""
    try:
        import grpc  # noqa: F401
        import grpc_health.v1.health  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError as exc:
        raise UserError(
            f"kvroute epp needs the gateway extra ({exc.name} is missing): pip install 'kvroute[gateway]'"
        ) from None


def run(args: argparse.Namespace) -> int:
    from kvroute.commands.settings import backends_from_text

    require_gateway()
    from kvroute.server.extproc.server import serve_epp
    from kvroute.server.run import Reloader

    cfg = config_from_args(args)
    if args.port is None and not args.config:
        cfg = dataclasses.replace(cfg, port=DEFAULT_HTTP_PORT)
    reloader = Reloader(args.config, functools.partial(config_from_args, args))
    return serve_epp(cfg, args.grpc_host, args.grpc_port, args.metadata_only, reloader, backends_from_text)
