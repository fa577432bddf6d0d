"""KVCacheManager: per-request accounting over random admit / grow / cache / free sequences keeps
refcounts equal to the requests holding each block (never negative), private blocks equal to what
the requests hold beyond their cached prefix, and cached + free + private == total."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.engine.kvmanager import KVCacheManager, RequestBlocks
from kvroute.engine.types import BlockStored, EngineRequest

BS = 4


def request(rid: int, prefix: int, blocks: int, shared: int) -> EngineRequest:
    """A prompt of ``blocks`` full blocks (plus 2 tokens) whose first ``shared`` blocks come from
    the common prefix family ``prefix``."""
    hashes = tuple(prefix * 1000 + j if j < shared else 10**6 + rid * 100 + j for j in range(blocks))
    return EngineRequest(rid, blocks * BS + 2, 4, hashes)


def check(kv: KVCacheManager, live: dict[int, tuple[RequestBlocks, int]]) -> None:
    """The pool's own invariants plus the per-request ones (``live``: record, tokens covered)."""
    kv.check()
    pool = kv.pool
    assert pool.free + pool.private + len(pool.cached) == pool.num_blocks
    holders = Counter(h for rec, _ in live.values() for h in rec.held)
    for h, ref in pool.cached.items():
        assert ref != 0
        assert (ref if ref > 0 else 0) == holders[h]  # a refcount is the number of holders, >= 0
    assert set(holders) <= set(pool.cached)
    assert pool.private == sum(rec.nblocks - len(rec.held) for rec, _ in live.values())
    for rec, tokens in live.values():
        assert rec.nblocks * BS >= tokens  # blocks cover the tokens given to the request
        assert rec.held == list(rec.req.block_hashes[: len(rec.held)])
    assert kv.used_blocks == pool.private + len(holders)  # a shared block counts once
    assert kv.available_blocks == pool.free + pool.evictable


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), blocks=st.integers(8, 40))
def test_random_operations_keep_the_accounting(seed: int, blocks: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(blocks, BS)
    live: dict[int, tuple[RequestBlocks, int]] = {}
    rid = 0
    for _ in range(200):
        op = rng.random()
        if op < 0.35 or not live:  # admit a new request (its first chunk)
            rid += 1
            rec = RequestBlocks(request(rid, rng.randrange(3), rng.randrange(1, 6), rng.randrange(6)))
            known = rec.req.prompt_len
            hit, evictable = kv.lookup(rec, known)
            assert hit <= (known - 1) // BS  # at least one token is left to compute
            tokens = hit * BS + rng.randrange(1, known - hit * BS + 1)
            before = (kv.pool.free, kv.pool.private, dict(kv.pool.cached))
            if kv.admit(rec, hit, evictable, tokens, True):
                live[rid] = (rec, tokens)
            else:  # refused: nothing changed
                assert not kv.fits(hit, evictable, tokens)
                assert (kv.pool.free, kv.pool.private, dict(kv.pool.cached)) == before
        elif op < 0.65:  # grow a request by a few tokens, then cache its full prompt blocks
            k = rng.choice(list(live))
            rec, tokens = live[k]
            tokens = min(tokens + rng.randrange(1, 3 * BS), rec.req.prompt_len + rec.req.output_len)
            if kv.allocate_slots(rec, tokens):
                live[k] = (rec, tokens)
                kv.cache_blocks(rec, tokens)
        else:  # finish (or preempt) a request
            rec, _ = live.pop(rng.choice(list(live)))
            kv.free(rec)
            assert rec.held == [] and rec.nblocks == 0
        check(kv, live)
    for rec, _ in live.values():
        kv.free(rec)
    check(kv, {})
    assert kv.used_blocks == 0 and kv.free_blocks + kv.cached_blocks == blocks


def test_lookup_leaves_one_token_and_honours_prefix_caching() -> None:
    kv = KVCacheManager(20, BS)
    a = RequestBlocks(request(1, 7, 3, 3))
    assert kv.admit(a, 0, 0, a.req.prompt_len, True)
    kv.cache_blocks(a, a.req.prompt_len)
    assert [type(e) for e in kv.take_events()] == [BlockStored]
    # the same three blocks as the whole prompt: only two may be hits (one token must be computed)
    b = RequestBlocks(EngineRequest(2, 3 * BS, 1, a.req.block_hashes))
    assert kv.lookup(b, 3 * BS) == (2, 0)
    c = RequestBlocks(request(3, 7, 3, 3))
    assert kv.lookup(c, c.req.prompt_len) == (3, 0)
    off = KVCacheManager(20, BS, enable_prefix_caching=False)
    assert off.lookup(c, c.req.prompt_len) == (0, 0)


def test_prefix_cache_statistics_count_first_admissions_only() -> None:
    kv = KVCacheManager(20, BS)
    a = RequestBlocks(request(1, 5, 2, 2))
    kv.admit(a, 0, 0, a.req.prompt_len, True)
    kv.cache_blocks(a, a.req.prompt_len)
    kv.free(a)
    b = RequestBlocks(request(2, 5, 2, 2))
    hit, evictable = kv.lookup(b, b.req.prompt_len)
    assert (hit, evictable) == (2, 2)  # both blocks evictable (nobody holds them)
    assert kv.admit(b, hit, evictable, b.req.prompt_len, True)
    kv.free(b)
    kv.admit(b, hit, evictable, b.req.prompt_len, False)  # readmitted after a preemption
    assert (kv.query_tokens, kv.hit_tokens) == (2 * a.req.prompt_len, 2 * BS)
