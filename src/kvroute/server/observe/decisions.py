"""Decision records: what the router decided for a request, why, and what then happened.

A :class:`DecisionRecord` is made for every routed request (and every quota refusal) and kept in a
:class:`DecisionLog`, a bounded ring buffer (the newest ``capacity`` records; older ones fall out).
It holds the core's :class:`~kvroute.routing.core.Decision` as is, so recording costs one small
object; the JSON (:func:`record_json`) is built only when someone reads it (``GET /debug/decisions``,
the dashboard, the access log).

Times: ``arrival``, ``sent``, ``first_byte``, ``end`` are ``time.perf_counter()`` seconds (the proxy's
clock; only differences are reported, in milliseconds); ``wall`` is Unix seconds at arrival.

A record's JSON::

    {"request_id": "…", "time": 1760000000.123, "path": "/v1/chat/completions",
     "policy": "lmetric", "reason": "policy" | "hotspot" | "cold_start_cap" | "limits" | "quota" | "retry",
     "decision_reason": (the core's reason, the same as "reason" unless it is "retry"),
     "prompt_tokens": 1234, "routing_ms": 0.41,
     "winner": {"index": 2, "backend": "http://…"},        # the core's choice
     "backend": {"index": 2, "backend": "http://…"},       # the attempt that answered (null: none)
     "retries": 0, "expected_cached_tokens": 1024,         # predicted on "backend" (else the winner)
     "order": [2, 0, 1],
     "candidates": [{"index", "backend", "cached_tokens", "p_token", "queued_prefill_tokens", "bs",
                     "score"}, …],
     "shadow": [{"policy": "vllm", "index": 0, "agree": false, "score_diff": 812, "cached_diff": -1024}],
     "outcome": null | {"status": 200, "complete": true, "cached_tokens": 1024 | null,
                        "cached_error": 0 | null, "ttft_ms": 35.2, "e2e_ms": 410.0, "added_ttfb_ms": 0.5}}

``outcome`` is null while the request is in flight. ``status`` is the HTTP status sent to the client
(null when the client went away first); ``complete`` is false for a stream that broke off or was
cut; ``cached_tokens`` the engine's ``usage.prompt_tokens_details.cached_tokens`` (null when the
response did not report it); ``cached_error`` = real − expected; ``ttft_ms`` the first upstream byte
after arrival; ``added_ttfb_ms`` the router's share of it: from arrival to sending the attempt that
answered (reading, tokenizing, routing, failed attempts).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kvroute.routing.core import Decision
from kvroute.routing.shadow import ShadowPick
from kvroute.server.observe.persecond import PerSecond

if TYPE_CHECKING:
    from kvroute.server.state.router import RouterState

__all__ = ["DecisionLog", "DecisionRecord", "record_json", "router_state"]


class DecisionRecord:
    """One request's decision and outcome (module docstring). Mutated by the proxy as the request
    proceeds (``attempt``, ``first_byte``, ``done``); ``explain``: answer with the explanation headers."""

    __slots__ = (
        "arrival",
        "backend",
        "cached_real",
        "complete",
        "decision",
        "end",
        "explain",
        "first_byte",
        "path",
        "request_id",
        "retries",
        "routing_s",
        "sent",
        "shadow",
        "spans",
        "status",
        "wall",
    )

    def __init__(
        self,
        request_id: str,
        decision: Decision,
        path: str,
        arrival: float,
        routing_s: float,
        shadow: tuple[ShadowPick, ...] = (),
        explain: bool = False,
    ) -> None:
        self.request_id = request_id
        self.decision = decision
        self.path = path
        self.arrival = arrival
        self.wall = time.time()
        self.routing_s = routing_s
        self.shadow = shadow
        self.explain = explain
        self.backend: int | None = None  # the backend of the latest attempt
        self.retries = 0
        self.sent = 0.0
        self.first_byte = 0.0
        self.end = 0.0
        self.status: int | None = None
        self.complete = False
        self.cached_real: int | None = None
        self.spans: Any = None  # the tracing spans (kvroute.server.observe.tracing), when traced

    def attempt(self, backend: int, retry: bool, now: float) -> None:
        """An attempt is sent to ``backend`` at ``now``; ``retry``: not the plan's first attempt."""
        self.backend = backend
        self.retries += retry
        self.sent = now

    @property
    def reason(self) -> str:
        """Why the request went where it went: ``retry`` when an attempt other than the first
        answered, else the core's reason."""
        return "retry" if self.retries and self.backend is not None else self.decision.reason

    @property
    def expected_cached(self) -> int:
        """Predicted cached prompt tokens on the backend that answered (else the core's choice)."""
        d = self.decision
        target = self.backend if self.backend is not None else d.instance
        return 0 if target is None else d.cached_on(target)

    def score(self) -> float | None:
        """The policy's score of the backend used (policy units), None when it was not a candidate."""
        d = self.decision
        target = self.backend if self.backend is not None else d.instance
        if target is None or target not in d.instances:
            return None
        return d.scores[d.instances.index(target)]


class DecisionLog:
    """The newest ``capacity`` decision records (a ring buffer; appending drops the oldest);
    ``per_second``: every record appended, counted per second of its ``wall`` time (the dashboard's
    decisions per second, whatever the capacity)."""

    __slots__ = ("_records", "capacity", "per_second", "total")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a decision log keeps at least one record")
        self.capacity = capacity
        self._records: deque[DecisionRecord] = deque(maxlen=capacity)
        self.total = 0  # records ever appended
        self.per_second = PerSecond()

    def append(self, record: DecisionRecord) -> None:
        self._records.append(record)
        self.total += 1
        self.per_second.add(record.wall)

    def __len__(self) -> int:
        return len(self._records)

    def latest(self, limit: int | None = None) -> list[DecisionRecord]:
        """The newest ``limit`` records (all kept when None), newest first."""
        recs = self._records
        n = len(recs) if limit is None else max(0, min(limit, len(recs)))
        out = []
        it: Iterator[DecisionRecord] = reversed(recs)
        for _ in range(n):
            out.append(next(it))
        return out


def _ms(a: float, b: float) -> float | None:
    return round((b - a) * 1e3, 3) if a and b else None


def record_json(rec: DecisionRecord, url_of: Callable[[int], str]) -> dict[str, Any]:
    """``rec`` as JSON-able data (module docstring); ``url_of(index)``: a backend's URL."""
    d = rec.decision

    def named(i: int | None) -> dict[str, Any] | None:
        return None if i is None else {"index": i, "backend": url_of(i)}

    outcome = None
    if rec.end:
        expected = rec.expected_cached
        outcome = {
            "status": rec.status,
            "complete": rec.complete,
            "cached_tokens": rec.cached_real,
            "cached_error": None if rec.cached_real is None else rec.cached_real - expected,
            "ttft_ms": _ms(rec.arrival, rec.first_byte),
            "e2e_ms": _ms(rec.arrival, rec.end),
            "added_ttfb_ms": _ms(rec.arrival, rec.sent),
        }
    return {
        "request_id": rec.request_id,
        "time": rec.wall,
        "path": rec.path,
        "policy": d.policy,
        "reason": rec.reason,
        "decision_reason": d.reason,
        "prompt_tokens": d.prompt_tokens,
        "routing_ms": round(rec.routing_s * 1e3, 3),
        "winner": named(d.instance),
        "backend": named(rec.backend),
        "retries": rec.retries,
        "expected_cached_tokens": rec.expected_cached,
        "order": list(d.order),
        "candidates": [
            {
                "index": c.instance,
                "backend": url_of(c.instance),
                "cached_tokens": c.cached_tokens,
                "p_token": c.p_token,
                "queued_prefill_tokens": c.queued_prefill_tokens,
                "bs": c.bs,
                "score": c.score,
            }
            for c in d.candidates
        ],
        "shadow": [
            {
                "policy": p.name,
                "index": p.instance,
                "agree": p.agree,
                "score_diff": p.score_diff,
                "cached_diff": p.cached_diff,
            }
            for p in rec.shadow
        ],
        "outcome": outcome,
    }


def router_state(core: RouterState, log: DecisionLog, limit: int = 20) -> dict[str, Any]:
    """The router's state as JSON-able data (for ``GET /debug/state`` and a dashboard): the policy,
    the request counters, every live backend's load (this machine's counters: ``blocks`` of its
    requests in flight, ``pending_blocks`` of those a scrape does not cover yet) and KV view mode, its
    ``view`` (the merged load a policy reads now: :meth:`~kvroute.server.state.backends.BackendState.view`,
    every router's counters and the last scrape; ``decode_blocks`` as :mod:`kvroute.views` defines it),
    and the newest ``limit`` decisions (newest first). Reads only, but for what a view does first:
    settle this process's pending blocks against the last scrape (idempotent); ``core.clock`` for the
    KV view modes and the scrapes' age."""
    now = core.clock()
    stale = core.config.scrape_stale_s
    backends = []
    for b in core.live_backends():
        v = b.view(now, stale, core.config.block_size)  # first: it settles the pending blocks
        waiting, running, prefill, blocks = b.table.totals(b.slot, remote=False)
        backends.append(
            {
                "index": b.index,
                "url": b.url,
                "state": b.state,
                "healthy": b.healthy,
                "waiting": waiting,
                "running": running,
                "queued_prefill_tokens": prefill,
                "blocks": blocks,
                "pending_blocks": b.table.pending(b.slot, remote=False),
                "kv_mode": core.kv.mode(b.index, now),
                "requests_total": b.requests_total,
                "view": {
                    "running": v.running,
                    "waiting": v.waiting,
                    "queued_prefill_tokens": v.queued_prefill_tokens,
                    "kv_usage": v.kv_usage,
                    "kv_capacity_blocks": v.kv_capacity_blocks,
                    "decode_blocks": v.decode_blocks,
                },
            }
        )
    c = core.counters
    urls = core.backends
    return {
        "policy": core.routing.name,
        "counters": {name: getattr(c, name) for name in c.__slots__},
        "decisions_total": log.total,
        "backends": backends,
        "decisions": [record_json(r, lambda i: urls[i].url) for r in log.latest(limit)],
    }
