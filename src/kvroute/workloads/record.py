"""Recording live traffic as a replayable trace (``kvroute serve --record FILE``).

A recorded trace is a jsonl file in the ``kvroute`` trace format (read by :mod:`kvroute.workloads.traces`):

- line 1, the header: ``{"format": "kvroute-trace", "version": 1, "block_size": 16, "keyed": true,
  "started_unix": 1764650000.0}``;
- then one line per request, in non-decreasing arrival order::

      {"timestamp": 0.125, "input_length": 812, "output_length": 32, "hash_ids": [...], "model": "m",
       "session": 4410237740161128611, "user": "4f1c…", "class": "default", "status": 200}

  ``timestamp``: seconds since the recorder started (the router's clock); ``input_length``/``output_length``
  in tokens (``output_length`` is the completion tokens the backend reported, else the tokens streamed, at
  least 1); ``hash_ids``: the router's block hash chain of the prompt's full blocks (``block_size`` tokens
  each), **re-keyed** with a secret salt drawn for this file; ``session``/``user``: the request's session id
  (header ``x-session-id``) and user (``user`` field of the body, else a hash of the API key) keyed the same
  way, or absent; ``status``: the HTTP status the client got (replays keep every request: an error still
  arrived and still loaded the router).

Privacy: the salt is drawn from :func:`os.urandom` when the recorder opens, never written, and dropped when it
closes; each value is keyed with BLAKE2b (a PRF), so equal prefixes still share leading ids (reuse shows) but
nobody can test a guessed prompt against the file, even with the router's own hash function. The chain is
keyed block by block, so sharing is kept exactly: two prompts share their first k ids iff the router saw them
share their first k blocks.

Order: a request is written when it ends, but the file is sorted by arrival: finished records wait in a heap
until every request that arrived earlier has ended (a watermark over the requests in flight), so memory is
bounded by the requests in flight plus those that ended behind a slow one.
"""

from __future__ import annotations

import hashlib
import heapq
import io
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO

import orjson

TRACE_FORMAT = "kvroute-trace"
TRACE_VERSION = 1
_MEMO_ENTRIES = 1 << 16
"""Keyed values remembered (raw → keyed); multi-turn prompts repeat most of their blocks."""

__all__ = ["TRACE_FORMAT", "TRACE_VERSION", "Keyer", "RecordedRequest", "TraceRecorder"]


class Keyer:
    """Re-keys 64-bit ids and strings with a secret salt (BLAKE2b, 63-bit outputs so they stay positive
    JSON integers). Equal inputs give equal outputs under one salt; the salt is never exposed."""

    def __init__(self, salt: bytes) -> None:
        if len(salt) < 16:
            raise ValueError("salt must be at least 16 bytes")
        self._salt = salt
        self._memo: OrderedDict[int, int] = OrderedDict()

    def block(self, value: int) -> int:
        """The keyed form of one block hash (memoised, LRU, ``_MEMO_ENTRIES`` entries)."""
        memo = self._memo
        out = memo.get(value)
        if out is not None:
            memo.move_to_end(value)
            return out
        digest = hashlib.blake2b(
            (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little"), key=self._salt, digest_size=8
        ).digest()
        out = int.from_bytes(digest, "little") >> 1
        memo[value] = out
        if len(memo) > _MEMO_ENTRIES:
            memo.popitem(last=False)
        return out

    def blocks(self, values: Sequence[int]) -> list[int]:
        return [self.block(v) for v in values]

    def text(self, value: str) -> int:
        """The keyed form of a string id (a session or a user), a 63-bit integer."""
        digest = hashlib.blake2b(
            b"s:" + value.encode("utf-8", "surrogatepass"), key=self._salt, digest_size=8
        ).digest()
        return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """What the live router knows of one request when it ends (plain values, before keying).

    ``arrival``: seconds on the recorder's clock; ``prompt_len``/``output_len``: tokens; ``block_hashes``:
    the router's chain of the prompt's full blocks; ``session``/``user``: raw ids or None; ``status``: the
    HTTP status the client got."""

    arrival: float
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...]
    model: str
    session: str | None = None
    user: str | None = None
    req_class: str = "default"
    status: int = 200


class TraceRecorder:
    """Writes :class:`RecordedRequest` s as a ``kvroute`` trace, sorted by arrival.

    Protocol: :meth:`begin` when a request arrives (returns a ticket), :meth:`finish` with the ticket when it
    ends (every begun request must finish, errors included), :meth:`close` at shutdown (flushes the rest).
    ``clock``: seconds, monotonic (injected; the live router passes its loop's clock). Not thread-safe: one
    event loop owns it. Writes go to ``stream`` (the caller opens and closes the file)."""

    def __init__(
        self,
        stream: IO[bytes],
        block_size: int,
        clock: Callable[[], float],
        started_unix: float,
        salt: bytes | None = None,
    ) -> None:
        self._out = stream
        self._keyer = Keyer(salt if salt is not None else os.urandom(32))
        self._clock = clock
        self._t0 = clock()
        self._tickets = itertools.count()
        self._open: dict[int, float] = {}  # ticket → arrival, requests in flight
        self._open_heap: list[tuple[float, int]] = []  # (arrival, ticket), lazily pruned
        self._done: list[tuple[float, int, bytes]] = []  # (arrival, ticket, line) waiting for the watermark
        self.written = 0
        header = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "block_size": block_size,
            "keyed": True,
            "started_unix": round(started_unix, 3),
        }
        self._out.write(orjson.dumps(header) + b"\n")

    def now(self) -> float:
        """Seconds since the recorder started."""
        return self._clock() - self._t0

    def since_start(self, at: float) -> float:
        """``at`` (a reading of the clock, seconds) as seconds since the recorder started."""
        return at - self._t0

    def begin(self, at: float | None = None) -> tuple[int, float]:
        """A request arrived at ``at`` (a reading of the clock; None: now): its ticket and arrival (seconds
        since the recorder started), to pass back with :meth:`finish`."""
        ticket = next(self._tickets)
        arrival = self.now() if at is None else self.since_start(at)
        self._open[ticket] = arrival
        heapq.heappush(self._open_heap, (arrival, ticket))
        return ticket, arrival

    def finish(self, ticket: int, rec: RecordedRequest) -> None:
        """The request of ``ticket`` ended with ``rec``; writes every record no earlier arrival waits for."""
        if self._open.pop(ticket, None) is None:
            return  # finished twice: the first one counts
        heapq.heappush(self._done, (rec.arrival, ticket, self._line(rec)))
        self._flush()

    def close(self) -> None:
        """Writes every finished record (requests still open are not in the file) and flushes the stream."""
        self._open.clear()
        self._open_heap.clear()
        self._flush()
        self._out.flush()

    def _flush(self) -> None:
        heap = self._open_heap
        while heap and heap[0][1] not in self._open:
            heapq.heappop(heap)
        watermark = heap[0][0] if heap else float("inf")
        done = self._done
        wrote = False
        while done and done[0][0] <= watermark:
            self._out.write(heapq.heappop(done)[2])
            self.written += 1
            wrote = True
        if wrote and isinstance(self._out, io.BufferedWriter):
            self._out.flush()

    def _line(self, rec: RecordedRequest) -> bytes:
        keyer = self._keyer
        obj: dict[str, object] = {
            "timestamp": round(rec.arrival, 6),
            "input_length": rec.prompt_len,
            "output_length": max(1, rec.output_len),
            "hash_ids": keyer.blocks(rec.block_hashes),
            "model": rec.model,
            "class": rec.req_class,
            "status": rec.status,
        }
        if rec.session is not None:
            obj["session"] = keyer.text(rec.session)
        if rec.user is not None:
            obj["user"] = format(keyer.text(rec.user), "016x")
        return orjson.dumps(obj) + b"\n"
