"""The bound: what no router can beat on a workload and cluster, for this engine model.

Derivation and assumptions: ``docs/results/bound.md``. In short, for N instances of one engine
(chunk budget B tokens per step, batch limit S sequences, cost model ``step_time``):

- **Peak rate** R* (tokens/s per instance) = max over T ≤ B of T / τ(T), with τ(T) a lower bound on
  any step that computes T tokens: the cost model's ``least_step_times`` (the least over every number
  d ≤ S of decodes, every context and every chunking; for the profiles' attention tables, the minimum
  over the whole table, which is not monotone in context). τ_min = min over T of τ(T): no non-empty
  step is shorter. σ(c) = min over T ≥ c of τ(T): no step that computes c or more tokens is shorter.
  Cost models without ``least_step_times`` fall back to one chunk without context beside d decodes
  of one token of context, *assuming* context and rows only add time (the tests check both).
- **Oracle misses**: a block of request i is *seen* if a request before it (by arrival, ties by
  position in the workload) has it (block ids are chained, so that means the same prefix); the oracle
  holds every block on every instance from the moment the first request with it arrives, and evicts
  nothing. h(i) = i's leading seen blocks. Request i's first token still needs m(i) = prompt(i) −
  block_size · min(h(i), (prompt − 1) // block_size) tokens computed after it arrives, on its
  instance, in steps one after another (by i, or by requests holding the same prefix): no unseen
  block can be computed before i arrives (no request holding it had), and the engine computes the
  tail and at least one token of every prompt (as the routing core assumes).
- **Charged work** (the throughput terms and the KV hit-rate ceiling): w(i) = prompt(i) −
  block_size · h(i) (at least 0), with no recompute: each distinct block charged once, to the first
  request holding it, plus each request's unhashed tail. Every schedule computes each distinct block
  at least once, after its first holder arrives and before that holder's first token, so Σ w is at
  most any router's prefill work and 1 − Σ w / Σ prompt at least any router's KV hit rate (the hit
  each request reports at its first admission, as vLLM does, when every request finishes).
- **Chained ids**: all of this reads equal block ids as an equal prefix (each id has one predecessor
  and one position wherever it occurs), as the engine's prefix cache does; a workload whose ids are not
  chained raises :class:`UnchainedBlocks` and gets no bound.
- **TTFT floor** of request i: f(m(i)), the least total time of steps that together compute its
  m(i) tokens: f(m) = min over chunkings c_1 + … + c_k = m, c_j ≤ B, of Σ σ(c_j) (a dynamic programme,
  exact up to ``_EXACT_CHUNKS`` budgets, then extended by m / R*), never below max(m / R*, τ_min).
  A request's chunks go through one instance's steps one after another, and a step holding c of its
  tokens lasts at least σ(c) whatever else it holds. Every request's TTFT is at least its floor
  whatever the routing, so the mean TTFT is at least the mean of the floors and every TTFT quantile
  at least the same quantile of the floors.
- **Pooled queue** (mean TTFT only): N instances at R* each can do no more than one server of speed
  N · R* that may split any request across instances; on one server, shortest-remaining-work-first
  minimises the mean time to finish (SRPT), so the mean TTFT is at least the mean SRPT finish time of
  the works w(i) released at the arrivals on that server. The mean TTFT bound is the larger
  of this and the mean floor (queueing, which the floors lack, shows at high load).
- **Peak decode rate** D* = max over d ≤ S of d / τ_dec(d), τ_dec(d) = a step of d decoding
  sequences with one token of context each (a step with d decodes lasts at least that).
- **Capacity**: meeting TTFT p99 ≤ F and TPOT p99 ≤ P with every request finished needs (1) the k-th
  smallest TTFT floor ≤ F, k = floor(0.99 · n); (2) at every time t, the w(i) of the requests with
  arrival + F ≤ t, less the n − k largest of them (those allowed to miss F), computed by t: ≤ N · R*
  · t; (3) for the j ≥ n − (n − k) − (n_t − floor(0.99 · n_t)) requests that meet both (n_t:
  requests with more than one output token), finished by arrival + F + (out − 1) · P: at every t,
  their prefill and decode tokens (w(i) + out(i) − 1) due by t, less the n − j largest, fit in
  N · R* · t, and their decoded tokens (out(i) − 1) in N · D* · t. (Checked at 64 quantiles of the
  due times and the last: fewer checks only loosen the bound.)
  The capacity bound is the lowest rate scale failing one of these (searched like the policies'
  capacity, on the workload as that rate generates it).

All in seconds and tokens; pure functions of the workload's requests and the cost model.
"""

from __future__ import annotations

import functools
import heapq
import math
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from kvroute.engine.types import CostModel
from kvroute.errors import UserError
from kvroute.sim.pooled_cache import PooledHits, pooled_cache_hits
from kvroute.workloads.request import Request

if TYPE_CHECKING:
    from kvroute.sim.runner import RunSpec

__all__ = [
    "Engine",
    "UnchainedBlocks",
    "WorkloadBound",
    "bound_summary",
    "capacity_bound",
    "hit_rate_ceiling",
    "oracle_misses",
    "peak_rate",
    "spec_bound",
    "spec_engine",
    "ttft_floors_s",
    "workload_bound",
]


@dataclass(frozen=True, slots=True)
class Engine:
    """One instance's throughput limits: ``peak_tokens_s`` = R*, ``min_step_s`` = τ_min (seconds),
    from ``cost`` under chunk budget ``max_batched_tokens`` and batch limit ``max_num_seqs``."""

    peak_tokens_s: float
    min_step_s: float
    max_batched_tokens: int
    max_num_seqs: int
    peak_decode_s: float = math.inf  # D*: decoded tokens per second at most (d / τ_dec(d), d ≤ S)
    # σ(c) for c = 1..B at index c − 1: the shortest step that computes at least c tokens, seconds
    # (min over T ≥ c of τ(T)); empty: unknown (the TTFT floor is then max(m / R*, τ_min))
    step_floor_s: tuple[float, ...] = field(default=(), repr=False)
    # C: one instance's KV pool in tokens (its blocks: this // the workload's block size); 0: unknown,
    # and the bound's KV capacity terms are left out (as if every pool were infinite)
    kv_capacity_tokens: int = 0


def peak_rate(
    cost: CostModel, max_batched_tokens: int, max_num_seqs: int, kv_capacity_tokens: int = 0
) -> Engine:
    """R*, τ_min, D* and σ of the module docstring. τ(T) is the shortest step of T tokens over every
    number d ≤ min(T, S) of decodes: the cost model's ``least_step_times(T, S)`` where it has one (a
    lower bound over every context and chunking: the profiles' attention tables), else its
    ``step_time`` of one prefill chunk of T − d tokens without context beside d decodes of one token
    of context (context and more chunks only add time: the assumption the tests check)."""
    least = getattr(cost, "least_step_times", None)
    best_rate = best_decode = 0.0
    min_step = math.inf
    taus: list[float] = []
    for t in range(1, max_batched_tokens + 1):
        if least is not None:
            steps = least(t, max_num_seqs)
        else:
            steps = [
                cost.step_time([(t - d, 0)] if d < t else [], d, d) for d in range(min(t, max_num_seqs) + 1)
            ]
        if min(steps) <= 0:
            raise ValueError(f"cost model {cost.name!r} gives a step of {t} tokens no time")
        tau = min(steps)
        if t <= max_num_seqs:
            best_decode = max(best_decode, t / steps[t])
        best_rate = max(best_rate, t / tau)
        min_step = min(min_step, tau)
        taus.append(tau)
    floor = np.minimum.accumulate(np.array(taus[::-1]))[::-1]  # σ(c) = min over T >= c of τ(T)
    return Engine(
        best_rate,
        min_step,
        max_batched_tokens,
        max_num_seqs,
        best_decode,
        tuple(float(x) for x in floor),
        kv_capacity_tokens,
    )


_EXACT_CHUNKS = 8
"""The prefill floor is exact up to this many full chunk budgets of tokens (then extended, below)."""


@functools.lru_cache(maxsize=8)
def _prefill_floor_table(engine: Engine, upto: int) -> np.ndarray:
    """f(m) for m = 0..upto (seconds): the least time of steps that together compute m tokens of one
    request, f(m) = min over chunkings c_1 + … + c_k = m, c_j ≤ B, of Σ σ(c_j) (a dynamic programme;
    f is non-decreasing, since σ is and is ≥ 0)."""
    sigma = np.asarray(engine.step_floor_s, dtype=np.float64)
    budget = len(sigma)
    f = np.zeros(upto + 1, dtype=np.float64)
    for m in range(1, upto + 1):
        k = m if m < budget else budget
        f[m] = np.min(f[m - k : m][::-1] + sigma[:k])
    return f


def ttft_floors_s(misses: np.ndarray, engine: Engine) -> np.ndarray:
    """Each request's TTFT floor (seconds) from its oracle misses m (module docstring, *TTFT floor*):
    its m tokens go through steps, each computing some c ≤ B of them and so lasting at least σ(c),
    and its first token needs at least one step. Exact (f(m)) up to ``_EXACT_CHUNKS`` · B tokens;
    beyond, f(m) ≥ f(M − B + 1) + (m − M) / R* with M that limit (drop whole chunks from an optimal
    chunking of m until at most M tokens are left: more than M − B remain, and each dropped chunk
    took at least its tokens / R*). Never below max(m / R*, τ_min)."""
    m = np.asarray(misses, dtype=np.int64)
    base = np.maximum(m / engine.peak_tokens_s, engine.min_step_s)
    sigma = engine.step_floor_s
    if not sigma or not len(m):
        return base
    budget = len(sigma)
    exact = _EXACT_CHUNKS * budget
    upto = int(min(max(int(m.max()), budget), exact))
    f = _prefill_floor_table(engine, exact)[: upto + 1]  # one table per engine (a prefix is exact)
    inside = np.minimum(m, upto)
    floors = f[inside]
    over = m > upto
    if over.any():
        floors = np.where(over, f[upto - budget + 1] + (m - upto) / engine.peak_tokens_s, floors)
    return np.maximum(floors, base)


class UnchainedBlocks(UserError):
    """The workload's block ids are not chained (an id seen after two different prefixes, or twice
    in one request): the bound assumes equal ids mean an equal prefix, so it is not computed."""


def _seen_run(ids: np.ndarray, lengths: np.ndarray, arrivals: np.ndarray) -> np.ndarray:
    """h(i) before the cap (module docstring) from the requests' concatenated block ids (one run of
    ``lengths[i]`` ids per request) and arrival times (s): request i's count of leading blocks that a
    request before it in (arrival, position) order has. Raises :class:`UnchainedBlocks` unless every
    distinct id has one predecessor id and one position in every request that holds it."""
    n = len(lengths)
    h = np.zeros(n, dtype=np.int64)
    if n == 0 or not len(ids):
        return h
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    nonempty = lengths > 0
    pos = np.arange(len(ids), dtype=np.int64)
    at = pos - np.repeat(starts, lengths)  # each id's position in its request
    order = np.argsort(ids, kind="stable")
    ids_s = ids[order]
    same = ids_s[1:] == ids_s[:-1]  # neighbours in sorted order holding the same id
    inv = np.empty(len(ids), dtype=np.int64)
    inv[order] = np.concatenate(([0], np.cumsum(~same)))
    pred = np.roll(ids, 1)  # each id's predecessor in its request (0 for a first block)
    pred[starts[nonempty]] = 0
    at_s, pred_s = at[order], pred[order]
    if (same & ((at_s[1:] != at_s[:-1]) | (pred_s[1:] != pred_s[:-1]))).any():
        raise UnchainedBlocks(
            "the bound needs chained block ids (equal ids meaning an equal prefix): this workload has an "
            "id after two different prefixes or twice in one request"
        )
    rank = np.empty(n, dtype=np.int64)
    rank[np.argsort(arrivals, kind="stable")] = np.arange(n, dtype=np.int64)
    owner = np.repeat(rank, lengths)  # each id's request, as its rank in arrival order
    first = np.full(int(inv.max()) + 1, n, dtype=np.int64)
    np.minimum.at(first, inv, owner)  # the earliest request holding each distinct id
    first_unseen = np.where(first[inv] < owner, len(ids), pos)
    run = np.minimum.reduceat(first_unseen, starts[nonempty]) - starts[nonempty]
    h[nonempty] = np.minimum(run, lengths[nonempty])
    return h


def _misses(h: np.ndarray, prompts: np.ndarray, block_sizes: np.ndarray) -> np.ndarray:
    """m(i): prompt tokens request i's first token needs computed after it arrives, its seen run
    ``h`` capped at (prompt − 1) // block size (the floors' misses)."""
    cap = np.where(prompts > 0, (prompts - 1) // block_sizes, 0)
    return prompts - np.minimum(h, cap) * block_sizes


def _works(h: np.ndarray, prompts: np.ndarray, block_sizes: np.ndarray) -> np.ndarray:
    """w(i): the prefill work charged to request i (its first-held blocks and its unhashed tail,
    no recompute: the throughput terms' and the hit-rate ceiling's misses, module docstring)."""
    return np.maximum(prompts - h * block_sizes, 0)


def _extend_ids(ids: array[int], block_ids: Sequence[int]) -> None:
    """Append ``block_ids`` to ``ids`` as unsigned 64-bit (negative ids as their two's complement,
    as ``b & _MASK``): in C when they fit a signed 64-bit int, else one by one."""
    try:
        ids.frombytes(array("q", block_ids).tobytes())
    except OverflowError:
        ids.extend(b & _MASK for b in block_ids)


def _columns(reqs: Sequence[Request]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The requests' concatenated block ids, block counts, prompt lengths, block sizes and arrivals."""
    ids = np.fromiter((b & _MASK for r in reqs for b in r.block_ids), dtype=np.uint64)
    lengths = np.array([len(r.block_ids) for r in reqs], dtype=np.int64)
    prompts = np.array([r.prompt_len for r in reqs], dtype=np.int64)
    sizes = np.array([r.block_size for r in reqs], dtype=np.int64)
    arrivals = np.array([r.arrival for r in reqs], dtype=np.float64)
    return ids, lengths, prompts, sizes, arrivals


def hit_rate_ceiling(requests: Iterable[Request], capacity_blocks: int | None = None) -> float:
    """The most KV hit rate (cached / prompt tokens, every request finished) any router can reach on
    ``requests``; 0 when empty. ``capacity_blocks`` None: the infinite-cache oracle, 1 − Σ w(i) /
    Σ prompt(i) (module docstring, *charged work*), for any admission order. Else the pooled cache
    of that many blocks (:func:`pooled_capacity_blocks` for a cluster), block_size · H / Σ prompt
    (module docstring, *KV capacity*), for admission in arrival order; the lower of the two. Raises
    :class:`UnchainedBlocks` (a :class:`UserError`) for unchained block ids."""
    ids, lengths, prompts, sizes, arrivals = _columns(list(requests))
    total = int(prompts.sum())
    if not total:
        return 0.0
    oracle = (total - int(_works(_seen_run(ids, lengths, arrivals), prompts, sizes).sum())) / total
    if capacity_blocks is None:
        return oracle
    hits = _pooled_hits(ids, lengths, prompts, sizes, arrivals, capacity_blocks)
    return min(oracle, int(sizes[0]) * hits.total / total)


def oracle_misses(requests: Iterable[Request]) -> list[int]:
    """m(i) per request (module docstring): prompt tokens its first token needs computed after it
    arrives when every block an earlier request had is cached on every instance."""
    ids, lengths, prompts, sizes, arrivals = _columns(list(requests))
    return [int(m) for m in _misses(_seen_run(ids, lengths, arrivals), prompts, sizes)]


_MASK = (1 << 64) - 1


def _countable(lengths: np.ndarray, prompts: np.ndarray, block_sizes: np.ndarray) -> np.ndarray:
    """c(i): the leading blocks request i's hit can count, min(blocks, (prompt − 1) // block size)
    (the engine computes at least one prompt token)."""
    return np.minimum(lengths, np.where(prompts > 0, (prompts - 1) // block_sizes, 0))


def _pooled_hits(
    ids: np.ndarray,
    lengths: np.ndarray,
    prompts: np.ndarray,
    block_sizes: np.ndarray,
    arrivals: np.ndarray,
    capacity_blocks: int,
) -> PooledHits:
    """The pooled cache's most hits (blocks) serving the requests in arrival order (ties: workload
    order), :func:`kvroute.sim.pooled_cache.pooled_cache_hits`."""
    order = np.argsort(arrivals, kind="stable")
    countable = _countable(lengths, prompts, block_sizes)
    return pooled_cache_hits(ids, lengths, countable, order, capacity_blocks)


def pooled_capacity_blocks(
    lengths: Sequence[int] | np.ndarray, block_size: int, engine: Engine, instances: int
) -> int:
    """K = N · C + the N largest min(blocks(i), C) (C = ``engine.kv_capacity_tokens`` // block size,
    ``lengths`` the requests' block counts): the most distinct blocks the N pools hold, cached or
    owned by admitted requests, at any first admission (module docstring, *KV capacity*); 0 when C
    is unknown."""
    per = engine.kv_capacity_tokens // block_size if block_size > 0 else 0
    if per <= 0:
        return 0
    sizes = np.minimum(np.asarray(lengths, dtype=np.int64), per)
    largest = np.sort(sizes)[::-1][:instances]
    return instances * per + int(largest.sum())


def _shared_run(ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """g(i): request i's leading blocks that some other request holds (with chained ids, a block two
    requests hold has a prefix they both hold, so these are i's blocks held twice or more)."""
    n = len(lengths)
    g = np.zeros(n, dtype=np.int64)
    if n == 0 or not len(ids):
        return g
    _, inv, count = np.unique(ids, return_inverse=True, return_counts=True)
    twice = (count[inv.ravel()] > 1).astype(np.int64)
    nonempty = lengths > 0
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[nonempty]
    g[nonempty] = np.add.reduceat(twice, starts)
    return g


def floor_sum_with_hit_budget_s(
    prompts: np.ndarray, most_hits: np.ndarray, block_size: int, hit_budget: int, engine: Engine
) -> float:
    """A lower bound on Σ_i f(prompt(i) − block_size · x(i)) over every x with 0 ≤ x(i) ≤
    ``most_hits[i]`` (blocks) and Σ x ≤ ``hit_budget`` (seconds; f the TTFT floor of
    :func:`ttft_floors_s`): Lagrangian duality, max over λ ≥ 0 of Σ_i min over x(i) of
    [f(prompt(i) − block_size · x(i)) + λ · x(i)] − λ · hit_budget, each λ giving a lower bound
    (searched by golden section on the dual, which is concave). With Σ most ≤ budget it is Σ f of
    the least misses. Needs prompt(i) − block_size · most_hits[i] ≥ 1."""
    p = np.asarray(prompts, dtype=np.int64)
    most = np.asarray(most_hits, dtype=np.int64)
    least = p - block_size * most
    base = float(ttft_floors_s(least, engine).sum())
    if not len(p) or int(most.sum()) <= hit_budget:
        return base
    budget_b = len(engine.step_floor_s)
    pmax = int(p.max())
    upto = min(max(pmax, budget_b), _EXACT_CHUNKS * budget_b) if budget_b else min(pmax, 1 << 22)
    m_all = np.arange(upto + 1, dtype=np.int64)
    f_tab = ttft_floors_s(m_all, engine)
    rate = engine.peak_tokens_s
    # beyond the table f is m / R* plus a constant (ttft_floors_s' extension)
    ext0 = max(float(f_tab[upto - budget_b + 1]) - upto / rate, 0.0) if budget_b else 0.0
    # the progression {prompt − block_size · x} in the table is one run of its residue class
    order = np.lexsort((m_all, m_all % block_size))
    pos = np.empty(upto + 1, dtype=np.int64)
    pos[order] = np.arange(upto + 1, dtype=np.int64)
    top = np.minimum(p, upto)
    hi = p - block_size * (-(-(p - top) // block_size))  # the largest m ≤ min(p, upto) in the run
    in_tab = least <= hi
    idx = np.empty(2 * int(in_tab.sum()), dtype=np.int64)
    idx[0::2] = pos[least[in_tab]]
    idx[1::2] = pos[hi[in_tab]] + 1
    over = p > upto  # and its part beyond the table: the end points of a linear stretch
    first_over = p - block_size * ((p - np.maximum(least, upto + 1)) // block_size)
    ends = [first_over[over], p[over]]

    def dual(lam: float) -> float:
        mu = lam / block_size  # per token
        phi = f_tab - mu * m_all
        arr = np.append(phi[order], 0.0)
        best = np.full(len(p), np.inf)
        if len(idx):
            best[in_tab] = np.minimum.reduceat(arr, idx)[0::2]
        if over.any():
            lin = np.minimum(*(ext0 + m * (1.0 / rate - mu) for m in ends))
            best[over] = np.minimum(best[over], lin)
        return float((best + mu * p).sum()) - lam * hit_budget

    lo_l, hi_l = 0.0, float(f_tab[min(block_size, upto)]) + 2.0 * block_size / rate
    found = max(base, dual(0.0))
    golden = (math.sqrt(5.0) - 1.0) / 2.0
    a, b = lo_l, hi_l
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = dual(c), dual(d)
    for _ in range(40):
        found = max(found, fc, fd)
        if fc >= fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = dual(c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = dual(d)
    return max(found, fc, fd)


def _fits_by_deadlines(
    deadlines: np.ndarray, works: np.ndarray, excused: int, rate: float, points: int = 64
) -> bool:
    """For each t among ``points`` quantiles of ``deadlines`` (and the last): the works due by t, less
    the ``excused`` largest of them (requests allowed to miss), fit in ``rate`` · t."""
    order = np.argsort(deadlines, kind="stable")
    d, w = deadlines[order], works[order].astype(np.float64)
    n = len(d)
    for idx in sorted({int(q * (n - 1)) for q in np.linspace(0.0, 1.0, points)} | {n - 1}):
        t = d[idx]
        due = w[: np.searchsorted(d, t, side="right")]
        drop = min(excused, len(due))
        total = due.sum() - (np.partition(due, len(due) - drop)[len(due) - drop :].sum() if drop else 0.0)
        if total > rate * t:
            return False
    return True


@dataclass(frozen=True, slots=True)
class WorkloadBound:
    """The bound's terms on one generated workload: ``requests``, ``last_arrival_s``, the oracle's
    KV hit rate (cached / prompt tokens, infinite caches), the mean and p99 TTFT floors and the
    pooled SRPT mean (ms); with the pools' size known (``kv_capacity_blocks`` K > 0) the pooled
    cache's KV hit-rate ceiling and its mean-TTFT terms (module docstring, *KV capacity*); and per
    request the arrival (s), the prefill work w(i) charged to it, the output tokens and the prompt
    tokens (for :meth:`meets`)."""

    requests: int
    last_arrival_s: float
    oracle_hit_rate: float
    ttft_floor_mean_ms: float
    ttft_floor_p99_ms: float
    pooled_srpt_mean_ms: float = 0.0
    arrivals: np.ndarray = field(default_factory=lambda: np.zeros(0), repr=False, compare=False)
    works: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False, compare=False)
    outputs: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False, compare=False
    )
    kv_capacity_blocks: int = 0  # K of the pooled cache; 0: unknown, the KV capacity terms are off
    kv_hit_tokens: int = 0  # block size · H: the most prompt tokens any router's hits cover
    kv_floor_mean_ms: float = 0.0  # mean TTFT floor with at most H hit blocks in all
    kv_srpt_mean_ms: float = 0.0  # pooled SRPT mean of the least own work, plus the work H leaves
    prompts: np.ndarray = field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False, compare=False
    )

    @property
    def kv_hit_rate_ceiling(self) -> float:
        """The KV hit-rate ceiling: the pooled cache's (block size · H / Σ prompt) where K is known,
        at most the oracle's; else the oracle's."""
        total = int(np.asarray(self.prompts).sum())
        if self.kv_capacity_blocks <= 0 or not total:
            return self.oracle_hit_rate
        return min(self.oracle_hit_rate, self.kv_hit_tokens / total)

    @property
    def ttft_mean_any_order_ms(self) -> float:
        """The lower bound on mean TTFT (ms) for any admission order, without KV capacity: the
        larger of the mean floor and the pooled SRPT mean."""
        return max(self.ttft_floor_mean_ms, self.pooled_srpt_mean_ms)

    @property
    def ttft_mean_bound_ms(self) -> float:
        """The lower bound on mean TTFT (ms): :attr:`ttft_mean_any_order_ms`, or with K known the
        larger of it and the KV capacity terms (admission in arrival order)."""
        return max(self.ttft_mean_any_order_ms, self.kv_floor_mean_ms, self.kv_srpt_mean_ms)

    def meets(
        self, engine: Engine, instances: int, ttft_p99_ms: float, tpot_p99_ms: float, kv: bool = True
    ) -> bool:
        """Whether the workload could meet TTFT p99 ≤ ``ttft_p99_ms`` and TPOT p99 ≤ ``tpot_p99_ms``
        on ``instances`` with every request finished (module docstring; False: no router can).
        ``kv``: also the KV capacity conditions (where K is known; admission in arrival order)."""
        n = self.requests
        if n == 0:
            return True
        if self.ttft_floor_p99_ms > ttft_p99_ms:
            return False
        k = max(1, math.floor(0.99 * n))  # at least k requests meet the TTFT objective
        ttft_s, tpot_s = ttft_p99_ms / 1000.0, tpot_p99_ms / 1000.0
        rate = instances * engine.peak_tokens_s
        a = np.asarray(self.arrivals, dtype=np.float64)
        m = np.asarray(self.works, dtype=np.int64)
        if not _fits_by_deadlines(a + ttft_s, m, n - k, rate):
            return False
        decoded = np.asarray(self.outputs, dtype=np.int64) - 1
        kv_on = kv and self.kv_capacity_blocks > 0 and len(self.prompts) == n
        prompts = np.asarray(self.prompts, dtype=np.int64)
        if kv_on and not _fits_in_total(prompts, n - k, self.kv_hit_tokens, rate * (a.max() + ttft_s)):
            return False
        n_t = int((decoded > 0).sum())  # requests with a TPOT
        both = n - (n - k) - (n_t - math.floor(0.99 * n_t))  # meet both objectives, at least
        if both <= 0:
            return True
        finish = a + ttft_s + decoded * tpot_s  # by when a request meeting both has finished
        if not _fits_by_deadlines(finish, m + decoded, n - both, rate):
            return False
        if kv_on and not _fits_in_total(prompts + decoded, n - both, self.kv_hit_tokens, rate * finish.max()):
            return False
        return _fits_by_deadlines(finish, decoded, n - both, instances * engine.peak_decode_s)


def _fits_in_total(tokens: np.ndarray, excused: int, hit_tokens: int, capacity: float) -> bool:
    """Whether the requests' ``tokens`` (prompt, or prompt plus decoded, each), less the ``excused``
    largest and less ``hit_tokens`` (all hits, whoever gets them), fit in ``capacity`` tokens."""
    t = np.sort(np.asarray(tokens, dtype=np.int64))
    kept = int(t[: len(t) - excused].sum()) if excused < len(t) else 0
    return kept - hit_tokens <= capacity


def srpt_mean_s(arrivals: Sequence[float], works: Sequence[float], speed: float) -> float:
    """Mean time from release to finish of jobs (``works`` units released at ``arrivals``, seconds)
    on one preemptive server of ``speed`` units/s under shortest-remaining-work-first."""
    n = len(arrivals)
    if n == 0:
        return 0.0
    order = sorted(range(n), key=lambda i: arrivals[i])
    heap: list[tuple[float, int]] = []
    now = 0.0
    total = 0.0
    k = 0
    while k < n or heap:
        if not heap:
            now = max(now, arrivals[order[k]])
        while k < n and arrivals[order[k]] <= now:
            i = order[k]
            heapq.heappush(heap, (works[i] / speed, i))
            k += 1
        left, i = heapq.heappop(heap)
        nxt = arrivals[order[k]] if k < n else math.inf
        if now + left <= nxt:
            now += left
            total += now - arrivals[i]
        else:
            heapq.heappush(heap, (left - (nxt - now), i))
            now = nxt
    return total / n


def workload_bound(requests: Iterable[Request], engine: Engine, instances: int = 1) -> WorkloadBound:
    """The terms of :class:`WorkloadBound` for ``requests`` (consumed once, kept as arrays) on
    ``instances`` of ``engine`` (its ``kv_capacity_tokens`` gives the KV capacity terms; a workload
    with mixed block sizes gets none)."""
    ids: array[int] = array("Q")
    lengths: array[int] = array("q")
    prompts: array[int] = array("q")
    sizes: array[int] = array("q")
    outputs: array[int] = array("q")
    arrivals: array[float] = array("d")
    for r in requests:
        _extend_ids(ids, r.block_ids)
        lengths.append(len(r.block_ids))
        prompts.append(r.prompt_len)
        sizes.append(r.block_size)
        outputs.append(max(1, r.output_len))
        arrivals.append(r.arrival)
    n = len(lengths)
    if n == 0:
        return WorkloadBound(0, 0.0, 0.0, 0.0, 0.0)
    ids_ = np.frombuffer(ids, dtype=np.uint64)
    lengths_ = np.frombuffer(lengths, dtype=np.int64)
    arrivals_ = np.frombuffer(arrivals, dtype=np.float64)
    prompt = np.frombuffer(prompts, dtype=np.int64)
    sizes_ = np.frombuffer(sizes, dtype=np.int64)
    h = _seen_run(ids_, lengths_, arrivals_)
    works = _works(h, prompt, sizes_)
    misses = _misses(h, prompt, sizes_)
    floors_s = ttft_floors_s(misses, engine)
    floors = np.sort(floors_s) * 1000.0
    k = max(1, math.floor(0.99 * n))
    total = int(prompt.sum())
    speed = instances * engine.peak_tokens_s
    kv = _kv_terms(ids_, lengths_, prompt, sizes_, arrivals_, h, engine, instances)
    return WorkloadBound(
        requests=n,
        last_arrival_s=max(arrivals),
        oracle_hit_rate=(total - int(works.sum())) / total if total else 0.0,
        ttft_floor_mean_ms=float(floors.mean()),
        ttft_floor_p99_ms=float(floors[k - 1]),
        pooled_srpt_mean_ms=1000.0 * srpt_mean_s(arrivals, works.tolist(), speed),
        arrivals=arrivals_.copy(),
        works=works,
        outputs=np.frombuffer(outputs, dtype=np.int64).copy(),
        prompts=prompt.copy(),
        **kv,
    )


def _kv_terms(
    ids: np.ndarray,
    lengths: np.ndarray,
    prompts: np.ndarray,
    sizes: np.ndarray,
    arrivals: np.ndarray,
    seen: np.ndarray,
    engine: Engine,
    instances: int,
) -> dict[str, Any]:
    """The KV capacity fields of :class:`WorkloadBound` (module docstring, *KV capacity*): K, the
    pooled cache's hit tokens, the mean floor under that hit budget and the pooled SRPT with the
    work it leaves (ms); empty when the pools' size is unknown or the block sizes are mixed."""
    n = len(lengths)
    bs = int(sizes[0])
    if engine.kv_capacity_tokens <= 0 or bool((sizes != bs).any()):
        return {}
    cap = pooled_capacity_blocks(lengths, bs, engine, instances)
    hits = _pooled_hits(ids, lengths, prompts, sizes, arrivals, cap)
    countable = _countable(lengths, prompts, sizes)
    most = np.minimum(seen, countable)  # x(i) ≤ the oracle's capped run, whatever the cache
    floor_s = floor_sum_with_hit_budget_s(prompts, most, bs, hits.total, engine) / n
    own = prompts - bs * np.minimum(_shared_run(ids, lengths), countable)  # ℓ(i): i computes ≥ this
    speed = instances * engine.peak_tokens_s
    extra = max(0, int(prompts.sum()) - bs * hits.total - int(own.sum()))
    srpt_s = srpt_mean_s(arrivals.tolist(), own.tolist(), speed) + extra / speed / n
    return {
        "kv_capacity_blocks": cap,
        "kv_hit_tokens": bs * hits.total,
        "kv_floor_mean_ms": 1000.0 * floor_s,
        "kv_srpt_mean_ms": 1000.0 * srpt_s,
    }


def capacity_bound(
    at_rate: Callable[[float], WorkloadBound],
    engine: Engine,
    instances: int,
    ttft_p99_ms: float,
    tpot_p99_ms: float,
    start: float,
    refine: int = 8,
    max_doublings: int = 20,
    kv: bool = True,
) -> float | None:
    """The highest rate scale whose workload (``at_rate(rate)``) passes :meth:`WorkloadBound.meets`:
    doubling (or halving) from ``start`` until it flips, then ``refine`` log-space bisections; the
    highest passing probe (an upper bound up to the last bisection's resolution, which is reported
    as the bracket's upper end so the bound stays an upper bound). ``None``: nothing passes down to
    ``start`` / 2^max_doublings; ``math.inf``: everything passes up to ``start`` · 2^max_doublings
    (the search stops there: the workloads grow with the rate). ``kv``: with the KV capacity
    conditions (:meth:`WorkloadBound.meets`)."""

    def ok(r: float) -> bool:
        return at_rate(r).meets(engine, instances, ttft_p99_ms, tpot_p99_ms, kv)

    lo, hi = start, start
    if ok(start):
        for _ in range(max_doublings):
            hi = lo * 2.0
            if not ok(hi):
                break
            lo = hi
        else:
            return math.inf
    else:
        for _ in range(max_doublings):
            lo = hi / 2.0
            if ok(lo):
                break
            hi = lo
        else:
            return None
    for _ in range(refine):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return hi


def spec_engine(spec: RunSpec) -> Engine:
    """The engine limits of ``spec``'s instances (its profile, chunk budget, batch limit and KV
    pool: ``--kv-tokens`` or the profile's); computed once per process for each (profile, limits):
    a million step times."""
    engine = _engine_of(
        spec.profile,
        spec.profile_dir,
        spec.model_config,
        spec.tp,
        spec.max_num_batched_tokens,
        spec.max_num_seqs,
    )
    return replace(engine, kv_capacity_tokens=spec.kv_tokens) if spec.kv_tokens else engine


@functools.lru_cache(maxsize=8)
def _engine_of(
    profile: str | None,
    profile_dir: str | None,
    model_config: str | None,
    tp: int,
    budget: int,
    seqs: int,
) -> Engine:
    from kvroute.sim.runner import RunSpec, load_profile

    spec = RunSpec(profile=profile, profile_dir=profile_dir, model_config=model_config, tp=tp)
    loaded = load_profile(spec)
    return peak_rate(loaded.cost, budget, seqs, loaded.kv_capacity_tokens)


def spec_bound(spec: RunSpec, engine: Engine) -> WorkloadBound:
    """The bound's terms on the workload ``spec`` generates (its rate, duration and seed)."""
    from kvroute.workloads import open_workload

    stream, _ = open_workload(
        spec.trace, spec.fmt, spec.workload, spec.rate_scale, spec.duration, spec.seed, spec.skip_bad_lines
    )
    return workload_bound(stream, engine, spec.instances)


def bound_summary(
    spec_at: Callable[[float], RunSpec],
    rates: Sequence[float],
    slo: tuple[float, float] | None,
    start: float,
) -> dict[str, Any]:
    """The bound as the comparisons report it: the engine's limits; per rate in ``rates`` the lower
    bounds on mean TTFT (``ttft_mean_ms``, counting KV capacity; ``ttft_mean_any_order_ms`` without
    it, for any admission order) and the TTFT p99 floor (ms), the KV hit-rate ceiling
    (``kv_hit_rate_ceiling``; ``oracle_kv_hit_rate``: infinite caches) and the pooled cache's size;
    with ``slo`` = (TTFT p99 ms, TPOT p99 ms) the capacity bound (rate scale; ``capacity_any_order``
    without the KV capacity conditions), searched from ``start``. ``spec_at(rate)``: the run at that
    rate (only its workload and cluster are read)."""
    engine = spec_engine(spec_at(start))
    instances = spec_at(start).instances
    memo: dict[float, WorkloadBound] = {}

    def at(rate: float) -> WorkloadBound:
        if rate not in memo:
            memo[rate] = spec_bound(spec_at(rate), engine)
        return memo[rate]

    out: dict[str, Any] = {
        "engine": {
            "peak_tokens_per_s": engine.peak_tokens_s,
            "peak_decode_tokens_per_s": engine.peak_decode_s,
            "min_step_ms": engine.min_step_s * 1000.0,
            "kv_capacity_tokens": engine.kv_capacity_tokens,
        },
        "rates": [
            {
                "rate": r,
                "requests": b.requests,
                "kv_hit_rate_ceiling": b.kv_hit_rate_ceiling,
                "oracle_kv_hit_rate": b.oracle_hit_rate,
                "kv_capacity_blocks": b.kv_capacity_blocks,
                "ttft_mean_ms": b.ttft_mean_bound_ms,
                "ttft_mean_any_order_ms": b.ttft_mean_any_order_ms,
                "ttft_floor_mean_ms": b.ttft_floor_mean_ms,
                "pooled_srpt_mean_ms": b.pooled_srpt_mean_ms,
                "kv_floor_mean_ms": b.kv_floor_mean_ms,
                "kv_srpt_mean_ms": b.kv_srpt_mean_ms,
                "ttft_floor_p99_ms": b.ttft_floor_p99_ms,
            }
            for r in rates
            for b in [at(r)]
        ],
    }
    if slo is not None:
        for key, kv in (("capacity", True), ("capacity_any_order", False)):
            cap = capacity_bound(
                at, engine, instances, slo[0], slo[1], start, refine=5, max_doublings=6, kv=kv
            )
            out[key] = None if cap is None or not math.isfinite(cap) else cap
            # nothing failed up to start · 2^6: the bound is above that (reported as None, with the rate)
            out[f"{key}_above"] = start * 2.0**6 if cap is not None and not math.isfinite(cap) else None
    memo.clear()
    return out
