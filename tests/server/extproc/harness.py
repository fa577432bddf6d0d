"""A real gateway for the picker's tests (used by the ``gateway`` fixture in conftest.py): in-process emulated engines (real loopback sockets), the
picker (:class:`EppServer`) in process or as a ``kvroute epp`` child, and a real Envoy child from
the ``gateway`` extra. The tests skip, saying so, when the extra is not installed."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
pytest.importorskip("grpc_health.v1.health", reason="the gateway extra is not installed")
pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="the gateway extra is not installed"
)

from tests.server.test_e2e import Cluster

from kvroute.emulator.server import EmulatorServer
from kvroute.errors import UserError
from kvroute.server.cluster import free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.extproc.envoyconf import GatewaySettings
from kvroute.server.extproc.envoyproc import EnvoyProcess, find_envoy
from kvroute.server.extproc.server import EppServer
from kvroute.server.state.router import RouterState
from kvroute.tokenizer import Tokenizer


def envoy_or_skip() -> Path:
    try:
        return find_envoy()
    except UserError as exc:
        pytest.skip(f"no Envoy: {exc}")


class Gateway:
    """Engines, the picker and Envoy, started in that order; ``url``: Envoy's, for clients."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.cluster = Cluster()  # the engines (in process, real sockets)
        self.epp: EppServer | None = None
        self.child: subprocess.Popen[bytes] | None = None  # a `kvroute epp` process instead
        self.envoy: EnvoyProcess | None = None
        self.grpc_port = free_port()

    @property
    def engines(self) -> list[EmulatorServer]:
        return self.cluster.engines

    @property
    def specs(self) -> list[BackendSpec]:
        return self.cluster.specs

    @property
    def url(self) -> str:
        assert self.envoy is not None
        return self.envoy.url

    @property
    def state(self) -> RouterState:
        assert self.epp is not None
        return self.epp.router.state

    async def add_engine(self, tokenizer: Tokenizer, events: bool = True, time_scale: float = 20.0) -> None:
        await self.cluster.add_engine(tokenizer, events, time_scale)

    def endpoints(self) -> tuple[str, ...]:
        return tuple(s.url.removeprefix("http://") for s in self.specs)

    async def start_picker(self, tokenizer: Tokenizer, metadata_only: bool = False, **kw: object) -> None:
        kw = {"health_interval_s": 0.2, **kw}
        cfg = RouterConfig(backends=tuple(self.specs), port=0, **kw)  # type: ignore[arg-type]
        self.epp = EppServer(cfg, "127.0.0.1", 0, metadata_only, tokenizer=tokenizer)
        await self.epp.start()
        self.grpc_port = self.epp.grpc_port  # the free port it bound

    def start_picker_process(self) -> None:
        """``kvroute epp`` as a child process on ``grpc_port`` (for the tests that kill it)."""
        argv = [sys.executable, "-m", "kvroute.cli", "epp", "--grpc-port", str(self.grpc_port)]
        argv += ["--port", str(free_port()), "--health-interval", "0.2", "--drain-grace", "0"]
        for s in self.specs:
            argv += ["--backend", s.url]
        with (self.tmp / "epp.log").open("ab") as log:
            self.child = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    async def start_envoy(self, metadata_only: bool = False, retries: int = 1) -> None:
        envoy_or_skip()
        settings = GatewaySettings(
            host="127.0.0.1",
            port=free_port(),
            picker=f"127.0.0.1:{self.grpc_port}",
            endpoints=self.endpoints(),
            admin_port=free_port(),
            metadata_only=metadata_only,
            retries=retries,
            message_timeout_s=30.0,
        )
        self.envoy = EnvoyProcess(settings, concurrency=1, workdir=str(self.tmp))
        await asyncio.to_thread(self.envoy.start)

    async def close(self) -> None:
        if self.envoy is not None:
            await asyncio.to_thread(self.envoy.stop)
        if self.child is not None and self.child.poll() is None:
            self.child.kill()
            self.child.wait()
        if self.epp is not None:
            await self.epp.stop()
        await self.cluster.close()


def leases_zero(state: RouterState) -> bool:
    return all(
        b.waiting == 0 and b.running == 0 and b.queued_prefill == 0 and b.blocks == 0 for b in state.backends
    )


async def eventually(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return True
        await asyncio.sleep(0.02)
    return bool(cond())
