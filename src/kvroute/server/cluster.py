"""Emulated engines as subprocesses (``kvroute engine``), for `kvroute up`, the demo and the benchmark.

Each engine gets a free loopback HTTP port, and (with ``kv_events``) a ZMQ PUB endpoint and a replay
endpoint; :meth:`EngineCluster.start` waits until every ``/health`` answers. ``stop`` sends SIGTERM
(then SIGKILL after a grace period) to the processes it started, and only to those.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from kvroute.errors import UserError
from kvroute.procguard import guarded
from kvroute.server.config import BackendSpec

__all__ = ["EngineCluster", "EngineProc", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class EngineProc:
    spec: BackendSpec
    proc: subprocess.Popen[bytes]


class EngineCluster:
    """``n`` emulated engines. ``engine_args`` are extra ``kvroute engine`` flags (e.g. ``--time-scale``)."""

    def __init__(
        self,
        n: int,
        engine_args: Sequence[str] = (),
        kv_events: bool = True,
        host: str = "127.0.0.1",
        quiet: bool = True,
    ) -> None:
        if n < 1:
            raise UserError("--instances must be >= 1")
        self.n = n
        self.engine_args = list(engine_args)
        self.kv_events = kv_events
        self.host = host
        self.quiet = quiet
        self.engines: list[EngineProc] = []

    @property
    def backends(self) -> tuple[BackendSpec, ...]:
        return tuple(e.spec for e in self.engines)

    def _spawn(self) -> None:
        for _ in range(self.n):
            port = free_port(self.host)
            url = f"http://{self.host}:{port}"
            cmd = [sys.executable, "-m", "kvroute.cli", "engine", "--host", self.host, "--port", str(port)]
            spec = BackendSpec(url)
            if self.kv_events:
                pub, rep = (
                    f"tcp://{self.host}:{free_port(self.host)}",
                    f"tcp://{self.host}:{free_port(self.host)}",
                )
                cmd += ["--kv-events-endpoint", pub, "--kv-events-replay-endpoint", rep]
                spec = BackendSpec(url, pub, rep)
            cmd += self.engine_args
            out = subprocess.DEVNULL if self.quiet else None
            # guarded: an engine gets SIGTERM when this process dies, however it dies (kvroute.procguard)
            proc = subprocess.Popen(guarded(cmd), stdout=out, stderr=out, start_new_session=True)
            self.engines.append(EngineProc(spec, proc))

    async def start(self, timeout_s: float = 60.0) -> tuple[BackendSpec, ...]:
        """Spawn the engines and wait for their /health; raises UserError if one exits or times out."""
        self._spawn()
        try:
            async with aiohttp.ClientSession() as session, asyncio.timeout(timeout_s):
                await asyncio.gather(*(self._wait(session, e) for e in self.engines))
        except TimeoutError:
            self.stop()
            raise UserError(f"emulated engines did not start within {timeout_s:.0f} s") from None
        except UserError:
            self.stop()
            raise
        return self.backends

    async def _wait(self, session: aiohttp.ClientSession, e: EngineProc) -> None:
        while True:
            if e.proc.poll() is not None:
                raise UserError(f"emulated engine {e.spec.url} exited with status {e.proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(e.spec.url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)

    def stop(self, grace_s: float = 5.0) -> None:
        """Terminate the engines this cluster started (SIGTERM, then SIGKILL after ``grace_s``)."""
        for e in self.engines:
            if e.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    e.proc.send_signal(signal.SIGTERM)
        for e in self.engines:
            try:
                e.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(e.proc.pid, signal.SIGKILL)
                e.proc.wait()
        self.engines.clear()
