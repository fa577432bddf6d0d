"""``kvroute up --gateway envoy``: a real Envoy on the router's port, kvroute as its endpoint picker.

The picker (:class:`~kvroute.server.extproc.server.EppServer`) takes free loopback ports for its
gRPC and HTTP (dashboard, metrics); Envoy listens on the config's ``host:port``, where `kvroute serve`
would, with the engines as its static pool (:mod:`.envoyconf`), so a client, ``kvroute bench`` or
the openai client sees the same URL either way.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kvroute.server.cluster import free_port
from kvroute.server.config import RouterConfig
from kvroute.server.extproc.envoyconf import GatewaySettings
from kvroute.server.extproc.envoyproc import EnvoyProcess
from kvroute.server.extproc.exchange import endpoint_of
from kvroute.server.extproc.server import EppServer

__all__ = ["Gateway"]


class Gateway:
    """Envoy in front of a picker for ``config`` (module docstring); ``concurrency``: Envoy's
    worker threads. :meth:`start` starts both; :meth:`stop` stops Envoy (the picker is drained and
    stopped by its owner, as a :class:`RouterServer` would be)."""

    def __init__(self, config: RouterConfig, concurrency: int = 2) -> None:
        self.config = config
        self.concurrency = concurrency
        self.picker = EppServer(dataclasses.replace(config, port=0), "127.0.0.1", free_port())
        self.envoy: EnvoyProcess | None = None

    @property
    def url(self) -> str:
        """Envoy's base URL (where clients go)."""
        assert self.envoy is not None
        return self.envoy.url

    async def start(self) -> str:
        """Start the picker, then Envoy; returns the picker's own base URL (dashboard, metrics).
        Raises UserError when Envoy rejects its config, exits or is not ready."""
        url = await self.picker.start()
        cfg = self.config
        settings = GatewaySettings(
            host=cfg.host,
            port=cfg.port,
            picker=self.picker.grpc_address,
            endpoints=tuple(endpoint_of(b.url) for b in cfg.backends),
            admin_port=free_port(),
            retries=cfg.max_retries,
        )
        envoy = self.envoy = EnvoyProcess(settings, self.concurrency)
        argv = await asyncio.to_thread(envoy.prepare)
        envoy.spawn(argv)  # from the loop's thread: Envoy's death signal follows the thread that starts it
        await asyncio.to_thread(envoy.wait_ready, 30.0)
        return url

    def describe(self) -> str:
        """One line: where Envoy listens, its admin and config, and the picker's gRPC."""
        envoy = self.envoy
        assert envoy is not None
        return (
            f"envoy {envoy.url} (admin http://127.0.0.1:{envoy.settings.admin_port}, config "
            f"{envoy.config_path}) -> kvroute epp {self.picker.grpc_address}"
        )

    def stop(self) -> None:
        """Stop Envoy (SIGTERM, then SIGKILL)."""
        if self.envoy is not None:
            self.envoy.stop()
