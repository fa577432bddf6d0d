"""What the kvroute routers of one Ray Serve deployment share: routing history and in-flight load.

Ray Serve builds one request router per handle and per proxy, so a deployment has several routers,
each deciding alone. Two things one router learns matter to the others:

- **routing history** (the approximate KV view: "replica R received a prompt with block chain C at
  time t"), appended to a bounded journal that every router reads from its own cursor;
- **in-flight load** (requests a router sent and that have not completed, each with the time it was
  reserved and the prefill tokens it brings), replaced wholesale by each router's report and summed
  over the *other* routers for the answer.

:class:`SharedRoutingState` is that state as a plain class (no Ray, no clock reads unless given):
:mod:`kvroute.integrations.ray_serve` runs it as a named, detached actor per deployment (namespace
``serve::<app>::<deployment>``, as Ray Serve LLM's prefix tree actor) and calls :meth:`sync` from a
background task, never on the decision path. Replicas are named by their full replica id string, so
routers that number replicas differently agree.

Units: times are wall-clock seconds (``time.time()`` on the routers' machines); tokens are tokens.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

__all__ = ["Load", "Routed", "SharedRoutingState", "SyncReply"]

Routed = tuple[str, tuple[int, ...], float]
"""One routing-history entry: (replica id, block chain, wall time routed)."""
Load = dict[str, list[tuple[float, int]]]
"""In-flight load: replica id → one (reserved at, new prefill tokens) per in-flight request."""
SyncReply = tuple[int, list[Routed], Load]
"""(new cursor, other routers' history since the caller's cursor, other routers' summed load)."""


class SharedRoutingState:
    """The journal and the load table (module docstring).

    - ``history_limit``: entries the journal keeps (oldest dropped first); a router whose cursor fell
      behind the oldest kept entry reads from the oldest (it misses what was dropped).
    - ``load_ttl_s``: a router that has not reported for this long is presumed gone and its load no
      longer counts (its process died without saying so).

    Mutated only by :meth:`sync` and :meth:`forget_replica`. Single-threaded (an actor's default).
    """

    def __init__(
        self, history_limit: int = 65536, load_ttl_s: float = 30.0, clock: Callable[[], float] = time.time
    ) -> None:
        if history_limit < 1:
            raise ValueError(f"history_limit must be at least 1 (got {history_limit})")
        self._log: deque[tuple[int, str, Routed]] = deque(maxlen=history_limit)
        self._seq = 0
        self._loads: dict[str, tuple[float, Load]] = {}
        self.load_ttl_s = load_ttl_s
        self._clock = clock

    def sync(self, router: str, cursor: int, routed: Sequence[Routed], load: Load) -> SyncReply:
        """Append ``router``'s new history, replace its load report, and answer with what the others
        did since ``cursor`` (0 on the first call) and their load now."""
        for entry in routed:
            self._seq += 1
            self._log.append((self._seq, router, (entry[0], tuple(entry[1]), float(entry[2]))))
        now = self._clock()
        self._loads[router] = (now, load)
        for name in [n for n, (t, _) in self._loads.items() if now - t > self.load_ttl_s]:
            del self._loads[name]
        news = [e for seq, who, e in self._log if seq > cursor and who != router]
        others: Load = {}
        for name, (_, rows) in self._loads.items():
            if name == router:
                continue
            for replica, items in rows.items():
                others.setdefault(replica, []).extend(items)
        return self._seq, news, others

    def forget_replica(self, replica: str) -> None:
        """``replica`` left: drop its history and load rows (routers drop it on their own too)."""
        kept = [e for e in self._log if e[2][0] != replica]
        self._log.clear()
        self._log.extend(kept)
        for _, rows in self._loads.values():
            rows.pop(replica, None)

    def stats(self) -> dict[str, int]:
        """Sizes, for tests and logs: journal entries, sequence number, routers reporting load."""
        return {"history": len(self._log), "seq": self._seq, "routers": len(self._loads)}
