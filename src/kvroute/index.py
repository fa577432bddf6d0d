"""Prefix index: chained block hash → the set of instances caching that block, as a bitmask int.

Bit ``i`` of a mask is instance ``i`` (instance ids are small non-negative ints; Python ints grow,
so instances may be added at run time). One walk over a request's block chain yields its cached
prefix length, in blocks, on every instance at once (:func:`match_chain`).

Two ways to feed it:

- :class:`PrefixIndex` — exact, from engine KV events (BlockStored / BlockRemoved /
  AllBlocksCleared): ``store``, ``remove``, ``clear``.
- :class:`ApproxPrefixIndex` — approximate, from routing history: ``assign(instance, chain, now)``
  assumes the routed instance now caches the request's blocks; a per-instance capacity (LRU) and an
  optional TTL keep the belief, and the memory, bounded.

Block ids are any ints: hashes from :func:`kvroute.blocks.hash_blocks`, or the chained ``hash_ids``
that traces carry (Mooncake, Qwen-Bailian), used as they are. Neither class reads a clock or holds
global state; neither is thread-safe (one owner mutates it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import groupby

__all__ = ["ApproxPrefixIndex", "PrefixIndex", "match_chain"]


def _check_instance(instance: int) -> int:
    if instance < 0:
        raise ValueError(f"instance ids are non-negative ints, got {instance}")
    return 1 << instance


def match_chain(masks: dict[int, int], chain: Sequence[int], num_instances: int) -> list[int]:
    """Cached-prefix length, in blocks, of ``chain`` on each instance ``0..num_instances-1``.

    ``masks`` maps a block id to the bitmask of instances holding it (no zero masks). Prefix
    semantics: block ``j`` counts for instance ``i`` only if ``i`` holds blocks ``0..j``. One walk:
    the block masks are looked up lazily (``map``) and grouped into runs of equal masks
    (``groupby``, both C-level), the "alive" mask is ANDed once per run and the instances whose bits
    drop get the current position as their length; the walk stops at the first block that no alive
    instance holds. Cost: one dict lookup per walked block plus Python work per run of equal masks
    and per instance that was ever alive. Pure.
    """
    lengths = [0] * num_instances
    if num_instances <= 0:
        return lengths
    alive = (1 << num_instances) - 1
    pos = 0  # blocks walked so far; every alive instance holds chain[:pos]
    for mask, run in groupby(map(masks.get, chain)):
        if mask is None:  # nobody holds this block
            break
        new = alive & mask
        if new != alive:
            if pos:
                _record(lengths, alive ^ new, pos)
            alive = new
            if not alive:
                return lengths
        pos += len(list(run))
    _record(lengths, alive, pos)
    return lengths


def _record(lengths: list[int], dropped: int, length: int) -> None:
    """Set ``lengths[i] = length`` for every bit ``i`` of ``dropped``."""
    while dropped:
        low = dropped & -dropped
        lengths[low.bit_length() - 1] = length
        dropped ^= low


class PrefixIndex:
    """Exact prefix index fed by engine KV events.

    State: ``block → mask`` (never a zero mask) and, per instance, the set of blocks it holds.
    Invariant: bit ``i`` is set in ``mask(b)`` iff ``b`` is in instance ``i``'s set.
    Memory: one dict entry per distinct block plus one set entry per (instance, block) pair.
    """

    __slots__ = ("_blocks", "_masks")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._blocks: dict[int, set[int]] = {}

    def store(self, instance: int, blocks: Iterable[int]) -> None:
        """Instance ``instance`` now caches ``blocks`` (BlockStored). Idempotent per block."""
        bit = _check_instance(instance)
        held = self._blocks.setdefault(instance, set())
        masks = self._masks
        for b in blocks:
            if b not in held:
                held.add(b)
                masks[b] = masks.get(b, 0) | bit

    def remove(self, instance: int, blocks: Iterable[int]) -> None:
        """Instance ``instance`` evicted ``blocks`` (BlockRemoved). Unknown blocks are ignored."""
        bit = _check_instance(instance)
        held = self._blocks.get(instance)
        if not held:
            return
        masks = self._masks
        for b in blocks:
            if b in held:
                held.discard(b)
                self._unset(masks, b, bit)

    def clear(self, instance: int) -> None:
        """Instance ``instance`` dropped its whole cache (AllBlocksCleared, or the instance left)."""
        bit = _check_instance(instance)
        held = self._blocks.pop(instance, None)
        if not held:
            return
        masks = self._masks
        for b in held:
            self._unset(masks, b, bit)

    @staticmethod
    def _unset(masks: dict[int, int], block: int, bit: int) -> None:
        m = masks[block] & ~bit
        if m:
            masks[block] = m
        else:
            del masks[block]

    def holders(self, block: int) -> int:
        """Bitmask of the instances holding ``block`` (0 if none)."""
        return self._masks.get(block, 0)

    def num_blocks(self, instance: int) -> int:
        """Blocks held by ``instance``."""
        held = self._blocks.get(instance)
        return len(held) if held else 0

    def __len__(self) -> int:
        """Distinct blocks held by at least one instance."""
        return len(self._masks)

    def match(self, chain: Sequence[int], num_instances: int) -> list[int]:
        """Cached-prefix length in blocks of ``chain`` on instances ``0..num_instances-1`` (see
        :func:`match_chain`). Does not mutate."""
        return match_chain(self._masks, chain, num_instances)


class ApproxPrefixIndex:
    """Prefix index fed by routing history: what each instance probably caches.

    - ``capacity_blocks``: default per-instance capacity in blocks (``set_capacity`` overrides it for
      one instance, e.g. a bigger GPU); each instance keeps at most that many blocks, evicting its
      least recently used ones.
    - ``ttl_s``: optional time-to-live in seconds since a block was last assigned to the instance;
      ``expire(now)`` drops older blocks. ``None``: no TTL.

    Time ``now`` (seconds, any origin) is passed in and must not decrease across calls. ``assign``
    touches the chain *leaf first, root last*, so within one chain the root is the most recent and
    the leaf-most blocks are evicted first: what survives eviction stays a prefix (as in vLLM,
    which frees a request's blocks tail first). Memory: O(Σ capacities).
    """

    __slots__ = ("_capacity", "_last_now", "_lru", "_masks", "capacity_blocks", "ttl_s")

    def __init__(self, capacity_blocks: int, ttl_s: float | None = None) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0 or None, got {ttl_s}")
        self.capacity_blocks = capacity_blocks
        self.ttl_s = ttl_s
        self._capacity: dict[int, int] = {}
        self._masks: dict[int, int] = {}
        # Per instance: block → time last assigned, least recently used first.
        self._lru: dict[int, OrderedDict[int, float]] = {}
        self._last_now = float("-inf")

    def _tick(self, now: float) -> None:
        if now < self._last_now:
            raise ValueError(f"time went backwards: {now} < {self._last_now}")
        self._last_now = now

    def capacity(self, instance: int) -> int:
        """Capacity of ``instance`` in blocks."""
        return self._capacity.get(instance, self.capacity_blocks)

    def set_capacity(self, instance: int, blocks: int) -> None:
        """Set ``instance``'s capacity in blocks; evicts its LRU blocks beyond it right away."""
        _check_instance(instance)
        if blocks < 0:
            raise ValueError(f"capacity must be >= 0, got {blocks}")
        self._capacity[instance] = blocks
        lru = self._lru.get(instance)
        if lru is not None:
            self._evict(instance, lru, len(lru) - blocks)

    def assign(self, instance: int, chain: Sequence[int], now: float) -> None:
        """``instance`` was just given ``chain`` (root first) at time ``now``: it now holds those
        blocks, most recently used; then its least recently used blocks beyond capacity are evicted
        (leaf-most first within a chain). Blocks of a chain are distinct (chained hashes are); only its
        root-most ``capacity`` blocks are touched. Expires nothing else; call ``expire`` for TTL."""
        bit = _check_instance(instance)
        self._tick(now)
        lru = self._lru.get(instance)
        if lru is None:
            lru = self._lru[instance] = OrderedDict()
        cap = self.capacity(instance)
        # Touching more than ``cap`` blocks would only evict the chain's own leaves again.
        keep = chain[:cap] if len(chain) > cap else chain
        masks = self._masks
        move = lru.move_to_end
        for b in reversed(keep):
            if b in lru:
                move(b)
            else:
                masks[b] = masks.get(b, 0) | bit
            lru[b] = now
        self._evict(instance, lru, len(lru) - cap)

    def _evict(self, instance: int, lru: OrderedDict[int, float], count: int) -> None:
        bit = 1 << instance
        masks = self._masks
        for _ in range(count):
            b, _t = lru.popitem(last=False)
            PrefixIndex._unset(masks, b, bit)
        if not lru:
            del self._lru[instance]

    def expire(self, now: float) -> int:
        """Drop every block last assigned at or before ``now - ttl_s``; return how many (instance,
        block) pairs were dropped. No-op without a TTL. Cost: O(instances + dropped)."""
        self._tick(now)
        if self.ttl_s is None:
            return 0
        deadline = now - self.ttl_s
        dropped = 0
        for instance, lru in list(self._lru.items()):
            count = 0
            for t in lru.values():  # oldest first: times are non-decreasing along the LRU order
                if t > deadline:
                    break
                count += 1
            if count:
                self._evict(instance, lru, count)
                dropped += count
        return dropped

    def clear(self, instance: int) -> None:
        """Forget everything about ``instance`` (it restarted or left)."""
        _check_instance(instance)
        lru = self._lru.get(instance)
        if lru is not None:
            self._evict(instance, lru, len(lru))

    def remove(self, instance: int, blocks: Iterable[int]) -> None:
        """Forget that ``instance`` holds ``blocks`` (e.g. an engine reported it evicted them)."""
        bit = _check_instance(instance)
        lru = self._lru.get(instance)
        if lru is None:
            return
        for b in blocks:
            if lru.pop(b, None) is not None:
                PrefixIndex._unset(self._masks, b, bit)
        if not lru:
            del self._lru[instance]

    def blocks(self, instance: int) -> list[int]:
        """Blocks believed held by ``instance``, least recently used first."""
        lru = self._lru.get(instance)
        return list(lru) if lru else []

    def holders(self, block: int) -> int:
        """Bitmask of the instances believed to hold ``block`` (0 if none)."""
        return self._masks.get(block, 0)

    def num_blocks(self, instance: int) -> int:
        """Blocks believed held by ``instance`` (<= its capacity)."""
        lru = self._lru.get(instance)
        return len(lru) if lru else 0

    def __len__(self) -> int:
        """Distinct blocks believed held by at least one instance."""
        return len(self._masks)

    def match(self, chain: Sequence[int], num_instances: int) -> list[int]:
        """Cached-prefix length in blocks of ``chain`` on instances ``0..num_instances-1`` (see
        :func:`match_chain`). Does not touch LRU order or expire anything (call ``expire`` first)."""
        return match_chain(self._masks, chain, num_instances)
