"""Events per second over the last minutes, counted in a fixed ring of one-second slots.

:class:`PerSecond` costs one modulo and one increment per event (the decision log counts every
decision with it); reading a series walks ``size`` slots. Times are Unix seconds (``time.time()``);
a slot holds the count of the whole second it is stamped with, and is reused ``size`` seconds later.
"""

from __future__ import annotations

__all__ = ["PerSecond"]


class PerSecond:
    """Counts per whole second for the last ``size`` seconds (``size`` ≥ 2). ``add`` mutates."""

    __slots__ = ("_counts", "_stamps", "size")

    def __init__(self, size: int = 120) -> None:
        if size < 2:
            raise ValueError("a per-second ring keeps at least 2 seconds")
        self.size = size
        self._counts = [0] * size
        self._stamps = [-1] * size  # the whole second each slot counts (-1: never used)

    def add(self, t: float, n: int = 1) -> None:
        """Count ``n`` events at Unix time ``t`` (seconds)."""
        s = int(t)
        i = s % self.size
        if self._stamps[i] != s:
            self._stamps[i] = s
            self._counts[i] = 0
        self._counts[i] += n

    def series(self, now: float, seconds: int) -> list[int]:
        """Counts of the ``seconds`` whole seconds before the one containing ``now``, oldest first
        (the current second is still filling, so it is left out). ``seconds`` < ``size``."""
        if not 0 < seconds < self.size:
            raise ValueError(f"seconds must be in 1..{self.size - 1}")
        current = int(now)
        out = []
        for s in range(current - seconds, current):
            i = s % self.size
            out.append(self._counts[i] if self._stamps[i] == s else 0)
        return out
