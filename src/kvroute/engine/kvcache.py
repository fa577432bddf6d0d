"""KV block pool with prefix caching (vLLM v1's KVCacheManager, reduced to what routing needs).

Accounting, in blocks of ``block_size`` tokens. Every block of the pool is in exactly one of:

- *free*: holds nothing (``free``);
- *private*: held by one request, not (yet) a cached full prompt block (``private``);
- *cached*: a full prompt block known by its chained hash (``cached``), either referenced by
  requests (refcount > 0) or *evictable* (refcount 0, kept in LRU order, reusable by a later
  request with the same prefix until its space is needed).

Invariant: ``free + private + len(cached) == num_blocks``.

Representation (speed: a chatbot turn releases and re-references its whole prefix): ``cached`` maps a
hash to its refcount when referenced (> 0), or to ``-stamp`` when evictable, ``stamp`` numbering the
releases. The LRU order is a queue of release groups: the hashes one release made evictable, in
eviction order, with that release's stamp. Re-referencing a block leaves it in its group, stale (its
stamp no longer matches), to be skipped when evicting or dropped when the queue is compacted. A
release whose blocks all drop to refcount 0 (the common case) is two C-level dict passes.
Only prompt blocks are hashed (output tokens stay in private blocks), as the simulator's
workloads describe prompts by block ids; a later turn's prompt that repeats an earlier answer
carries that answer as prompt blocks, which then are cached.

Evictions and new cached blocks are recorded as KV events (``BlockStored``/``BlockRemoved``/
``AllBlocksCleared``) in ``events`` for the owner to drain.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import repeat

from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

COMPACT_SLACK = 4096
"""The LRU queue is compacted when it holds more than twice the cached blocks plus this many hashes."""


class BlockPool:
    """A fixed-capacity pool of KV blocks with prefix caching and LRU eviction.

    Mutates only itself. Not thread-safe (one engine owns one pool).
    """

    __slots__ = (
        "_lru_g",
        "_lru_n",
        "_lru_pos",
        "_lru_s",
        "_stamp",
        "block_size",
        "cached",
        "events",
        "evictable",
        "free",
        "num_blocks",
        "private",
        "referenced",
    )

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free = num_blocks
        self.private = 0
        self.cached: dict[int, int] = {}  # hash -> refcount (> 0), or -stamp when evictable
        self.referenced = 0  # cached blocks with refcount > 0
        self.evictable = 0  # cached blocks with refcount 0
        self._lru_g: deque[tuple[int, ...]] = deque()  # release groups, oldest first (some hashes stale)
        self._lru_s: deque[int] = deque()  # their stamps
        self._lru_pos = 0  # hashes of the oldest group already evicted (or skipped)
        self._lru_n = 0  # hashes in the queue (for compaction)
        self._stamp = 0
        self.events: list[KVEvent] = []

    # -- queries -----------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Blocks referenced by requests (private + referenced cached)."""
        return self.private + self.referenced

    @property
    def available(self) -> int:
        """Blocks an allocation may take: free plus evictable cached ones."""
        return self.free + self.evictable

    def count_hits(self, hashes: Sequence[int], limit: int) -> tuple[int, int]:
        """Length of the cached prefix of ``hashes`` (at most ``limit`` blocks), and how many of
        those blocks are evictable now (they stop being available once referenced). No mutation."""
        cached = self.cached
        n = evictable = 0
        for h in hashes:
            if n >= limit:
                break
            ref = cached.get(h)
            if ref is None:
                break
            if ref <= 0:
                evictable += 1
            n += 1
        return n, evictable

    # -- mutations ---------------------------------------------------------------------------
    def acquire(self, hashes: Sequence[int]) -> None:
        """Reference cached blocks (a prefix hit). Each hash must be cached."""
        cached = self.cached
        revived = 0
        for h in hashes:
            ref = cached[h]
            if ref > 0:
                cached[h] = ref + 1
            else:
                cached[h] = 1
                revived += 1
        self.referenced += revived
        self.evictable -= revived

    def allocate(self, n: int) -> bool:
        """Take ``n`` private blocks, evicting LRU cached blocks if needed. False (and no change)
        if fewer than ``n`` are available."""
        if n <= 0:
            return True
        if n > self.free + self.evictable:
            return False
        short = n - self.free
        if short > 0:
            removed: list[int] = []
            cached, groups, stamps = self.cached, self._lru_g, self._lru_s
            pos = self._lru_pos
            while True:
                group, mark = groups[0], -stamps[0]
                end = len(group)
                while pos < end:
                    h = group[pos]
                    pos += 1
                    if cached.get(h) == mark:  # else stale: referenced again since (or evicted)
                        del cached[h]
                        removed.append(h)
                        if len(removed) == short:
                            break
                if pos == end:
                    groups.popleft()
                    stamps.popleft()
                    self._lru_n -= end
                    pos = 0
                if len(removed) == short:
                    break
            self._lru_pos = pos
            self.evictable -= short
            self.free += short
            self.events.append(BlockRemoved(tuple(removed)))
        self.free -= n
        self.private += n
        return True

    def release(self, hashes: Sequence[int], private: int) -> None:
        """Drop a request's references: its cached blocks (released leaf first, so that the tail
        of a prefix is evicted before its head) and its ``private`` blocks."""
        self.private -= private
        self.free += private
        if not hashes:
            return
        cached = self.cached
        self._stamp += 1
        mark = -self._stamp
        refs = list(map(cached.__getitem__, hashes))
        if refs.count(1) == len(refs):  # all drop to 0 (so no hash repeats): one group, in C
            cached.update(zip(hashes, repeat(mark)))
            group = tuple(reversed(hashes))
        else:
            zeros: list[int] = []
            for h in reversed(hashes):
                ref = cached[h] - 1
                if ref:
                    cached[h] = ref
                else:
                    cached[h] = mark
                    zeros.append(h)
            if not zeros:
                return
            group = tuple(zeros)
        self._lru_g.append(group)
        self._lru_s.append(self._stamp)
        n = len(group)
        self.referenced -= n
        self.evictable += n
        self._lru_n += n
        if self._lru_n > 2 * len(cached) + COMPACT_SLACK:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale hashes (and emptied groups) of the LRU queue, keeping the order."""
        cached = self.cached
        groups: deque[tuple[int, ...]] = deque()
        stamps: deque[int] = deque()
        pos = self._lru_pos
        for group, stamp in zip(self._lru_g, self._lru_s, strict=True):
            mark = -stamp
            live = tuple(h for h in group[pos:] if cached.get(h) == mark)
            pos = 0
            if live:
                groups.append(live)
                stamps.append(stamp)
        self._lru_g, self._lru_s, self._lru_pos = groups, stamps, 0
        self._lru_n = sum(map(len, groups))

    def promote(
        self,
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int] | None,
        first_block: int,
        held: list[int],
    ) -> None:
        """A request just filled the full prompt blocks ``hashes`` (block numbers ``first_block``…,
        ``parent`` the hash before them) with private blocks: cache them. A hash already cached
        (another request computed the same block meanwhile) is referenced instead and the private
        duplicate freed. Appends every hash to ``held``; records one ``BlockStored`` per
        contiguous run of newly cached blocks."""
        cached = self.cached
        self.private -= len(hashes)
        if cached.keys().isdisjoint(hashes):  # all new (the common case): one run, in C
            before = len(cached)
            cached.update(zip(hashes, repeat(1)))
            if len(cached) - before == len(hashes):  # no hash repeated within ``hashes``
                self.referenced += len(hashes)
                held.extend(hashes)
                self._stored(list(hashes), hashes, first_block, parent, token_ids, first_block)
                return
            for h in hashes:  # a repeat: undo, and take the general path below
                cached.pop(h, None)
        run: list[int] = []
        run_start = first_block
        for i, h in enumerate(hashes):
            ref = cached.get(h)
            if ref is None:
                cached[h] = 1
                self.referenced += 1
                if not run:
                    run_start = first_block + i
                run.append(h)
            else:
                if run:
                    self._stored(run, hashes, first_block, parent, token_ids, run_start)
                    run = []
                if ref > 0:
                    cached[h] = ref + 1
                else:
                    cached[h] = 1
                    self.evictable -= 1
                    self.referenced += 1
                self.free += 1
            held.append(h)
        if run:
            self._stored(run, hashes, first_block, parent, token_ids, run_start)

    def _stored(
        self,
        run: list[int],
        hashes: Sequence[int],
        first_block: int,
        parent: int | None,
        token_ids: Sequence[int] | None,
        start: int,
    ) -> None:
        """Record one ``BlockStored`` for ``run`` (block numbers ``start``…), whose parent is the
        block before it: ``parent`` if the run begins at ``first_block``, else within ``hashes``."""
        if start != first_block:
            parent = hashes[start - first_block - 1]
        bs = self.block_size
        tokens: tuple[int, ...] = ()
        if token_ids is not None and len(token_ids) >= (start + len(run)) * bs:
            tokens = tuple(token_ids[start * bs : (start + len(run)) * bs])
        self.events.append(BlockStored(tuple(run), parent, tokens, bs))

    def clear(self) -> bool:
        """Drop every evictable cached block (vLLM's prefix-cache reset). Refused (False) while any
        cached block is referenced, as in vLLM."""
        if self.referenced:
            return False
        self.free += len(self.cached)
        self.cached.clear()
        self.evictable = 0
        self._lru_g.clear()
        self._lru_s.clear()
        self._lru_pos = self._lru_n = 0
        self.events.append(AllBlocksCleared())
        return True

    def check(self) -> None:
        """Assert the pool's invariants (for tests)."""
        assert self.free >= 0 and self.private >= 0
        assert self.free + self.private + len(self.cached) == self.num_blocks
        assert all(r != 0 for r in self.cached.values())
        assert self.referenced == sum(1 for r in self.cached.values() if r > 0)
        assert self.evictable == len(self.cached) - self.referenced
        live = [
            h
            for k, (group, stamp) in enumerate(zip(self._lru_g, self._lru_s, strict=True))
            for h in group[self._lru_pos if k == 0 else 0 :]
            if self.cached.get(h) == -stamp
        ]
        assert sorted(live) == sorted(h for h, r in self.cached.items() if r < 0)
        assert self._lru_n == sum(map(len, self._lru_g))
