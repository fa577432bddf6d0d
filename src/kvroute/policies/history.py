"""A router's own prefix table fed by its routing history, as the peers' routers keep one.

AIBrix's gateway (vllm-project/aibrix ``pkg/utils/prefixcacheindexer/hash.go``) and vllm-project/router
(``src/tree.rs``, used by ``src/policies/smetric.rs``) do not read the engines' KV events: each keeps a
table of what it routed where and assumes the instance still holds it. This is that table, on
kvroute's block chains:

- one entry per block hash: the instances it was routed to, each with the time it was last routed
  or matched there; entries form one LRU over all instances together (AIBrix's ``lrustore``) with at
  most ``capacity_blocks`` entries (AIBrix: 200,000) and an idle TTL (AIBrix: 20 minutes; ``None``:
  none). An entry forgets no instance while it lives: the table never learns that an engine evicted
  a block (the peers' tables do not either).
- :meth:`match`: per instance, how many leading blocks of the chain it holds (a walk from the root
  that stops at the first block no candidate holds, as AIBrix's ``seqSearchPrefix`` does).
- :meth:`add`: the chain was routed to ``instance`` at ``now``.

Times are seconds on the driver's clock (never read here) and must not decrease. Memory: O(entries
× instances per entry).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["AIBRIX_TABLE_BLOCKS", "AIBRIX_TABLE_TTL_S", "HistoryTable"]

AIBRIX_TABLE_BLOCKS = 200_000
"""AIBrix's ``defaultPrefixCacheBlockNumber``: entries in its prefix hash table."""

AIBRIX_TABLE_TTL_S = 20 * 60.0
"""AIBrix's ``defaultPrefixCacheEvictionDurationInMins`` (20) in seconds: an entry idle this long goes."""


class HistoryTable:
    """See the module docstring. Mutated by :meth:`match` (recency, expiry) and :meth:`add`."""

    __slots__ = ("_entries", "capacity_blocks", "ttl_s")

    def __init__(self, capacity_blocks: int, ttl_s: float | None) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be > 0, got {capacity_blocks}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        # block hash -> [last access time, {instance: time last routed there}], least recent first
        self._entries: OrderedDict[int, list] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        ttl = self.ttl_s
        if ttl is None:
            return
        entries = self._entries
        while entries:
            first = next(iter(entries.values()))
            if now - first[0] <= ttl:
                break
            entries.popitem(last=False)

    def match(self, chain: Sequence[int], instances: Sequence[int], now: float) -> list[int]:
        """Leading blocks of ``chain`` each of ``instances`` holds (one entry per instance, in order)."""
        self._expire(now)
        entries = self._entries
        out = [0] * len(instances)
        alive = set(range(len(instances)))
        for depth, h in enumerate(chain, start=1):
            entry = entries.get(h)
            if entry is None:
                break
            pods = entry[1]
            alive = {p for p in alive if instances[p] in pods}
            if not alive:
                break
            entry[0] = now
            entries.move_to_end(h)
            for p in alive:
                out[p] = depth
        return out

    def add(self, chain: Sequence[int], instance: int, now: float) -> None:
        """``chain`` was routed to ``instance`` at ``now``: every block of it now lists ``instance``."""
        self._expire(now)
        entries = self._entries
        for h in chain:
            entry = entries.get(h)
            if entry is None:
                entries[h] = [now, {instance: now}]
            else:
                entry[0] = now
                entry[1][instance] = now
                entries.move_to_end(h)
        while len(entries) > self.capacity_blocks:
            entries.popitem(last=False)
