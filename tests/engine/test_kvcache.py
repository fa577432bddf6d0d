"""BlockPool against a plain reference (refcounts + an OrderedDict LRU): same evictions, events,
counters, through random acquire / allocate / promote / release sequences."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.engine import kvcache
from kvroute.engine.kvcache import BlockPool
from kvroute.engine.types import BlockRemoved, KVEvent


class RefPool:
    """The obvious pool: refcount per cached hash, refcount-0 hashes in LRU order."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.private = 0
        self.ref: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.removed: list[int] = []

    def available(self) -> int:
        return self.free + len(self.lru)

    def hits(self, hashes: list[int]) -> tuple[int, int]:
        n = ev = 0
        for h in hashes:
            if h not in self.ref:
                break
            ev += self.ref[h] == 0
            n += 1
        return n, ev

    def take(self, h: int) -> None:
        if self.ref[h] == 0:
            del self.lru[h]
        self.ref[h] += 1

    def allocate(self, n: int) -> bool:
        if n > self.available():
            return False
        for _ in range(max(n - self.free, 0)):
            h, _none = self.lru.popitem(last=False)
            del self.ref[h]
            self.free += 1
            self.removed.append(h)
        self.free -= n
        self.private += n
        return True

    def promote(self, h: int) -> None:
        self.private -= 1
        if h in self.ref:
            self.take(h)
            self.free += 1
        else:
            self.ref[h] = 1

    def release(self, hashes: list[int], private: int) -> None:
        for h in reversed(hashes):
            self.ref[h] -= 1
            if self.ref[h] == 0:
                self.lru[h] = None
        self.private -= private
        self.free += private


def _removed(events: list[KVEvent]) -> list[int]:
    return [h for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 1_000_000), blocks=st.sampled_from([8, 30, 200]), slack=st.sampled_from([0, 4096]))
def test_pool_matches_the_reference_lru(seed: int, blocks: int, slack: int) -> None:
    """Slack 0 compacts the LRU queue often; 4096 (the default) never here."""
    kvcache.COMPACT_SLACK = slack
    try:
        _run(random.Random(seed), blocks)
    finally:
        kvcache.COMPACT_SLACK = 4096


def _run(rng: random.Random, blocks: int) -> None:
    pool, ref = BlockPool(blocks, 4), RefPool(blocks)
    chains = [[c * 100 + i for i in range(rng.randint(1, 12))] for c in range(6)]
    chains.append([900, 901, 900, 902, 901])  # a chain repeating hashes (malformed trace ids)
    held: list[tuple[list[int], int]] = []  # (cached hashes, private blocks) per live request
    for _ in range(300):
        op = rng.random()
        if op < 0.55 or not held:  # a request: prefix hit, private blocks, promote some of them
            chain = rng.choice(chains)
            limit = rng.randint(0, len(chain))
            hit = pool.count_hits(chain, limit)
            assert hit == ref.hits(chain[:limit])
            n = hit[0]
            for h in chain[:n]:
                ref.take(h)
            pool.acquire(chain[:n])
            need = rng.randint(0, 6)
            ok = pool.allocate(need)
            assert ok == (need <= ref.available() or need == 0) and (ok == ref.allocate(need) or need == 0)
            if not ok:
                pool.release(chain[:n], 0)
                ref.release(chain[:n], 0)
                continue
            mine = list(chain[:n])
            new = chain[n : n + min(need, len(chain) - n)]
            pool.promote(new, mine[-1] if mine else None, None, n, mine)
            for h in new:
                ref.promote(h)
            held.append((mine, need - len(new)))
        else:  # a request ends
            mine, private = held.pop(rng.randrange(len(held)))
            pool.release(mine, private)
            ref.release(mine, private)
        assert (pool.free, pool.private, pool.available) == (ref.free, ref.private, ref.available())
        assert {h: max(r, 0) for h, r in pool.cached.items()} == ref.ref
        assert _removed(pool.events) == ref.removed
        pool.check()
