"""The data-path suite through a real Envoy with ``kvroute epp`` as its endpoint picker: every
hostile client and misbehaving upstream of the catalogue, the invariant on every response, ordinary
follow-ups routed by the picker (:mod:`kvroute.conformance.gateway`). Skips without the gateway
extra."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="the gateway extra is not installed"
)

from kvroute.conformance.gateway import envoy_front_door
from kvroute.conformance.runner import Case, Target, cases
from kvroute.conformance.upstream import MisbehavingUpstream
from kvroute.conformance.world import World, world
from kvroute.errors import UserError
from kvroute.server.extproc.envoyproc import find_envoy

from .conftest import TIMEOUT_S

_TARGETS = [Target("upstream", "faulty", MisbehavingUpstream("faulty")), Target("engine", "emu")]


@pytest.fixture(scope="module")
def gateway_world() -> Iterator[World]:
    try:
        find_envoy()
    except UserError as exc:
        pytest.skip(f"no Envoy: {exc}")
    with world(envoy_front_door, timeout_s=TIMEOUT_S) as w:
        yield w


ENVOY_DIFFERS = {
    "client-obs-fold": "Envoy unfolds an obs-folded header into spaces (RFC 9112 section 5.2 allows "
    "it); the suite asks for a 400, as the proxy answers",
    "upstream-xchunked": "Envoy answers 502 to a response whose Transfer-Encoding ends in another "
    "coding than chunked; RFC 9112 section 6.3 (and the proxy) read such a body to the connection's close",
}
"""Cases where Envoy itself, not the picker, answers otherwise than the proxy: expected failures
(strict: one that passes is reported)."""


def _param(c: Case) -> object:
    why = next((w for k, w in ENVOY_DIFFERS.items() if c.id.startswith(k)), None)
    marks = [pytest.mark.xfail(reason=why, strict=True)] if why is not None else []
    return pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in cases(_TARGETS)])
def test_case_through_envoy(gateway_world: World, case: Case) -> None:
    w = gateway_world
    target = w.upstream if case.target.name == "upstream" else w.engine
    assert target is not None
    report = w.harness.call(w.suite.run(Case(case.kind, case.name, target, case.stream)))
    assert not report.violations, "\n".join(report.violations)
