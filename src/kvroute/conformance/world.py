"""Everything the suite runs against, started and stopped together: :func:`world`.

A world is a background event loop (:class:`~kvroute.conformance.runner.Harness`), a misbehaving
upstream (model ``faulty``), optionally a real emulated engine (``kvroute engine``, model ``emu``),
and a front door in front of both, made by a :data:`~kvroute.conformance.frontdoor.FrontDoorFactory`
(``kvroute serve`` by default). Another front door (Envoy with a picker) only needs its own factory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from kvroute.conformance.frontdoor import FrontDoor, FrontDoorFactory, emulated_engine, serve_front_door
from kvroute.conformance.runner import Harness, Suite, Target
from kvroute.conformance.upstream import MisbehavingUpstream

__all__ = ["World", "world"]


@dataclass(frozen=True)
class World:
    """A running world: run coroutines with ``harness.call``; ``targets``: the upstream's, then the
    engine's when there is one."""

    harness: Harness
    door: FrontDoor
    suite: Suite
    upstream: Target
    engine: Target | None

    @property
    def targets(self) -> list[Target]:
        return [self.upstream] if self.engine is None else [self.upstream, self.engine]


@contextlib.contextmanager
def world(
    factory: FrontDoorFactory = serve_front_door,
    engine_model: str | None = "emu",
    start_engine: bool = True,
    upstream_model: str = "faulty",
    upstream_port: int = 0,
    timeout_s: float = 10.0,
) -> Iterator[World]:
    """Start a world (module docstring). ``engine_model``: the real engine's model (None: no
    engine); ``start_engine``: start it (else one already serves it behind the front door);
    ``upstream_port``: the misbehaving upstream's port (0: a free one); ``timeout_s``: the bound on
    every wait of a case (seconds). Yields once every target answers through the front door."""
    harness = Harness()
    upstream = MisbehavingUpstream(upstream_model)
    try:
        harness.call(upstream.start(port=upstream_port))
        with contextlib.ExitStack() as stack:
            urls = [upstream.url]
            if engine_model is not None and start_engine:
                urls.append(stack.enter_context(emulated_engine(engine_model)))
            door = stack.enter_context(factory(urls))
            suite = Suite(door, timeout_s=timeout_s)
            w = World(
                harness,
                door,
                suite,
                Target("upstream", upstream_model, upstream),
                Target("engine", engine_model) if engine_model is not None else None,
            )
            harness.call(suite.ready(w.targets))
            yield w
    finally:
        harness.call(upstream.stop())
        harness.close()
