"""The router's in-flight load per backend: one table, shared by every writer that routes to the fleet.

Columns (per backend *slot*): ``waiting`` (requests routed, first byte not back yet), ``running``
(first byte back, not ended), ``prefill`` (new prompt tokens of the waiting ones, tokens), ``blocks``
(the prompt KV blocks of both, from routing to the end, blocks) and ``pending`` (the blocks of the
waiting ones routed since the backend's last completed scrape began, blocks: the router's optimistic
share of ``decode_blocks``; :class:`~kvroute.server.state.backends.Lease` says when they leave). A
backend's slot is found by its URL (:meth:`LoadTable.slot`), so every writer agrees on it whatever
order it learnt of the backends in.

Rows: one per writer. A writer (one router process, or one worker of ``kvroute serve --workers N``)
only adds to its own row, so no lock is needed on the request path; readers sum the rows
(:meth:`LoadTable.totals`). Row ``writers`` (the last one) holds the load that other router replicas
announced (:mod:`kvroute.server.sync.peers`), written by the one process that receives it.

**Scraped engine metrics** (:meth:`LoadTable.put_scraped` / :meth:`LoadTable.scraped`): one record per
slot after the rows (running, waiting, KV usage, pool size, engine block size, the router's monotonic
time of the scrape), written by the machine's one scraper and read by every writer, so the workers of
a machine scrape each engine once, not once each (:mod:`kvroute.server.sync.scrape`). A record is
guarded by a sequence counter (odd while written), so a reader never mixes two scrapes. Two more cells
name the scraper (its writer row) and its heartbeat (:meth:`LoadTable.claim_scraper`).

Backing: a plain numpy array (one process), or a ``multiprocessing.shared_memory`` segment that the
workers of one machine map (:meth:`LoadTable.create_shared` in the parent, :meth:`LoadTable.attach` in
each worker). Aligned int64 reads and writes are atomic on the platforms we run on, so a reader sees
each cell either before or after a writer's update; sums over rows may mix moments, which the policy
tolerates (it is a load estimate). URL → slot assignment goes through a small shared registry guarded
by a ``multiprocessing.Lock`` (only when a backend is first seen).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

__all__ = ["COLUMNS", "LoadTable", "SharedTableSpec"]

COLUMNS = ("waiting", "running", "prefill", "blocks", "pending")
_N = len(COLUMNS)  # int64 cells per (row, slot)
_URL_BYTES = 512  # one registry entry: a NUL-padded UTF-8 URL
DEFAULT_SLOTS = 1024
_SCR = (
    8  # int64 cells per slot's scraped record: seq, at_ns, running, waiting, usage_ppb, blocks, block_size, -
)
_ELECT = 2  # cells after the scraped records: the scraper's writer row + 1 (0: none), its heartbeat (ns)


def _counts_bytes(writers: int, slots: int) -> int:
    """Bytes of the counts segment: ``writers`` rows and the remote row of ``_N`` cells per slot, the
    scraped records and the election cells (int64 each)."""
    return ((writers + 1) * slots * _N + slots * _SCR + _ELECT) * 8


@dataclass(frozen=True, slots=True)
class SharedTableSpec:
    """What a worker needs to attach to the machine's table (picklable): segment names and shape."""

    counts_name: str
    urls_name: str
    writers: int
    slots: int


class LoadTable:
    """See the module docstring. ``writer`` is this process's row (0 ≤ writer < writers).

    Cells live in a flat ``memoryview`` of int64 (``q``): ``[row][slot][column]``; indexing one is a
    C-level operation, cheaper than numpy scalars on the request path."""

    def __init__(
        self,
        counts: memoryview,
        urls: memoryview,
        writers: int,
        slots: int,
        writer: int,
        lock: Any = None,
        owned: tuple[shared_memory.SharedMemory, ...] = (),
    ) -> None:
        if not 0 <= writer < writers:
            raise ValueError(f"writer {writer} outside 0..{writers - 1}")
        self._q = counts.cast("B").cast("q")
        self._urls = urls
        self.writer = writer
        self.writers = writers
        self.slots = slots
        self._base = writer * slots * _N
        self._remote = writers * slots * _N
        self._scr = (writers + 1) * slots * _N  # first scraped record
        self._elect = self._scr + slots * _SCR
        self._lock = lock
        self._shm = owned
        self._slot_of: dict[str, int] = {}
        # This process's listener of its own row's changes (slot, waiting, running, prefill, blocks,
        # pending): the peer publisher (kvroute.server.sync.peers), called in the same step as the change.
        self.announce: Callable[[int, int, int, int, int, int], None] | None = None

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def local(cls, slots: int = DEFAULT_SLOTS) -> LoadTable:
        """A table for one process (one writer, plus the remote row)."""
        return cls(
            memoryview(bytearray(_counts_bytes(1, slots))),
            memoryview(bytearray(slots * _URL_BYTES)),
            1,
            slots,
            0,
        )

    @classmethod
    def create_shared(
        cls, writers: int, lock: Any, slots: int = DEFAULT_SLOTS, name_prefix: str | None = None
    ) -> tuple[LoadTable, SharedTableSpec]:
        """The parent's table over new shared-memory segments (it writes row 0, which its workers
        then must not: give them rows 1..writers-1, or create with one row more than workers); returns
        it and the spec the workers attach with. The creator must :meth:`close` with ``unlink=True``
        once the workers are gone. ``name_prefix``: the segments are ``PREFIX-counts`` and
        ``PREFIX-urls`` (a supervisor stamps them with its pid, :mod:`.runfiles`); else random names."""
        counts_name = f"{name_prefix}-counts" if name_prefix else None
        urls_name = f"{name_prefix}-urls" if name_prefix else None
        counts_shm = shared_memory.SharedMemory(counts_name, create=True, size=_counts_bytes(writers, slots))
        urls_shm = shared_memory.SharedMemory(urls_name, create=True, size=slots * _URL_BYTES)
        counts, urls = _buf(counts_shm), _buf(urls_shm)
        counts[:] = bytes(len(counts))
        urls[:] = bytes(len(urls))
        spec = SharedTableSpec(counts_shm.name, urls_shm.name, writers, slots)
        table = cls(counts, urls, writers, slots, 0, lock, (counts_shm, urls_shm))
        return table, spec

    @classmethod
    def attach(cls, spec: SharedTableSpec, writer: int, lock: Any) -> LoadTable:
        """A worker's view of the machine's table, writing row ``writer``."""
        counts_shm = shared_memory.SharedMemory(name=spec.counts_name)
        urls_shm = shared_memory.SharedMemory(name=spec.urls_name)
        counts, urls = _buf(counts_shm), _buf(urls_shm)
        return cls(counts, urls, spec.writers, spec.slots, writer, lock, (counts_shm, urls_shm))

    def close(self, unlink: bool = False) -> None:
        """Unmap the shared segments (``unlink``: also destroy them; the creator does, last)."""
        self._q.release()
        self._urls.release()
        for shm in self._shm:
            shm.close()
            if unlink:
                shm.unlink()
        self._shm = ()

    # ---- slots ----------------------------------------------------------------------------------

    def slot(self, url: str) -> int:
        """The slot of backend ``url`` (assigned on first use, the same in every process sharing the
        table). Raises ValueError when the table is full or the URL too long."""
        cached = self._slot_of.get(url)
        if cached is not None:
            return cached
        raw = url.encode()
        if not raw or len(raw) >= _URL_BYTES or b"\0" in raw:
            raise ValueError(f"backend URL must be 1..{_URL_BYTES - 1} bytes without NUL: {url!r}")
        entry = raw.ljust(_URL_BYTES, b"\0")
        if self._lock is not None:
            with self._lock:
                found = self._find_or_add(entry)
        else:
            found = self._find_or_add(entry)
        self._slot_of[url] = found
        return found

    def _find_or_add(self, entry: bytes) -> int:
        urls = self._urls
        free = -1
        for s in range(self.slots):
            cell = urls[s * _URL_BYTES : (s + 1) * _URL_BYTES]
            if cell[0] == 0:
                if free < 0:
                    free = s
                break  # slots fill in order and are never freed: the rest are free too
            if cell == entry:
                return s
        if free < 0:
            raise ValueError(f"the load table is full ({self.slots} backends)")
        urls[free * _URL_BYTES : (free + 1) * _URL_BYTES] = entry
        return free

    def url_of(self, slot: int) -> str:
        """The URL a slot was assigned to ("" when free)."""
        raw = bytes(self._urls[slot * _URL_BYTES : (slot + 1) * _URL_BYTES])
        return raw.split(b"\0", 1)[0].decode()

    # ---- counts ---------------------------------------------------------------------------------

    def add(
        self,
        slot: int,
        waiting: int = 0,
        running: int = 0,
        prefill: int = 0,
        blocks: int = 0,
        pending: int = 0,
    ) -> None:
        """Add the deltas to this writer's row (the request path: no lock, no allocation)."""
        q = self._q
        i = self._base + slot * _N
        if waiting:
            q[i] += waiting
        if running:
            q[i + 1] += running
        if prefill:
            q[i + 2] += prefill
        if blocks:
            q[i + 3] += blocks
        if pending:
            q[i + 4] += pending
        announce = self.announce
        if announce is not None:
            announce(slot, waiting, running, prefill, blocks, pending)

    def own(self, slot: int) -> tuple[int, int, int, int]:
        """This writer's (waiting, running, prefill, blocks) on ``slot``."""
        q = self._q
        i = self._base + slot * _N
        return q[i], q[i + 1], q[i + 2], q[i + 3]

    def own_pending(self, slot: int) -> int:
        """This writer's ``pending`` blocks on ``slot``."""
        return self._q[self._base + slot * _N + 4]

    def totals(self, slot: int, remote: bool = True) -> tuple[int, int, int, int]:
        """(waiting, running, prefill, blocks) on ``slot`` summed over this machine's writers and, with
        ``remote``, the other replicas' announced load."""
        q = self._q
        stride = self.slots * _N
        w = r = p = b = 0
        end = self._remote + (stride if remote else 0)
        for i in range(slot * _N, end, stride):
            w += q[i]
            r += q[i + 1]
            p += q[i + 2]
            b += q[i + 3]
        return w, r, p, b

    def pending(self, slot: int, remote: bool = True) -> int:
        """``pending`` blocks on ``slot`` summed as :meth:`totals` sums the other columns."""
        q = self._q
        stride = self.slots * _N
        end = self._remote + (stride if remote else 0)
        return sum(q[i] for i in range(slot * _N + 4, end, stride))

    def set_remote(
        self, slot: int, waiting: int, running: int, prefill: int, blocks: int, pending: int = 0
    ) -> None:
        """Overwrite the other replicas' load on ``slot`` (only the peer receiver calls this)."""
        q = self._q
        i = self._remote + slot * _N
        q[i], q[i + 1], q[i + 2], q[i + 3], q[i + 4] = waiting, running, prefill, blocks, pending

    def clear_own(self, slot: int) -> None:
        """Zero this writer's row on ``slot``."""
        i = self._base + slot * _N
        self._q[i : i + _N] = memoryview(bytes(8 * _N)).cast("q")

    def clear_row(self, writer: int) -> None:
        """Zero every slot of row ``writer`` (0 ≤ writer < writers): the supervisor does this for a
        worker that died, since its requests died with it. Not while that writer still writes."""
        if not 0 <= writer < self.writers:
            raise ValueError(f"writer {writer} outside 0..{self.writers - 1}")
        stride = self.slots * _N
        self._q[writer * stride : (writer + 1) * stride] = memoryview(bytes(stride * 8)).cast("q")

    # ---- scraped engine metrics (one scraper per machine) ------------------------------------------

    def put_scraped(
        self, slot: int, at: float, running: int, waiting: int, kv_usage: float, blocks: int, block_size: int
    ) -> None:
        """Record a scrape of ``slot``'s engine taken at ``at`` (monotonic seconds). Only the
        machine's scraper writes (one writer per record)."""
        self._put(slot, (int(at * 1e9), running, waiting, round(kv_usage * 1e9), blocks, block_size, 1))

    def clear_scraped(self, slot: int) -> None:
        """Forget ``slot``'s scrape (its backend left)."""
        self._put(slot, (0, 0, 0, 0, 0, 0, 0))

    def _put(self, slot: int, cells: tuple[int, ...]) -> None:
        q = self._q
        i = self._scr + slot * _SCR
        q[i] += 1  # odd: being written
        q[i + 1 : i + 8] = memoryview(array("q", cells)).cast("B").cast("q")
        q[i] += 1

    def scraped(self, slot: int) -> tuple[float, int, int, float, int, int] | None:
        """``(at, running, waiting, kv_usage, blocks, block_size)`` of ``slot``'s last scrape, or None
        when there is none (or it is being rewritten right now, three reads in a row)."""
        q = self._q
        i = self._scr + slot * _SCR
        for _ in range(3):
            seq = q[i]
            if seq & 1:
                continue
            at_ns, running, waiting, ppb, blocks, bs, present = q[i + 1 : i + 8]
            if q[i] == seq:
                return (at_ns / 1e9, running, waiting, ppb / 1e9, blocks, bs) if present else None
        return None

    def claim_scraper(self, now: float, takeover_s: float) -> bool:
        """Whether this writer is the machine's scraper at ``now`` (monotonic seconds): yes if it is
        named, or if none is or the named one's heartbeat is older than ``takeover_s`` (it died or
        hangs; this writer then takes over). A scraper's call renews its heartbeat. Two writers
        taking over at once both see themselves named once; the later write wins from the next call."""
        q = self._q
        i = self._elect
        me = self.writer + 1
        now_ns = int(now * 1e9)
        if q[i] != me and q[i] and now_ns - q[i + 1] <= takeover_s * 1e9:
            return False
        q[i] = me
        q[i + 1] = now_ns
        return True

    def release_scraper(self) -> None:
        """This writer stops scraping (it is stopping): another takes over at its next call."""
        if self._q[self._elect] == self.writer + 1:
            self._q[self._elect] = 0


def _buf(shm: shared_memory.SharedMemory) -> memoryview:
    buf = shm.buf
    if buf is None:  # pragma: no cover - only after close()
        raise ValueError(f"shared memory {shm.name} is closed")
    return buf


def url_digest(url: str) -> str:
    """A short stable id for a backend URL (e.g. the admin API's backend ids)."""
    return hashlib.blake2b(url.encode(), digest_size=6).hexdigest()
