"""Two-stage KV hot-spot detector (design §4.1; LMetric paper §5.2, formula (2)).

Multiplying P-token by BS fails only when a prefix class ``c`` is so popular that the instances
caching it cannot carry its load: with ``x`` the share of requests in class ``c`` over the window,
``M`` the instances caching ``c``'s prefix and ``N`` all instances, the paper's condition is
``x / (1 − x) > |M| / (N − |M|)`` (equivalently ``x > |M| / N``: the class's share of the traffic
exceeds its share of the instances).

- **Window**: the last ``window_s`` seconds (default 60) of requests; ``x = n_c / n`` over it.
- **Monitored classes**: the ``top_k`` (default 5) classes with the most *cache hits* in the window
  (requests whose class prefix was cached on at least one instance when routed); ties → smaller key.
  The ranking is refreshed at most every ``rank_interval_s`` seconds.
- **Stage 1 (alarm)**: a request of a monitored class with ``0 < |M| < N`` and at least
  ``min_window_requests`` requests in the window raises the class's alarm when
  ``n_c · (N − |M|) > |M| · (n − n_c)`` — the condition cross-multiplied in integers, so equality is
  exact and does *not* alarm. ``x = 1`` (only this class) alarms whenever ``|M| < N``.
- **Stage 2 (mitigation)**: after the alarm, each request of the class routed into ``M`` extends a
  streak (one routed outside resets it); when the streak exceeds ``streak_factor · |M|`` (default
  2·|M|) mitigation starts. What it does depends on ``spread``:

  - ``"replica"`` (default): the *next* request of the class goes outside ``M`` (to the non-holder
    with the lowest P-token × (BS + 1), see :class:`~kvroute.routing.guarded.Guarded`), which then
    caches the prefix — one new holder — and the streak starts again from 0: another replica only
    after another ``streak_factor · |M| + 1`` class requests went into ``M``. Between replicas the
    inner policy routes the class and uses every holder's cache, the new ones included. The extra
    prefill is bounded by one full prefix per streak.
  - ``"all"`` (the first implementation): *every* later request of the class is routed by load alone
    outside ``M`` until the alarm clears. On a bursty trace whose hot requests are cheap when they hit
    (a 6k-token prefix, a few hundred new tokens), a burst arriving before any new holder has
    finished its prefill is sprayed over non-holders, each recomputing the whole prefix while the
    holders were not saturated (issue 16, ``hotspot-trace`` at 2×; docs/results/features.md).
- **Clear**: the first request of the class for which the condition no longer holds (or the class
  left the top ``k``) clears its alarm and mitigation.

Every alarm, mitigation and clear is counted and recorded as a :class:`HotspotEvent` (last 1,000 kept).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from kvroute.errors import UserError
from kvroute.features.prefix import DEFAULT_CLASS_TOKENS
from kvroute.features.window import SlidingCounts

__all__ = ["SPREAD_MODES", "HotspotConfig", "HotspotDetector", "HotspotEvent", "alarm_condition"]

EVENTS_KEPT = 1000
SPREAD_MODES = ("replica", "all")
"""How mitigation spreads a hot class: one new holder per stage-2 streak, or every request (see above)."""


@dataclass(frozen=True, slots=True)
class HotspotConfig:
    """Detector settings (seconds, tokens, counts); see the module docstring.

    ``mitigate``: False → detection only (alarms and mitigations are counted and logged; routing is
    unchanged). ``exclude_hot``: under mitigation, route among the instances *outside* ``M`` (all
    instances if none is outside) — otherwise among all instances. ``spread``: one of
    :data:`SPREAD_MODES` (see the module docstring).
    """

    window_s: float = 60.0
    top_k: int = 5
    class_tokens: int = DEFAULT_CLASS_TOKENS
    streak_factor: float = 2.0
    min_window_requests: int = 20
    rank_interval_s: float = 1.0
    exclude_hot: bool = True
    mitigate: bool = True
    spread: str = "replica"

    def check(self) -> HotspotConfig:
        """Return self; raise :class:`UserError` for a value out of range."""
        if not self.window_s > 0 or self.top_k < 1 or self.class_tokens < 1:
            raise UserError("hotspot: window_s must be > 0, top_k and class_tokens >= 1")
        if not self.streak_factor >= 0 or self.min_window_requests < 1 or not self.rank_interval_s >= 0:
            raise UserError("hotspot: streak_factor >= 0, min_window_requests >= 1, rank_interval_s >= 0")
        if self.spread not in SPREAD_MODES:
            raise UserError(f"hotspot: spread must be one of {', '.join(SPREAD_MODES)}, got {self.spread!r}")
        return self


@dataclass(frozen=True, slots=True)
class HotspotEvent:
    """``kind``: ``"alarm"``, ``"mitigation"`` or ``"clear"``; ``share`` = x, ``holders`` = |M|,
    ``instances`` = N, at ``time`` (seconds)."""

    time: float
    kind: str
    key: int
    share: float
    holders: int
    instances: int

    def message(self) -> str:
        return (
            f"hotspot {self.kind}: prefix class {self.key:#x} share {self.share:.3f} "
            f"on {self.holders}/{self.instances} instances"
        )


def alarm_condition(class_requests: int, window_requests: int, holders: int, instances: int) -> bool:
    """Stage 1: ``x/(1−x) > |M|/(N−|M|)`` with ``x = class_requests / window_requests``, evaluated
    exactly as ``n_c·(N−|M|) > |M|·(n−n_c)``; False when ``|M|`` is 0 or ``N``."""
    if holders <= 0 or holders >= instances or class_requests <= 0:
        return False
    return class_requests * (instances - holders) > holders * (window_requests - class_requests)


@dataclass(slots=True)
class _Alarm:
    holders: int
    instances: int
    streak: int = 0
    mitigating: bool = False


class HotspotDetector:
    """The detector. Call :meth:`observe` for every request before routing it and :meth:`routed`
    after; mutates only itself."""

    def __init__(self, config: HotspotConfig) -> None:
        self.config = config.check()
        self.window = SlidingCounts(config.window_s)
        self._alarms: dict[int, _Alarm] = {}
        self._top: frozenset[int] = frozenset()
        self._ranked_at = float("-inf")
        self.alarms = 0
        self.mitigations = 0
        self.clears = 0
        self.mitigated_requests = 0
        self.deferred = 0  # armed replicas held back because the holders were not saturated
        self.events: deque[HotspotEvent] = deque(maxlen=EVENTS_KEPT)
        self.event_count = 0  # events ever recorded (the deque keeps the last EVENTS_KEPT)

    @property
    def active_alarms(self) -> int:
        return len(self._alarms)

    @property
    def active_mitigations(self) -> int:
        return sum(a.mitigating for a in self._alarms.values())

    def active(self) -> list[tuple[int, float, int, int, bool]]:
        """The classes in alarm now: ``(key, share x over the window, holders |M|, instances N,
        mitigating)``, by key. Reads only."""
        w = self.window
        total = w.total
        return [
            (key, w.count.get(key, 0) / total if total else 0.0, a.holders, a.instances, a.mitigating)
            for key, a in sorted(self._alarms.items())
        ]

    def _rank(self, now: float) -> frozenset[int]:
        if now - self._ranked_at >= self.config.rank_interval_s:
            hits = self.window.hits
            top = heapq.nsmallest(self.config.top_k, hits, key=lambda k: (-hits[k], k))
            self._top = frozenset(top)
            self._ranked_at = now
        return self._top

    def observe(self, key: int, holders: int, instances: int, now: float, saturated: bool = True) -> bool:
        """Record a request of class ``key`` (0: none) whose class prefix is cached on ``holders``
        of the ``instances`` candidates; return True if it must be routed outside the holders (one new
        replica in ``"replica"`` mode, by load alone in ``"all"`` mode)."""
        w = self.window
        w.add(key, now, holders > 0)
        if not key:
            return False
        state = self._alarms.get(key)
        monitored = key in self._rank(now)
        n_c = w.count[key]
        total = w.total
        hot = (
            monitored
            and total >= self.config.min_window_requests
            and alarm_condition(n_c, total, holders, instances)
        )
        if not hot:
            if state is not None:
                del self._alarms[key]
                self.clears += 1
                self._event(now, "clear", key, n_c / total, holders, instances)
            return False
        if state is None:
            self._alarms[key] = _Alarm(holders, instances)
            self.alarms += 1
            self._event(now, "alarm", key, n_c / total, holders, instances)
            return False
        state.holders = holders
        state.instances = instances
        if state.mitigating and self.config.mitigate:
            if self.config.spread == "replica":
                if not saturated:  # no instance is less loaded than the holders: stay armed
                    self.deferred += 1
                    return False
                state.mitigating = False  # this request makes one new holder; count again
                state.streak = 0
            self.mitigated_requests += 1
            return True
        return False

    def routed(self, key: int, into_hot: bool, now: float) -> None:
        """Stage 2: the request of class ``key`` just observed went into ``M`` (``into_hot``) or not."""
        state = self._alarms.get(key)
        if state is None or state.mitigating:
            return
        if not into_hot:
            state.streak = 0
            return
        state.streak += 1
        if state.streak > self.config.streak_factor * state.holders:
            state.mitigating = True
            self.mitigations += 1
            n_c = self.window.count.get(key, 0)
            share = n_c / self.window.total if self.window.total else 0.0
            self._event(now, "mitigation", key, share, state.holders, state.instances)

    def _event(self, now: float, kind: str, key: int, share: float, holders: int, instances: int) -> None:
        self.events.append(HotspotEvent(now, kind, key, share, holders, instances))
        self.event_count += 1

    def summary(self) -> dict[str, object]:
        """Counters and the first recorded events, for the simulator's JSON output."""
        return {
            "alarms": self.alarms,
            "mitigations": self.mitigations,
            "clears": self.clears,
            "mitigated_requests": self.mitigated_requests,
            "deferred": self.deferred,
            "events": [
                {
                    "time": round(e.time, 3),
                    "kind": e.kind,
                    "share": round(e.share, 4),
                    "holders": e.holders,
                    "instances": e.instances,
                }
                for e in list(self.events)[:50]
            ],
        }
