"""A deterministic discrete-event loop.

Events are ordered by (time, priority, sequence number); the sequence number comes from a counter
owned by the loop, so equal-time, equal-priority events run in the order they were scheduled.
Times are seconds of simulated time. :class:`SimClock` lets an
:class:`~kvroute.engine.host.EngineHost` run on the loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

# Priorities at equal times: KV-event deliveries first (a decision at t sees events due at t),
# then arrivals (a request arriving when a step ends joins the next step), then engine wake-ups.
PRIO_DELIVERY = 0
PRIO_ARRIVAL = 1
PRIO_ENGINE = 2


class EventLoop:
    """Runs callbacks in (time, priority, seq) order. Mutates only itself."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., object], tuple[Any, ...]]] = []
        self._seq = 0

    def schedule(self, time: float, priority: int, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` at ``time`` (not before ``now``)."""
        if time < self.now:
            raise ValueError(f"event in the past: {time} < {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, fn, args))

    def __len__(self) -> int:
        return len(self._heap)

    def run_until(self, until: float | None = None) -> None:
        """Run events with time <= ``until`` (all of them when None)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and (until is None or heap[0][0] <= until):
            time, _, _, fn, args = pop(heap)
            self.now = time
            fn(*args)


class SimClock:
    """The loop as an engine host's clock (``kvroute.engine.host.Clock``): ``call_at`` schedules
    at ``priority`` (engine wake-ups: ``PRIO_ENGINE``), so a host's wake-ups take their place in the
    loop's (time, priority, seq) order like any other event."""

    __slots__ = ("loop", "priority")

    def __init__(self, loop: EventLoop, priority: int = PRIO_ENGINE) -> None:
        self.loop = loop
        self.priority = priority

    def now(self) -> float:
        return self.loop.now

    def call_at(self, when: float, fn: Callable[[float], object]) -> None:
        """Run ``fn(when)`` at ``when`` (simulated seconds, not before now)."""
        self.loop.schedule(when, self.priority, fn, when)
