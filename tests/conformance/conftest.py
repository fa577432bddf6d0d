"""The conformance suite's world: a misbehaving upstream (model ``faulty``) and a real emulated
engine (``kvroute engine``, model ``emu``) behind a real ``kvroute serve`` process, on loopback;
the clients and the upstream run on one background event loop (:class:`Harness`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvroute.conformance.frontdoor import FrontDoor, FrontDoorFactory, emulated_engine, serve_front_door
from kvroute.conformance.runner import Harness, Suite, Target
from kvroute.conformance.upstream import MisbehavingUpstream

TIMEOUT_S = 5.0
"""The bound on every wait of a case (seconds): a hang is reported after it."""


@dataclass(frozen=True)
class World:
    harness: Harness
    door: FrontDoor
    suite: Suite
    upstream: Target
    engine: Target


@pytest.fixture(scope="session")
def world() -> Iterator[World]:
    with world_through(serve_front_door) as w:
        yield w


@contextlib.contextmanager
def world_through(front_door: FrontDoorFactory) -> Iterator[World]:
    """The misbehaving upstream and an emulated engine behind the front door ``front_door`` makes."""
    harness = Harness()
    upstream = MisbehavingUpstream("faulty")
    harness.call(upstream.start())
    try:
        with (
            emulated_engine("emu", time_scale=50.0) as engine,
            front_door([upstream.url, engine]) as door,
        ):
            suite = Suite(door, timeout_s=TIMEOUT_S)
            up, emu = Target("upstream", "faulty", upstream), Target("engine", "emu")
            harness.call(suite.ready([up, emu]))
            yield World(harness, door, suite, up, emu)
    finally:
        harness.call(upstream.stop())
        harness.close()
