"""A router's in-flight accounting and the instance views it builds from it and the replicas' stats.

Load as :mod:`kvroute.integrations.ray_serve` sees one replica, in the live router's manner:

- **the replica's own report** (its ``record_routing_stats``: running, waiting, queued prefill
  tokens, KV usage and capacity, and ``time``, the wall time of the snapshot), when it has one;
- **plus the requests routed since that snapshot** (by this router and, through the shared state,
  by the deployment's other routers): each counts as waiting, its new prefill tokens as queued;
- **minus this router's requests that completed since that snapshot** but were routed before it:
  the snapshot still counts them (Ray delivers stats a period or more late), so each one comes off
  the waiting count first, then the running count, and its prefill off the queued prefill
  (clamped at 0).

**Where prefill ends.** A request's prefill ends at its first token, long before it completes (on
the Ray example's emulated engine about 53 ms of a 266 ms request, docs/results/ray-serve.md); the
live router sees the first byte and moves the request from
waiting to running. A Ray router sees only dispatch and completion, so without more it would count
every request routed since the snapshot as waiting with its whole prefill queued until it completes,
and take a request that completed since the snapshot off the waiting count and the queued prefill
although the snapshot most likely counted it as running: both inflate the load of the replica that
served the latest turns, which is the replica holding their conversations. A replica that reports
``ttft_p50_s`` (its engine's median time from a request's arrival to its first token over recent
requests, seconds; the median, as a few requests queued behind a burst would skew a mean) lets the
view place the end of each prefill at *reserved at* + ``ttft_p50_s`` × its chunks (its new prefill
tokens over the replica's ``max_num_batched_tokens``, at least 1; 1 without the budget: the median
request is taken as one chunk): a request routed since the snapshot and older than that counts as
running with no prefill left; a completed request whose prefill ended by the snapshot comes off the
running count only. Without the key, the rules above.

Without a report every in-flight request counts as waiting with its new prefill queued, until it
completes. A reservation is made when the core decides (so the next decision sees it at once),
moved to the replica Ray actually sent the request to (``on_request_routed``: Ray may fall back to
the next replica of the decision's order when the first is full), and released on completion
(``on_request_completed``, which Ray calls once per dispatched request, success or not). A
reservation never dispatched (the caller gave up) is dropped after ``ttl_s``.

Units: wall-clock seconds, tokens. Mutated by :meth:`reserve`, :meth:`move`, :meth:`release`,
:meth:`expire`, :meth:`drop_replica`; nothing else.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.integrations.ray_state import Load
from kvroute.views import InstanceView

__all__ = ["STAT_KEYS", "InFlight", "Reservation", "instance_view"]

STAT_KEYS = (
    "running",
    "waiting",
    "queued_prefill_tokens",
    "kv_usage",
    "kv_capacity_blocks",
    "time",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "usage",
    "max_num_batched_tokens",
    "max_num_seqs",
    "ttft_p50_s",
)
"""The keys of a replica's ``record_routing_stats`` dict this adapter reads (all optional)."""


@dataclass(slots=True)
class Reservation:
    """One in-flight request: its replica, when it was reserved, its new prefill tokens there."""

    replica: str
    at: float
    prefill: int
    dispatched: bool = False


class InFlight:
    """Reservations keyed by Ray's internal request id (module docstring)."""

    def __init__(self, ttl_s: float = 60.0, completed_kept: int = 4096) -> None:
        self.ttl_s = ttl_s
        self._rows: dict[str, Reservation] = {}
        # recently completed: (replica, reserved at, completed at, prefill), newest last
        self._done: deque[tuple[str, float, float, int]] = deque(maxlen=completed_kept)

    def __len__(self) -> int:
        return len(self._rows)

    def reserve(self, request: str, replica: str, prefill: int, now: float) -> None:
        """A decision sent ``request`` to ``replica`` (replaces an earlier one for a retry)."""
        self._rows[request] = Reservation(replica, now, prefill)

    def move(self, request: str, replica: str, prefill: int, now: float) -> None:
        """Ray dispatched ``request`` to ``replica`` (maybe not the decision's first choice)."""
        row = self._rows.get(request)
        if row is None or row.replica != replica:
            self._rows[request] = Reservation(replica, now if row is None else row.at, prefill, True)
        else:
            row.dispatched = True

    def release(self, request: str, now: float) -> Reservation | None:
        """``request`` completed (or was rejected) at ``now``: it no longer counts."""
        row = self._rows.pop(request, None)
        if row is not None and row.dispatched:
            self._done.append((row.replica, row.at, now, row.prefill))
        return row

    def completed(self) -> dict[str, list[tuple[float, float, int]]]:
        """Recently completed requests by replica: (reserved at, completed at, prefill)."""
        out: dict[str, list[tuple[float, float, int]]] = {}
        for replica, at, done, prefill in self._done:
            out.setdefault(replica, []).append((at, done, prefill))
        return out

    def expire(self, now: float) -> int:
        """Drop reservations never dispatched within ``ttl_s``; returns how many."""
        old = [k for k, r in self._rows.items() if not r.dispatched and now - r.at > self.ttl_s]
        for k in old:
            del self._rows[k]
        return len(old)

    def drop_replica(self, replica: str) -> None:
        """``replica`` is gone: its requests no longer count (Ray fails or retries them)."""
        for k in [k for k, r in self._rows.items() if r.replica == replica]:
            del self._rows[k]
        kept = [d for d in self._done if d[0] != replica]
        self._done.clear()
        self._done.extend(kept)

    def count(self, replica: str) -> int:
        return sum(1 for r in self._rows.values() if r.replica == replica)

    def load(self) -> Load:
        """This router's load report for the shared state."""
        out: Load = {}
        for r in self._rows.values():
            out.setdefault(r.replica, []).append((r.at, r.prefill))
        return out


def _int(stats: Mapping[str, Any], key: str) -> int:
    v = stats.get(key)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0 else 0


def _seconds(stats: Mapping[str, Any], key: str) -> float | None:
    v = stats.get(key)
    if isinstance(v, int | float) and not isinstance(v, bool) and 0.0 <= v < float("inf"):
        return float(v)
    return None


def instance_view(
    index: int,
    stats: Mapping[str, Any],
    inflight: list[tuple[float, int]],
    completed: list[tuple[float, float, int]] = (),  # type: ignore[assignment]
    now: float | None = None,
) -> InstanceView:
    """The view of one replica: its ``stats`` (possibly empty) plus the ``inflight`` requests
    (reserved at, new prefill) routed to it since the stats' ``time`` (all of them without one),
    minus the ``completed`` ones (reserved at, completed at, prefill) the stats still count. With
    ``now`` (seconds, the clock of the reservations) and the stats' ``ttft_p50_s``, requests whose
    prefill has ended by the estimate count as running with no prefill (module docstring)."""
    since = stats.get("time")
    if isinstance(since, int | float) and not isinstance(since, bool) and "running" in stats:
        ttft = _seconds(stats, "ttft_p50_s")
        late = [(t, p) for t, p in inflight if t > since]
        gone = [(t, p) for t, done, p in completed if t <= since < done]
        if ttft is None:  # no estimate of where prefill ends: every one still prefilling
            late_prefilling, late_running = [p for _, p in late], 0
            gone_prefilling, gone_running = [p for _, p in gone], 0
        else:
            budget = _int(stats, "max_num_batched_tokens")

            def ends(t: float, p: int) -> float:  # estimated end of the prefill of (reserved at, p)
                return t + ttft * (max(1, -(-p // budget)) if budget else 1)

            late_prefilling = [p for t, p in late if now is None or ends(t, p) > now]
            late_running = len(late) - len(late_prefilling)
            gone_prefilling = [p for t, p in gone if ends(t, p) > since]
            gone_running = len(gone) - len(gone_prefilling)
        running = _int(stats, "running") + late_running
        waiting = _int(stats, "waiting") + len(late_prefilling)
        off_waiting = min(len(gone_prefilling), _int(stats, "waiting"))
        waiting -= off_waiting
        running = max(0, running - gone_running - (len(gone_prefilling) - off_waiting))
        queued = max(0, _int(stats, "queued_prefill_tokens") - sum(gone_prefilling)) + sum(late_prefilling)
        usage = stats.get("kv_usage")
        return InstanceView(
            index=index,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=min(1.0, max(0.0, float(usage))) if isinstance(usage, int | float) else 0.0,
            kv_capacity_blocks=_int(stats, "kv_capacity_blocks"),
            max_batched_tokens=_int(stats, "max_num_batched_tokens"),
            max_num_seqs=_int(stats, "max_num_seqs"),
        )
    return InstanceView(
        index=index,
        waiting=len(inflight),
        queued_prefill_tokens=sum(p for _, p in inflight),
        max_batched_tokens=_int(stats, "max_num_batched_tokens"),
        max_num_seqs=_int(stats, "max_num_seqs"),
    )
