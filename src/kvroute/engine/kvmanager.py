"""KVCacheManager: per-request KV block accounting between the engine's step logic and its pool.

As vLLM v1's ``KVCacheManager`` sits between its scheduler and ``BlockPool``, this one answers the
scheduler's questions in requests and tokens and turns them into block operations:

- ``lookup``: the prefix-cache hit of a waiting request (full blocks only; at least one token is
  always left to compute, as in vLLM);
- ``admit``: reference the hit blocks and allocate the blocks the first chunk needs, if they fit;
- ``allocate_slots``: grow a running request's blocks to cover more tokens (False: a preemption);
- ``cache_blocks``: a request filled more full prompt blocks: cache them (``BlockStored``);
- ``free``: a request finished, was aborted or preempted: release its blocks;
- prefix-cache statistics (tokens looked up / found at admission) and the pool's KV events.

Per request it keeps a :class:`RequestBlocks` record (the engine's per-request state extends it):
``held``, the cached blocks referenced (a prefix of the request's block hashes), and ``nblocks``, all
blocks held (``len(held)`` plus private ones). The engine's decode cohort allocates blocks for its
members in bulk (``allocate``) and credits them to the members' records lazily; see
``kvroute.engine.model``. Counts are in blocks of ``block_size`` tokens unless a name says tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.engine.kvcache import BlockPool
from kvroute.engine.types import EngineRequest, KVEvent


class RequestBlocks:
    """The manager's per-request record: ``req``, the cached block hashes it references (``held``)
    and the blocks it holds in all (``nblocks``). Written only by the manager (and by the engine's
    cohort when it credits bulk-allocated blocks)."""

    __slots__ = ("held", "nblocks", "req")

    def __init__(self, req: EngineRequest) -> None:
        self.req = req
        self.held: list[int] = []
        self.nblocks = 0


class KVCacheManager:
    """Allocates, caches and frees one engine's KV blocks per request. Mutates itself and the
    records it is given; not thread-safe (one engine owns one manager)."""

    __slots__ = ("block_size", "hit_tokens", "pool", "prefix_caching", "query_tokens")

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.prefix_caching = enable_prefix_caching
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache at first admission
        self.hit_tokens = 0  # of those, tokens found cached

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def free_blocks(self) -> int:
        """Blocks holding nothing (an allocation up to this many evicts nothing)."""
        return self.pool.free

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation may take: free plus evictable cached ones."""
        return self.pool.free + self.pool.evictable

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by requests (private plus referenced cached)."""
        return self.pool.private + self.pool.referenced

    @property
    def cached_blocks(self) -> int:
        """Blocks holding a cached full prompt block (referenced or evictable)."""
        return len(self.pool.cached)

    def lookup(self, rec: RequestBlocks, known: int) -> tuple[int, int]:
        """Prefix-cache hit of a waiting request with ``known`` tokens (prompt plus output so far):
        (cached leading blocks, how many of them are evictable now). No mutation."""
        hashes = rec.req.block_hashes
        if not (self.prefix_caching and hashes):
            return 0, 0
        return self.pool.count_hits(hashes, (known - 1) // self.block_size)

    def fits(self, hit: int, hit_evictable: int, tokens: int) -> bool:
        """Whether a request hitting ``hit`` cached blocks (``hit_evictable`` of them evictable)
        can get blocks for its first ``tokens`` tokens."""
        need = -(-tokens // self.block_size) - hit
        return need <= self.pool.free + self.pool.evictable - hit_evictable

    # -- per-request mutations ---------------------------------------------------------------
    def admit(self, rec: RequestBlocks, hit: int, hit_evictable: int, tokens: int, first: bool) -> bool:
        """Reference ``rec``'s first ``hit`` cached blocks (from ``lookup``) and allocate blocks up
        to ``tokens`` tokens; False (and no change) if they do not fit. ``first``: its first
        admission (counted in the prefix-cache statistics; a preempted request's is not)."""
        pool = self.pool
        need = -(-tokens // self.block_size) - hit
        if need > pool.free + pool.evictable - hit_evictable:
            return False
        held = list(rec.req.block_hashes[:hit])
        pool.acquire(held)
        pool.allocate(need)
        rec.held = held
        rec.nblocks = hit + need
        if first:
            self.query_tokens += rec.req.prompt_len
            self.hit_tokens += hit * self.block_size
        return True

    def allocate_slots(self, rec: RequestBlocks, tokens: int) -> bool:
        """Grow ``rec``'s blocks to cover ``tokens`` tokens (evicting if needed); False (and no
        change) if too few blocks are available."""
        need = (tokens + self.block_size - 1) // self.block_size - rec.nblocks
        if need <= 0:
            return True
        if not self.pool.allocate(need):
            return False
        rec.nblocks += need
        return True

    def credit(self, rec: RequestBlocks, n: int) -> None:
        """``n`` blocks taken with ``allocate``/``allocate_each`` now belong to ``rec``."""
        rec.nblocks += n

    def cache_blocks(self, rec: RequestBlocks, computed: int) -> None:
        """``rec`` has ``computed`` tokens in KV: cache the full prompt blocks filled since the last
        call (``BlockStored``; a block another request cached meanwhile is shared instead). Nothing
        with prefix caching off: blocks stay private, as in vLLM (no reuse, no events)."""
        if not self.prefix_caching:
            return
        hashes = rec.req.block_hashes
        held = rec.held
        first = len(held)
        full = min(computed // self.block_size, len(hashes))
        if full > first:
            parent = held[-1] if held else None
            self.pool.promote(hashes[first:full], parent, rec.req.token_ids, first, held)

    def free(self, rec: RequestBlocks) -> None:
        """Release every block ``rec`` holds (cached ones become evictable, leaf first)."""
        self.pool.release(rec.held, rec.nblocks - len(rec.held))
        rec.held = []
        rec.nblocks = 0

    # -- bulk allocation (the engine's decode cohort) ----------------------------------------
    def allocate(self, n: int) -> bool:
        """Take ``n`` blocks for requests whose records the caller credits later (evicting if
        needed); False (and no change) if fewer are available."""
        return self.pool.allocate(n)

    def allocate_each(self, counts: Iterable[int]) -> None:
        """Take blocks for several requests one request at a time, in the given order, so that each
        allocation that evicts records its own ``BlockRemoved`` (as vLLM). The caller checked that
        their sum is available."""
        allocate = self.pool.allocate
        for k in counts:
            allocate(k)

    # -- events, checks ----------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """KV events recorded since the last call, oldest first."""
        ev, self.pool.events = self.pool.events, []
        return ev

    def check(self) -> None:
        """Assert the pool's invariants (for tests)."""
        self.pool.check()
        assert 0 <= self.hit_tokens <= self.query_tokens
