"""The conformance suite's world: a misbehaving upstream (model ``faulty``) and a real emulated
engine (``kvroute engine``, model ``emu``) behind a real ``kvroute serve`` process, on loopback;
the clients and the upstream run on one background event loop."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvroute.conformance.world import World, world

TIMEOUT_S = 15.0
"""The bound on every wait of a case (seconds): a hang is reported after it (generous: a loaded
machine must not look like a hang; nothing here hangs on purpose)."""


@pytest.fixture(scope="session")
def conformance_world() -> Iterator[World]:
    with world(timeout_s=TIMEOUT_S) as w:
        yield w
