"""Every hostile client and every misbehaving upstream through a real ``kvroute serve``, the
invariant on every response and on ordinary follow-ups over the same pooled connections."""

from __future__ import annotations

import pytest

from kvroute.conformance.runner import Case, Target, cases
from kvroute.conformance.upstream import MisbehavingUpstream

from .conftest import World

# stand-ins to name the cases at collection (not started): the real ones live in the session's world
_TARGETS = [Target("upstream", "faulty", MisbehavingUpstream("faulty")), Target("engine", "emu")]


def _all() -> list[object]:
    return [pytest.param(c, id=c.id) for c in cases(_TARGETS)]


def _resolve(case: Case, world: World) -> Case:
    target = world.upstream if case.target.name == "upstream" else world.engine
    return Case(case.kind, case.name, target, case.stream)


@pytest.mark.parametrize("case", _all())
def test_case(world: World, case: Case) -> None:
    report = world.harness.call(world.suite.run(_resolve(case, world)))
    assert not report.violations, "\n".join(report.violations)
