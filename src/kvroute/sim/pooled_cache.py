"""The most prefix-cache hits one pooled cache of K blocks can give a sequence of requests.

The model (the *pooled cache*; why it bounds a cluster's hits: ``docs/results/bound.md``): the
requests are served one after another in a given order. Serving request i *reads* its blocks, and
each of its first ``c(i)`` blocks that is in the cache then is a hit (``c(i)`` = the blocks a hit
may count, ``min(len(block_ids), (prompt − 1) // block_size)``, as the engine always computes at
least one prompt token); then any of i's blocks may be put in the cache (or not: *bypass*), and any
block may be dropped at any time; the cache never holds more than K blocks. A block not in the
cache can only come back by being put there when a request holding it is served.

:func:`pooled_cache_hits` computes the most hits over all such schedules, exactly: after each
request, keep the K blocks whose next counted read is soonest (Belady's rule with bypass; a hit
needs the block kept over the whole gap since a request holding it, so this is choosing the most
read-to-read intervals with at most K over any gap, which keeping the soonest ending ones does).
Ties go to the shallower block (its next read is never later than its child's: a request holding a
block holds its whole prefix), so the kept blocks are closed under prefixes and every hit is a
leading block, as the engine's prefix cache needs: counting every present block loses nothing.

Speed: blocks with the same holders (equal ids are an equal prefix, so along a chain the holders
only shrink) are merged into *segments* that are kept or dropped together, deepest first. A
conversation's turn k holds about k segments; a 200k-token context costs no more than a short
one. Python work is per segment and request; the rest is numpy over the block ids.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

__all__ = ["PooledHits", "pooled_cache_hits"]

_NEVER = np.iinfo(np.int64).max // 4


@dataclass(frozen=True, slots=True)
class PooledHits:
    """The pooled cache's best schedule: ``per_request`` hit blocks (workload order), their sum
    ``total`` (blocks), and ``countable`` = Σ c(i) (blocks a hit could count at most)."""

    per_request: np.ndarray
    total: int
    countable: int


def pooled_cache_hits(
    ids: np.ndarray,
    lengths: np.ndarray,
    countable: np.ndarray,
    order: np.ndarray,
    capacity_blocks: int,
) -> PooledHits:
    """The most hits of the pooled cache of ``capacity_blocks`` blocks (module docstring).

    ``ids``: the requests' block ids concatenated (``lengths[i]`` for request i, chained: each id
    has one predecessor and one position wherever it occurs, as :func:`kvroute.sim.bound` checks);
    ``countable[i]`` ≤ ``lengths[i]``: how many of i's leading blocks a hit may count; ``order``: the
    requests' indices in the order they are served. Hits are in blocks."""
    n = len(lengths)
    per = np.zeros(n, dtype=np.int64)
    total_countable = int(np.minimum(countable, lengths).sum())
    if n == 0 or not len(ids) or capacity_blocks <= 0:
        return PooledHits(per, 0, total_countable)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    at = np.arange(len(ids), dtype=np.int64) - np.repeat(starts, lengths)  # position in its request
    _, inv, holders = np.unique(ids, return_inverse=True, return_counts=True)
    inv = inv.astype(np.int64).ravel()
    # a segment starts at a request's first block, where the holder count drops, and where some
    # holder stops counting (its block c(i)): every holder then holds each segment whole, and
    # reads it all counted or all not
    cut = np.zeros(len(holders), dtype=bool)
    req_of = np.repeat(np.arange(n, dtype=np.int64), lengths)
    stop = at == np.minimum(countable, lengths)[req_of]
    cut[inv[stop]] = True
    prev = np.roll(inv, 1)
    first = at == 0
    seg_start = first | (holders[inv] != holders[prev]) | cut[inv]
    pos = np.where(seg_start, np.arange(len(ids), dtype=np.int64), 0)
    np.maximum.accumulate(pos, out=pos)
    # each segment reference: (request, segment id = its first block's distinct index, weight,
    # depth = its first block's position, counted for that request)
    ref_at = np.flatnonzero(seg_start)
    ref_req = req_of[ref_at]
    ref_seg = inv[ref_at]
    ref_end = np.append(ref_at[1:], len(ids))
    ref_w = ref_end - ref_at
    ref_depth = at[ref_at]
    ref_counted = at[ref_at] < np.minimum(countable, lengths)[ref_req]
    # serve order rank of each request; each reference's next counted reference of its segment
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n, dtype=np.int64)
    ref_rank = rank[ref_req]
    by = np.lexsort((ref_rank, ref_seg))
    seg_s, rank_s = ref_seg[by], ref_rank[by]
    nseg = int(seg_s.max()) + 1 if len(seg_s) else 0
    big = n + 2
    val = np.where(ref_counted[by], rank_s, big - 1) + seg_s * big  # within a segment: rank, or "none"
    suffix = np.minimum.accumulate(val[::-1])[::-1]
    nxt = np.full(len(by), _NEVER, dtype=np.int64)
    same = seg_s[1:] == seg_s[:-1]
    after = suffix[1:] - seg_s[1:] * big
    nxt[:-1] = np.where(same & (after < big - 1), after, _NEVER)
    ref_next = np.empty(len(by), dtype=np.int64)
    ref_next[by] = nxt
    # serve the requests in order: references grouped by request, requests by rank
    serve = np.lexsort((ref_at, ref_rank))
    present = np.zeros(nseg, dtype=np.int64)
    key = np.full(nseg, -1, dtype=np.int64)  # the next read each segment's live heap entry carries
    heap: list[tuple[int, int, int]] = []  # (−next read, −depth, segment): farthest, deepest first
    held = 0
    cap = int(capacity_blocks)
    req_l = ref_req[serve].tolist()
    seg_l = ref_seg[serve].tolist()
    w_l = ref_w[serve].tolist()
    d_l = ref_depth[serve].tolist()
    c_l = ref_counted[serve].tolist()
    nx_l = ref_next[serve].tolist()
    k, total = 0, len(req_l)
    while k < total:
        r = req_l[k]
        end = k
        hits = 0
        while end < total and req_l[end] == r:  # read: count what is present
            if c_l[end]:
                hits += int(present[seg_l[end]])
            end += 1
        per[r] = hits
        for j in range(k, end):  # then put every segment of r in, keyed by its next counted read
            s, nx = seg_l[j], nx_l[j]
            held -= int(present[s])
            if nx >= _NEVER:
                present[s] = 0
                key[s] = -1
                continue
            present[s] = w_l[j]
            held += w_l[j]
            key[s] = nx
            heapq.heappush(heap, (-nx, -d_l[j], s))
        while held > cap:  # drop the farthest next reads, deepest first (stale entries skipped)
            negnx, _, s = heap[0]
            if key[s] != -negnx or present[s] == 0:
                heapq.heappop(heap)
                continue
            drop = min(held - cap, int(present[s]))
            present[s] -= drop
            held -= drop
            if present[s] == 0:
                key[s] = -1
                heapq.heappop(heap)
        k = end
    return PooledHits(per, int(per.sum()), total_countable)
