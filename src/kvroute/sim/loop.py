"""A deterministic discrete-event loop.

Events are ordered by (time, priority, sequence number); the sequence number comes from a counter
owned by the loop, so equal-time, equal-priority events run in the order they were scheduled.
Times are seconds of simulated time.
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
        self._heap: list[tuple[float, int, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0

    def schedule(self, time: float, priority: int, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at ``time`` (not before ``now``)."""
        if time < self.now:
            raise ValueError(f"event in the past: {time} < {self.now}")
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, fn, args))

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run_until(self, until: float | None = None) -> None:
        """Run events with time <= ``until`` (all of them when None)."""
        heap = self._heap
        pop = heapq.heappop
        while heap and (until is None or heap[0][0] <= until):
            time, _, _, fn, args = pop(heap)
            self.now = time
            fn(*args)
