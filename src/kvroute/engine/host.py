"""EngineHost: runs one :class:`~kvroute.engine.model.EngineModel` on an injected clock.

The model never reads a clock; a host owns one model and does, at every change and at every
wake-up: advance the model to the clock's time, hand its outputs to ``on_outputs``, hand its KV
events to ``on_events``, and (re)schedule its wake-up at the model's ``next_time()``. The clock is
anything with ``now()`` and ``call_at(when, fn)`` (:class:`Clock`): the simulator's event loop
(``kvroute.sim.loop.SimClock``, simulated seconds) and the wall clock on asyncio
(``kvroute.emulator.clock.WallClock``, scaled seconds) are its two implementations.

A wake-up is never cancelled when the model's next step end moves (a request arrival cuts a
decode stretch short): the host remembers the time it wants to be woken at and ignores a call for
any other time, so the clock schedules exactly one call per change of that time and a simulated
run's event order (time, priority, sequence number) stays the one the simulator always had.
Times are seconds on the clock's timeline.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from kvroute.engine.model import EngineModel
from kvroute.engine.types import EngineOutput, EngineRequest, KVEvent, ReqId

__all__ = ["Clock", "EngineHost"]


class Clock(Protocol):
    """A host's clock: the current time, and a way to be called back at a later one."""

    def now(self) -> float:
        """Current time in seconds (never decreases)."""
        ...

    def call_at(self, when: float, fn: Callable[[float], object]) -> None:
        """Call ``fn(when)`` once the clock reaches ``when`` seconds (at once if it passed)."""
        ...


class EngineHost:
    """One engine model on a clock. Mutates itself and its model; callbacks run synchronously."""

    __slots__ = ("_wake", "clock", "engine", "on_events", "on_outputs")

    def __init__(
        self,
        engine: EngineModel,
        clock: Clock,
        on_outputs: Callable[[list[EngineOutput]], object],
        on_events: Callable[[list[KVEvent]], object] | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.on_outputs = on_outputs
        self.on_events = on_events  # None: KV events are taken and dropped
        self._wake: float | None = None  # the time of the wake-up wanted (None: idle)

    @property
    def wake(self) -> float | None:
        """When the host is next woken (the model's step end), or None when idle."""
        return self._wake

    def add(self, *reqs: EngineRequest) -> float:
        """Add requests arriving now and return now. Steps that ended before now complete first,
        so a request never joins a step that began before it arrived; a step ending exactly now
        completes after all of ``reqs`` are queued, so they all join the step that starts now.
        Raises ValueError from the model (then the rest are not added)."""
        now = self.clock.now()
        eng = self.engine
        nt = eng.next_time()
        if nt is not None and nt < now:
            self._catch_up(now)
        try:
            add_request = eng.add_request
            for req in reqs:
                add_request(req, now)
        finally:
            self._run(now)
        return now

    def abort(self, req_id: ReqId) -> bool:
        """Abort a request now (frees its blocks); False if unknown or already ended."""
        now = self.clock.now()
        nt = self.engine.next_time()
        if nt is not None and nt < now:
            self._catch_up(now)
        try:
            return self.engine.abort(req_id, now)
        finally:
            self._run(now)

    def release(self, req_id: ReqId) -> bool:
        """Free the blocks a finished ``hold_blocks`` request kept, now; False if it holds none."""
        now = self.clock.now()
        nt = self.engine.next_time()
        if nt is not None and nt < now:
            self._catch_up(now)
        try:
            return self.engine.release(req_id, now)
        finally:
            self._run(now)

    def poll(self) -> None:
        """Advance to now and schedule the wake-up afresh (after the clock was (re)started: a
        wake-up it dropped is asked for again; a duplicate is ignored when it fires)."""
        self._wake = None
        self._run(self.clock.now())

    def _catch_up(self, now: float) -> None:
        """Complete the steps that ended strictly before ``now``."""
        outs = self.engine.advance(math.nextafter(now, -math.inf))
        if outs:
            self.on_outputs(outs)

    def _run(self, now: float) -> None:
        """Advance to ``now``, hand on outputs and KV events, (re)schedule the wake-up."""
        eng = self.engine
        outs = eng.advance(now)
        if outs:
            self.on_outputs(outs)
        events = eng.take_events()
        if events and self.on_events is not None:
            self.on_events(events)
        nt = eng.next_time()
        if nt is None:
            self._wake = None
        elif nt != self._wake:
            self._wake = nt
            self.clock.call_at(nt, self._on_wake)

    def _on_wake(self, t: float) -> None:
        if self._wake != t:
            return  # superseded: the step in progress was cut short, or the host is idle
        self._wake = None
        now = self.clock.now()
        self._run(now if now > t else t)
