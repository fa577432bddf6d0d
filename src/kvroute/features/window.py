"""Counts per key over a sliding time window (seconds; time is passed in and must not decrease)."""

from __future__ import annotations

from collections import deque

__all__ = ["SlidingCounts"]


class SlidingCounts:
    """Events ``(time, key, hit)`` of the last ``window_s`` seconds, counted per key.

    ``count[key]``: events of ``key`` in the window; ``hits[key]``: those with ``hit`` (keys with no
    hit are absent); ``total``: all events. Memory: one entry per event in the window. Mutated by
    :meth:`add` and :meth:`expire` only.
    """

    __slots__ = ("_events", "count", "hits", "window_s")

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._events: deque[tuple[float, int, bool]] = deque()
        self.count: dict[int, int] = {}
        self.hits: dict[int, int] = {}

    @property
    def total(self) -> int:
        return len(self._events)

    def expire(self, now: float) -> None:
        """Drop events at or before ``now − window_s``."""
        deadline = now - self.window_s
        events, count, hits = self._events, self.count, self.hits
        while events and events[0][0] <= deadline:
            _, key, hit = events.popleft()
            c = count[key] - 1
            if c:
                count[key] = c
            else:
                del count[key]
            if hit:
                h = hits[key] - 1
                if h:
                    hits[key] = h
                else:
                    del hits[key]

    def add(self, key: int, now: float, hit: bool = False) -> None:
        """Expire, then record one event of ``key`` at ``now``."""
        self.expire(now)
        self._events.append((now, key, hit))
        self.count[key] = self.count.get(key, 0) + 1
        if hit:
            self.hits[key] = self.hits.get(key, 0) + 1
