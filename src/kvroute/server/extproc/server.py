"""The endpoint picker's process: the router and its ext_proc gRPC port (``kvroute epp``).

:class:`EppServer` runs a :class:`~kvroute.server.app.RouterServer` (its HTTP port serves
``/metrics``, ``/health``, ``/livez``, ``/v1/models``, the dashboard and the admin API as ``kvroute
serve`` does, and the proxy's own routes) and, on the gRPC port, the ext_proc service and the gRPC
health services over the same state: the same scrapes, KV events, leases, metrics and decision
records serve both doors.

Shutdown (:meth:`EppServer.shutdown`, the first SIGTERM): readiness turns NOT_SERVING at once; new
ext_proc streams are still served for ``drain_grace_s`` seconds (so Envoy's health checks move
traffic away first), then answered 503; streams in flight get ``drain_timeout_s`` seconds to end;
then the router stops. A second SIGTERM hurries every wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import sys
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2_grpc

from kvroute.errors import UserError
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig, queue_note
from kvroute.server.extproc.exchange import Picker
from kvroute.server.extproc.service import ExtProc, Health
from kvroute.server.run import Reloader, run_loop, serve_until_signal
from kvroute.server.sync.discovery import ParseBackends

__all__ = ["EppServer", "serve_epp"]


class EppServer:
    """The picker process (module docstring): ``grpc_host``:``grpc_port`` (0: a free port) for
    ext_proc and health; ``metadata_only`` (see :class:`ExtProc`); the rest goes to the
    :class:`RouterServer`."""

    def __init__(
        self,
        config: RouterConfig,
        grpc_host: str = "127.0.0.1",
        grpc_port: int = 9002,
        metadata_only: bool = False,
        **router: Any,
    ) -> None:
        self.router = RouterServer(config, **router)
        self.picker = Picker(self.router.proxy)
        self.extproc = ExtProc(self.picker, metadata_only)
        self.health = Health(self._ready)
        self.grpc_host = grpc_host
        self.grpc_port = grpc_port
        self.draining = False
        self._grpc: grpc.aio.Server | None = None
        self.grpc_address = ""

    def _ready(self) -> bool:
        return not self.draining and any(b.routable for b in self.router.state.backends)

    async def start(self) -> str:
        """Start the router, then the gRPC port; returns the router's base URL. Raises OSError when
        the router's port cannot be bound, UserError when the gRPC port cannot."""
        url = await self.router.start()
        _check_free(self.grpc_host, self.grpc_port)  # a clean error before gRPC's own log line
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # one picker per port
        pb_grpc.add_ExternalProcessorServicer_to_server(self.extproc, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, server)
        try:
            port = server.add_insecure_port(f"{self.grpc_host}:{self.grpc_port}")
        except RuntimeError as exc:
            port, why = 0, str(exc)
        else:
            why = "address in use or not available"
        if not port:
            raise UserError(f"cannot listen on {self.grpc_host}:{self.grpc_port} (gRPC): {why}")
        await server.start()
        self._grpc = server
        self.grpc_port = port
        self.grpc_address = f"{self.grpc_host}:{port}"
        await self.health.start()
        return url

    def apply_config(self, new: RouterConfig) -> str:
        """A SIGHUP reload, applied to the router (see :meth:`RouterServer.apply_config`)."""
        return self.router.apply_config(new)

    async def shutdown(self, hurry: asyncio.Event | None = None) -> int:
        """Drain, then stop (module docstring); returns how many requests the router's own drain
        had to end."""
        cfg = self.router.config
        hurry = hurry or asyncio.Event()
        self.draining = True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(hurry.wait(), cfg.drain_grace_s)
        self.extproc.refusing = True
        if self._grpc is not None:
            stopping = asyncio.ensure_future(self._grpc.stop(cfg.drain_timeout_s))
            waits = [stopping, asyncio.ensure_future(hurry.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            waits[1].cancel()
            if not stopping.done():
                await self._grpc.stop(0)
            self._grpc = None
        done = asyncio.Event()
        done.set()
        try:
            return await self.router.shutdown(done)
        finally:
            await self._stop_grpc()

    async def stop(self) -> None:
        """Stop at once: the gRPC port (streams in flight are cancelled), health, the router."""
        await self._stop_grpc()
        await self.router.stop()

    async def _stop_grpc(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(0)
            self._grpc = None
        await self.health.stop()


def _check_free(host: str, port: int) -> None:
    """UserError when ``host:port`` cannot be bound now (port 0 always can)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UserError(f"cannot listen on {host}:{port} (gRPC): {exc.strerror or exc}") from None


def serve_epp(
    config: RouterConfig,
    grpc_host: str,
    grpc_port: int,
    metadata_only: bool = False,
    reloader: Reloader | None = None,
    parse_backends: ParseBackends | None = None,
) -> int:
    """``kvroute epp``: run the picker until SIGTERM/SIGINT; SIGHUP reloads with ``reloader``."""

    async def main() -> int:
        server = EppServer(config, grpc_host, grpc_port, metadata_only, parse_backends=parse_backends)
        try:
            url = await server.start()
        except OSError as exc:
            await server.stop()
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
        except UserError:
            await server.stop()
            raise
        gc.freeze()  # what start-up built lives as long as the process (see serve_forever)
        mode = "metadata only" if metadata_only else "header and metadata"
        line = (
            f"kvroute epp: ext_proc on {server.grpc_address} ({mode}; gRPC health: liveness, readiness) "
            f"policy={config.policy} {queue_note(config)} backends: {len(config.backends)}; "
            f"metrics and dashboard: {url}"
        )  # announced once the signal handlers are in place (kvroute.server.run: readiness)
        await serve_until_signal(server, reloader, lambda: print(line, file=sys.stderr, flush=True))
        return 0

    return run_loop(main)
