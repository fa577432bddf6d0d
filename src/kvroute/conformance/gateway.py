"""Any Gateway API endpoint picker behind a real Envoy, as a front door the suite can drive.

No conformance suite for endpoint pickers exists upstream; this makes the data-path suite one. The
picker is any program that speaks the endpoint-picker protocol (ext_proc over gRPC, the
``x-gateway-destination-endpoint`` header and ``envoy.lb`` metadata, gRPC health): a
:data:`PickerCommand` gives its command line for a list of upstreams and a gRPC port, and
:func:`envoy_front_door` runs it and a real Envoy (the ``gateway`` extra, its config from
:mod:`kvroute.server.extproc.envoyconf`: fail closed, FULL_DUPLEX_STREAMED bodies, the upstreams as a
static pool routed by the picker's endpoint list) in front of the upstreams.

What the suite then covers for the picker: every hostile client and every misbehaving upstream of
the catalogue reach the picker through Envoy (bodies streamed to it, responses streamed through it),
and every response must keep the invariant (its own id, no byte of another response, no hang, no
5xx for a client's fault), followed by ordinary requests routed by the picker; the picker's log must
stay free of tracebacks, and neither the picker nor Envoy may exit. ``kvroute epp`` is the picker by
default (:func:`kvroute_epp`).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.conformance.frontdoor import ProcessFrontDoor
from kvroute.server.cluster import free_port
from kvroute.server.extproc.envoyconf import GatewaySettings
from kvroute.server.extproc.envoyproc import EnvoyProcess
from kvroute.server.extproc.exchange import endpoint_of

__all__ = ["GatewayFrontDoor", "PickerCommand", "envoy_front_door", "kvroute_epp", "wait_ready"]

PickerCommand = Callable[[Sequence[str], int], list[str]]
"""The command line of a picker for these upstream base URLs, serving gRPC on this port."""


def kvroute_epp(upstreams: Sequence[str], grpc_port: int) -> list[str]:
    """``kvroute epp`` (this Python's) for ``upstreams``, health-checking them every 0.2 s."""
    argv = [
        sys.executable,
        "-m",
        "kvroute.cli",
        "epp",
        "--grpc-port",
        str(grpc_port),
        "--port",
        str(free_port()),
    ]
    argv += ["--health-interval", "0.2"]
    for u in upstreams:
        argv += ["--backend", u]
    return argv


def wait_ready(grpc_port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until the picker's gRPC health says ``readiness`` is SERVING; RuntimeError when it exits or
    is not ready in ``timeout_s`` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the picker exited with {proc.returncode}")
            with contextlib.suppress(grpc.RpcError):
                req = health_pb2.HealthCheckRequest(service="readiness")
                if stub.Check(req, timeout=1.0).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.1)
    raise RuntimeError(f"the picker was not ready in {timeout_s} s")


@dataclass
class GatewayFrontDoor(ProcessFrontDoor):
    """Envoy (where clients go: ``host``:``port``) and the picker (``proc``, its output in ``log``)
    behind it; Envoy exiting is a problem too."""

    envoy: EnvoyProcess | None = None

    def problems(self, since: int, client_fault: bool) -> list[str]:
        out = super().problems(since, client_fault)
        proc = None if self.envoy is None else self.envoy.proc
        if self.envoy is not None and (proc is None or proc.poll() is not None):
            out.append(f"envoy exited: {self.envoy.log_tail()}")
        return out


@contextlib.contextmanager
def envoy_front_door(
    upstreams: Sequence[str], picker: PickerCommand = kvroute_epp, timeout_s: float = 60.0, retries: int = 1
) -> Iterator[GatewayFrontDoor]:
    """The picker and Envoy in front of ``upstreams`` (base URLs, ``http://host:port``); yields
    once the picker is ready and Envoy is live; stops both on exit."""
    grpc_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "picker.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(
                picker(upstreams, grpc_port), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        envoy = EnvoyProcess(
            GatewaySettings(
                host="127.0.0.1",
                port=free_port(),
                picker=f"127.0.0.1:{grpc_port}",
                endpoints=tuple(endpoint_of(u) for u in upstreams),
                admin_port=free_port(),
                retries=retries,
            ),
            concurrency=1,
            workdir=tmp,
        )
        try:
            wait_ready(grpc_port, proc, timeout_s)
            envoy.start(timeout_s)
            yield GatewayFrontDoor("127.0.0.1", envoy.settings.port, proc, log, envoy)
        finally:
            envoy.stop()
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
