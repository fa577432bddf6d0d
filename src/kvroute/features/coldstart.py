"""Cold start (design §4.2): warming instances and the frequent prefixes to preload on them.

An instance that joins, restarts or drops its whole cache (``AllBlocksCleared``) is *warming* for
``window_s`` seconds (default 300). While warming (see :class:`~kvroute.routing.guarded.Guarded`):

- **BS cap** (``cap_mode``), with ``cap = bs_cap_fraction × mean BS of the warm instances`` (default
  half the mean; no warm instance → no cap):

  - ``"admit"`` (default): the warming instance is not chosen while its BS (running + waiting) is at
    or above ``max(1, cap)`` and another instance is eligible — it is *given* at most half the
    average load while its cache is cold;
  - ``"score"``: the BS its score uses is ``min(BS, cap)`` — the other reading of "cap BS at half the
    mean", which makes it look *less* loaded and pulls traffic onto it;
  - ``"none"``: no cap (only the score offset and the preloads).

  ``docs/results/features.md`` measures the three around a scale-out.
- **Score**: ``(P-token + p_token_offset) × (BS + 1)`` with ``p_token_offset`` = 10 (lmetric only).
- **Preload**: the ``preload_prefixes`` most frequent prefix classes of the last ``preload_window_s``
  seconds are sent to it as ``max_tokens = 1`` requests whose prompt is the class's longest common
  prefix (:class:`FrequentPrefixes`), so its first real requests hit the cache.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.errors import UserError

CAP_MODES = ("admit", "score", "none")

__all__ = ["ColdStartConfig", "FrequentPrefixes", "Prefix", "WarmupTracker", "common_prefix_blocks"]


@dataclass(frozen=True, slots=True)
class ColdStartConfig:
    """See the module docstring. Seconds, tokens, counts."""

    window_s: float = 300.0
    bs_cap_fraction: float = 0.5
    p_token_offset: int = 10
    preload_prefixes: int = 4
    preload_window_s: float = 600.0
    preload_max_blocks: int = 2048
    cap_mode: str = "admit"

    def check(self) -> ColdStartConfig:
        if self.cap_mode not in CAP_MODES:
            raise UserError(
                f"cold start: cap mode must be one of {', '.join(CAP_MODES)}, got {self.cap_mode!r}"
            )
        if not self.window_s >= 0 or not self.bs_cap_fraction > 0 or self.p_token_offset < 0:
            raise UserError("cold start: window_s >= 0, bs_cap_fraction > 0, p_token_offset >= 0")
        if self.preload_prefixes < 0 or not self.preload_window_s > 0 or self.preload_max_blocks < 1:
            raise UserError(
                "cold start: preload_prefixes >= 0, preload_window_s > 0, preload_max_blocks >= 1"
            )
        return self


class WarmupTracker:
    """Which instances are warming: ``reset(i, now)`` starts ``i``'s window. Instances are keyed by
    ``InstanceView.index``. Mutated by ``reset`` and ``forget``."""

    __slots__ = ("_until", "resets", "window_s")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._until: dict[int, float] = {}
        self.resets = 0

    def reset(self, instance: int, now: float) -> None:
        """``instance`` joined, restarted or lost its cache at ``now``."""
        self._until[instance] = now + self.window_s
        self.resets += 1

    def forget(self, instance: int) -> None:
        self._until.pop(instance, None)

    def warming(self, instance: int, now: float) -> bool:
        until = self._until.get(instance)
        if until is None:
            return False
        if now >= until:
            del self._until[instance]
            return False
        return True

    def any_warming(self) -> bool:
        """True if some window may still be open (cheap check before per-instance lookups)."""
        return bool(self._until)


def common_prefix_blocks(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two block chains. Chained ids make equality at position j imply
    equality before it, so this is a binary search (O(log n))."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Prefix:
    """A frequent prefix: its class ``key``, the longest common prefix ``chain`` (block ids) of the
    class's recent requests, its ``tokens`` (``len(chain) × block_size`` token ids when known, else
    None), the ``model`` last seen with it, and ``count`` requests in the window."""

    key: int
    chain: tuple[int, ...]
    tokens: tuple[int, ...] | None
    model: str | None
    count: int


class FrequentPrefixes:
    """Request counts per prefix class over ``window_s`` seconds, and per class the longest common
    prefix of its requests (capped at ``max_blocks``), for preloading. Memory: one entry per request
    in the window plus one chain per live class."""

    def __init__(self, window_s: float, block_size: int, max_blocks: int = 2048) -> None:
        self.window_s = window_s
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._events: deque[tuple[float, int]] = deque()
        self._count: dict[int, int] = {}
        self._chain: dict[int, tuple[int, ...]] = {}
        self._tokens: dict[int, tuple[int, ...] | None] = {}
        self._model: dict[int, str | None] = {}

    def observe(
        self,
        key: int,
        chain: Sequence[int],
        now: float,
        tokens: Sequence[int] | None = None,
        model: str | None = None,
    ) -> None:
        """Record a request of class ``key`` (0 is ignored) with block ids ``chain`` and, when
        known, its prompt ``tokens``."""
        self._expire(now)
        if not key:
            return
        self._events.append((now, key))
        self._count[key] = self._count.get(key, 0) + 1
        old = self._chain.get(key)
        if old is None:
            keep = min(len(chain), self.max_blocks)
            self._chain[key] = tuple(chain[:keep])
            self._tokens[key] = tuple(tokens[: keep * self.block_size]) if tokens is not None else None
        else:
            keep = common_prefix_blocks(old, chain)
            if keep < len(old):
                self._chain[key] = old[:keep]
                t = self._tokens[key]
                self._tokens[key] = t[: keep * self.block_size] if t is not None else None
        if model is not None:
            self._model[key] = model

    def _expire(self, now: float) -> None:
        deadline = now - self.window_s
        ev = self._events
        while ev and ev[0][0] <= deadline:
            _, key = ev.popleft()
            c = self._count[key] - 1
            if c:
                self._count[key] = c
            else:
                del self._count[key], self._chain[key], self._tokens[key]
                self._model.pop(key, None)

    def top(self, n: int, now: float) -> list[Prefix]:
        """The ``n`` most frequent classes (ties → smaller key), most frequent first."""
        self._expire(now)
        count = self._count
        keys = heapq.nsmallest(n, count, key=lambda k: (-count[k], k))
        return [Prefix(k, self._chain[k], self._tokens[k], self._model.get(k), count[k]) for k in keys]
