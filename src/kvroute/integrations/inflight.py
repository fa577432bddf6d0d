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

**Which requests the snapshot counts.** Times alone cannot say: a snapshot stamped after a
request's reservation may have been taken while the request was still in transit to the replica
(the snapshot misses it, and it is not "routed since" either), and one stamped before a request's
completion reached this router may have been taken after the engine had finished it (the snapshot
no longer counts it, yet the rule above takes it off again). Either way a request in flight
vanishes from the load, for as long as that snapshot is the latest (Ray delivers them up to a
second late on a loaded machine): the next request then sees an idle replica where one is busy.
A replica that reports ``requests`` (``[[internal request id, prefill tokens left], ...]`` of the
requests its ``running`` and ``waiting`` count, read at the same instant) settles it for this
router's own requests: one not in the list is added (as above), one in the list that has completed
comes off as the snapshot counted it (off the waiting count and its prefill left off the queued
prefill while it had prefill left, else off the running count); the times decide only for the
requests of the deployment's other routers (their load comes without ids).

**KV blocks** (``decode_blocks``): the snapshot's blocks in use, ``kv_usage`` × ``kv_capacity_blocks``
(0 without both). This is the one view that does not follow the simulator's and the live router's
rule (the engine's blocks in use plus the prompt blocks of the requests routed since the copy:
:attr:`kvroute.views.InstanceView.decode_blocks`): a reservation here holds its new prefill tokens
only, not its prompt's length, so a request routed since the snapshot adds no blocks (its new tokens
count in the queued prefill and the waiting count, as above).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvroute.integrations.ray_state import Load
from kvroute.views import InstanceView

__all__ = ["STAT_KEYS", "Done", "InFlight", "Reservation", "Row", "instance_view"]

Row = tuple[float, int] | tuple[float, int, str]
"""An in-flight request: (reserved at, new prefill tokens[, Ray's internal request id])."""
Done = tuple[float, float, int] | tuple[float, float, int, str]
"""A completed request: (reserved at, completed at, prefill tokens[, Ray's internal request id])."""

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
    "requests",
)
"""The keys of a replica's ``record_routing_stats`` dict this adapter reads (all optional)."""


@dataclass(slots=True)
class Reservation:
    """One in-flight request: its replica, when it was reserved, its new prefill tokens there."""

    replica: str
    at: float
    prefill: int
    dispatched: bool = False
    request: str = ""


class InFlight:
    """Reservations keyed by Ray's internal request id (module docstring)."""

    def __init__(self, ttl_s: float = 60.0, completed_kept: int = 4096) -> None:
        self.ttl_s = ttl_s
        self._rows: dict[str, Reservation] = {}
        # recently completed: (replica, reserved at, completed at, prefill, request id), newest last
        self._done: deque[tuple[str, float, float, int, str]] = deque(maxlen=completed_kept)

    def __len__(self) -> int:
        return len(self._rows)

    def reserve(self, request: str, replica: str, prefill: int, now: float) -> None:
        """A decision sent ``request`` to ``replica`` (replaces an earlier one for a retry)."""
        self._rows[request] = Reservation(replica, now, prefill, request=request)

    def move(self, request: str, replica: str, prefill: int, now: float) -> None:
        """Ray dispatched ``request`` to ``replica`` (maybe not the decision's first choice)."""
        row = self._rows.get(request)
        if row is None or row.replica != replica:
            self._rows[request] = Reservation(replica, now if row is None else row.at, prefill, True, request)
        else:
            row.dispatched = True

    def release(self, request: str, now: float) -> Reservation | None:
        """``request`` completed (or was rejected) at ``now``: it no longer counts."""
        row = self._rows.pop(request, None)
        if row is not None and row.dispatched:
            self._done.append((row.replica, row.at, now, row.prefill, request))
        return row

    def completed_rows(self) -> dict[str, list[Done]]:
        """Recently completed requests by replica: (reserved at, completed at, prefill, request id)."""
        out: dict[str, list[Done]] = {}
        for replica, at, done, prefill, request in self._done:
            out.setdefault(replica, []).append((at, done, prefill, request))
        return out

    def rows(self) -> dict[str, list[Row]]:
        """As :meth:`load`, with each request's id: (reserved at, prefill, id)."""
        out: dict[str, list[Row]] = {}
        for r in self._rows.values():
            out.setdefault(r.replica, []).append((r.at, r.prefill, r.request))
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


def _counted(stats: Mapping[str, Any]) -> dict[str, int] | None:
    """The snapshot's ``requests`` as {internal request id: prefill tokens left}; None without it."""
    items = stats.get("requests")
    if not isinstance(items, list | tuple):
        return None
    out: dict[str, int] = {}
    for item in items:
        if isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[1], int | float):
            out[str(item[0])] = max(0, int(item[1]))
    return out


def instance_view(
    index: int,
    stats: Mapping[str, Any],
    inflight: Sequence[Row],
    completed: Sequence[Done] = (),
    now: float | None = None,
) -> InstanceView:
    """The view of one replica: its ``stats`` (possibly empty) plus the ``inflight`` requests
    (reserved at, new prefill[, id]) the stats do not count (routed since the stats' ``time``, all of
    them without one; by id where the stats list their ``requests``), minus the ``completed`` ones
    (reserved at, completed at, prefill[, id]) the stats still count. With ``now`` (seconds, the
    clock of the reservations) and the stats' ``ttft_p50_s``, requests whose prefill has ended by the
    estimate count as running with no prefill (module docstring)."""
    since = stats.get("time")
    if isinstance(since, int | float) and not isinstance(since, bool) and "running" in stats:
        ttft = _seconds(stats, "ttft_p50_s")
        budget = _int(stats, "max_num_batched_tokens")
        counted = _counted(stats)

        def ends(t: float, p: int) -> float:  # estimated end of the prefill of (reserved at, p)
            assert ttft is not None
            return t + ttft * (max(1, -(-p // budget)) if budget else 1)

        late: list[tuple[float, int]] = []
        for row in inflight:
            key = row[2] if len(row) > 2 else None
            if row[0] > since if counted is None or key is None else key not in counted:
                late.append((row[0], row[1]))
        # completed since, but in the snapshot: (prefill tokens the snapshot still counts, or None
        # where they are not known) for those it counts as prefilling; a count for the rest
        gone_prefilling: list[int] = []
        gone_running = 0
        for crow in completed:
            t, done, p = crow[0], crow[1], crow[2]
            key = crow[3] if len(crow) > 3 else None
            if counted is not None and key is not None:
                if key in counted:  # the snapshot says how it counted it
                    if counted[key] > 0:
                        gone_prefilling.append(counted[key])
                    else:
                        gone_running += 1
            elif t <= since < done:
                if ttft is not None and ends(t, p) <= since:
                    gone_running += 1
                else:
                    gone_prefilling.append(p)
        if ttft is None:  # no estimate of where prefill ends: every one still prefilling
            late_prefilling, late_running = [p for _, p in late], 0
        else:
            late_prefilling = [p for t, p in late if now is None or ends(t, p) > now]
            late_running = len(late) - len(late_prefilling)
        running = _int(stats, "running") + late_running
        waiting = _int(stats, "waiting") + len(late_prefilling)
        off_waiting = min(len(gone_prefilling), _int(stats, "waiting"))
        waiting -= off_waiting
        running = max(0, running - gone_running - (len(gone_prefilling) - off_waiting))
        queued = max(0, _int(stats, "queued_prefill_tokens") - sum(gone_prefilling)) + sum(late_prefilling)
        usage = stats.get("kv_usage")
        kv_usage = min(1.0, max(0.0, float(usage))) if isinstance(usage, int | float) else 0.0
        capacity = _int(stats, "kv_capacity_blocks")
        return InstanceView(
            index=index,
            running=running,
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=kv_usage,
            kv_capacity_blocks=capacity,
            decode_blocks=round(kv_usage * capacity),
            max_batched_tokens=_int(stats, "max_num_batched_tokens"),
            max_num_seqs=_int(stats, "max_num_seqs"),
        )
    return InstanceView(
        index=index,
        waiting=len(inflight),
        queued_prefill_tokens=sum(r[1] for r in inflight),
        max_batched_tokens=_int(stats, "max_num_batched_tokens"),
        max_num_seqs=_int(stats, "max_num_seqs"),
    )
