"""The wall clock on asyncio as an engine host's clock (``kvroute.engine.host.Clock``).

Model time (seconds) = (clock() − start) × ``time_scale``, never decreasing: a wake-up that fires
(slightly early, as asyncio timers may) at model time ``t`` moves the model clock to at least ``t``.
Wake-ups are ``loop.call_later`` timers; ``close`` cancels those pending and ignores later ones
until the next ``start``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

__all__ = ["WallClock"]


class WallClock:
    """Scaled wall-clock time on the running asyncio loop. Use from the loop's thread only."""

    def __init__(self, time_scale: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.time_scale = time_scale
        self._clock = clock
        self._t0 = clock()
        self._last = 0.0
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._ids = itertools.count()
        self._closed = False

    def start(self) -> None:
        """Model time 0 is now."""
        self._t0 = self._clock()
        self._last = 0.0
        self._closed = False

    def now(self) -> float:
        """Current model time in seconds (never decreases)."""
        t = (self._clock() - self._t0) * self.time_scale
        if t > self._last:
            self._last = t
        return self._last

    def call_at(self, when: float, fn: Callable[[float], object]) -> None:
        """Call ``fn(when)`` on the running loop at model time ``when`` (soon if it passed);
        nothing once closed."""
        if self._closed:
            return
        delay = self._t0 + when / self.time_scale - self._clock()
        key = next(self._ids)
        self._timers[key] = asyncio.get_running_loop().call_later(max(delay, 0.0), self._fire, key, when, fn)

    def close(self) -> None:
        """Cancel every pending wake-up; schedule none until ``start``."""
        self._closed = True
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()

    @property
    def pending(self) -> int:
        """Wake-ups scheduled and not yet fired or cancelled."""
        return len(self._timers)

    def _fire(self, key: int, when: float, fn: Callable[[float], object]) -> None:
        del self._timers[key]
        if when > self._last:
            self._last = when
        fn(when)
