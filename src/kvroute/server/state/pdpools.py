"""The P/D router's bookkeeping of one instance (a prefill or a decode engine): the requests routed to
it and not answered yet, with the new prefill tokens of those not started, and its last scraped
``/metrics``. Its :meth:`PDInstance.view` is the routing core's :class:`~kvroute.views.InstanceView`:
BS = requests in flight, queued prefill = their new tokens until started. Mutated by the router's
handler only (one event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.server.state.backends import ScrapedMetrics
from kvroute.views import InstanceView

__all__ = ["PDBackend", "PDInstance"]


@dataclass(frozen=True, slots=True)
class PDBackend:
    """One engine of a pool: ``url`` (no trailing slash); ``kv_events``: its ZMQ KV event endpoint
    (None: the approximate view from routing history)."""

    url: str
    kv_events: str | None = None


@dataclass(slots=True)
class PDInstance:
    """The router's bookkeeping of one instance: requests in flight → new prefill tokens (0 once
    started), the last scrape."""

    index: int
    backend: PDBackend
    inflight: dict[str, int] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    scraped: ScrapedMetrics | None = None

    def view(self) -> InstanceView:
        waiting = len(self.inflight) - len(self.started)
        queued = sum(n for r, n in self.inflight.items() if r not in self.started)
        s = self.scraped
        return InstanceView(
            index=self.index,
            running=len(self.started),
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=s.kv_usage if s is not None else 0.0,
            kv_capacity_blocks=s.num_kv_blocks if s is not None else 0,
        )

    def add(self, rid: str, new_tokens: int) -> None:
        self.inflight[rid] = new_tokens

    def start(self, rid: str) -> None:
        if rid in self.inflight:
            self.started.add(rid)

    def done(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        self.started.discard(rid)
