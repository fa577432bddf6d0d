"""EngineModel: one vLLM-v1-like instance as a clock-free state machine.

The driver owns the clock (the simulator's event loop, or the emulator's wall clock) and passes
times in seconds. The model:

- keeps an FCFS waiting queue and a running batch bounded by ``max_num_seqs``;
- schedules each step like vLLM v1: running requests first (one decode token, or the next prefill
  chunk), then waiting requests while the token budget ``max_num_batched_tokens`` and the batch
  limit allow (chunked prefill);
- admits a request with a prefix-cache lookup through its ``KVCacheManager``, which does all the
  per-request KV block accounting over the ``BlockPool`` (full blocks only; at least one prompt token
  is always computed, as in vLLM);
- preempts by recompute (the last-admitted running request goes back to the front of the queue
  and loses its KV) when a running request cannot get a block;
- asks a ``CostModel`` how long each step takes; a step's outputs happen at its end.

Speed: with ``report_tokens=False`` (the simulator) a run of pure-decode steps in which nothing
can change the batch (no prefill, nothing admissible waiting, enough free blocks, no request
finishing before the last step) is planned as one *stretch*: its step durations are summed in one
go and its outputs appear at its end. A request arriving (or aborted) mid-stretch cuts the stretch
at the first step boundary at or after that time, so the result is the same as stepping one step
at a time (tested). ``stats()`` during a stretch reports block usage as of the stretch's start.

Also with ``report_tokens=False``, the running requests that are decoding form a *cohort* that is
updated in O(1) per step instead of one request at a time (``_Cohort``): every running decoder gets
exactly one token per step, so their token counts are kept relative to a shared decode-step counter,
their next block boundaries are counted per residue of that counter, and their finishing steps sit in
a heap. A step whose schedule the cohort cannot reproduce exactly (a preemption, a decoder starved of
token budget, a chunk cut anywhere but at the end of the batch) dissolves the cohort back into
per-request state and runs the per-request code; the decoders join again after that step. Outputs,
KV events and stats are the same as without the cohort (tested against ``report_tokens=True``).

Prefill/decode disaggregation (see ``EngineRequest``): a ``remote_prefill`` request counts the prompt
tokens it lacks as external tokens read from the prefill instance at its first admission (all but the
last count as computed; the last is computed again for its logits, as vLLM does), reports only its
local hit as cached, and caches the read blocks like computed ones; a ``hold_blocks`` request keeps its blocks
referenced after it finishes until ``release`` (its transfer lease).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from kvroute.engine.kvcache import BlockPool
from kvroute.engine.kvmanager import KVCacheManager, RequestBlocks
from kvroute.engine.types import (
    CostModel,
    EngineConfig,
    EngineOutput,
    EngineRequest,
    EngineStats,
    KVEvent,
    LoadSnapshot,
    OutputKind,
    ReqId,
)


class _Seq(RequestBlocks):
    """Mutable per-request state. ``computed``: tokens in KV; ``out``: output tokens produced;
    the request's known tokens are ``prompt_len + out``; it is decoding when ``computed`` is one
    short of that, prefilling when further behind. The KV blocks it holds (``held``, ``nblocks``)
    are the ``KVCacheManager``'s record."""

    __slots__ = (
        "adm",
        "cached_tokens",
        "computed",
        "d0",
        "expect",
        "external",
        "key",
        "known",
        "lazy",
        "out",
        "stepping",
    )

    def __init__(self, req: EngineRequest) -> None:
        super().__init__(req)
        self.computed = 0
        # prompt tokens its prefix-cache lookup on arrival found cached, until its first admission
        # (then 0: ``computed`` holds the real hit); so the queued prefill a router reads counts a
        # waiting request's uncached tokens only, as a router counts the requests it sent
        self.expect = 0
        self.out = 0
        self.known = req.prompt_len  # prompt_len + out, kept in step with out
        self.cached_tokens = 0
        self.external = -1  # tokens read from a remote prefill instance (-1: not admitted yet)
        self.stepping = False  # part of the step in progress (per-request path)
        self.adm = 0  # admission number: running order is increasing ``adm``
        # cohort membership (see _Cohort): while ``lazy``, computed/out/known/nblocks are as of decode
        # step ``d0`` of the cohort's counter, and ``key`` is (computed - d0) mod block size
        self.lazy = False
        self.d0 = 0
        self.key = 0


def _pending(seq: _Seq) -> int:
    """Tokens ``seq`` still has to prefill (0 while decoding); before its first admission, net of
    the prefix-cache hit it found on arrival (``expect``)."""
    p = seq.known - seq.computed - seq.expect
    return 0 if p == 1 and seq.out else p


class _Cohort:
    """The running decoders of a ``report_tokens=False`` engine, advanced in O(1) per step.

    ``d`` counts the decode steps the cohort has completed. A member that joined when the counter
    was ``seq.d0`` has ``d - seq.d0`` more tokens computed, produced and known than its fields say
    (``leave`` writes them back). It needs a new KV block in the next step iff its computed tokens
    are a multiple of the block size, i.e. iff its ``key`` (computed at joining minus ``d0``, modulo
    the block size) equals ``-d`` modulo the block size; ``buckets`` groups the members by key.
    ``n``: members; ``kv``: their summed context (tokens in KV) now; ``fin``: heap of (the value of
    ``d`` at which a member produces its last token, its admission number, the member), with
    entries of members that left by abort skipped lazily."""

    __slots__ = ("bs", "buckets", "counts", "d", "fin", "kv", "n")

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.d = 0
        self.n = 0
        self.kv = 0
        self.buckets: dict[int, set[_Seq]] = {}
        self.counts = [0] * block_size  # len(buckets[key]) by key
        self.fin: list[tuple[int, int, _Seq]] = []

    def join(self, seq: _Seq) -> None:
        """``seq`` (running, decoding, its fields up to date, ``nblocks`` covering ``computed``)
        becomes a member."""
        d = self.d
        seq.lazy = True
        seq.d0 = d
        key = seq.key = (seq.computed - d) % self.bs
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = set()
        bucket.add(seq)
        self.counts[key] += 1
        self.n += 1
        self.kv += seq.computed
        heapq.heappush(self.fin, (d + seq.req.output_len - seq.out, seq.adm, seq))

    def leave(self, seq: _Seq, in_step: int) -> None:
        """Write ``seq``'s counters back and remove it. ``in_step`` is 1 when a step in progress
        includes it (its block for that step's token is already allocated), else 0."""
        bs = self.bs
        c0 = seq.computed
        delta = self.d - seq.d0
        c = c0 + delta
        seq.computed = c
        seq.out += delta
        seq.known += delta
        # credit the blocks the engine allocated in bulk for it (KVCacheManager.allocate)
        seq.nblocks += (c + in_step + bs - 1) // bs - (c0 + bs - 1) // bs
        seq.lazy = False
        bucket = self.buckets[seq.key]
        bucket.discard(seq)
        if not bucket:
            del self.buckets[seq.key]
        self.counts[seq.key] -= 1
        self.n -= 1
        self.kv -= c

    def needing_block(self) -> set[_Seq]:
        """The members that need one new block for the next step's token."""
        return self.buckets.get(-self.d % self.bs, _EMPTY)

    def blocks_for(self, steps: int) -> int:
        """Blocks the members need for steps 2..``steps`` of a stretch starting now (the first
        step's blocks are allocated when it is scheduled)."""
        bs = self.bs
        if steps < 2:
            return 0
        # each member crosses a block boundary once per period of bs steps; those whose first
        # crossing (step (-(key + d)) % bs, or bs) is among the first r steps of the last, partial
        # period cross once more: the keys (-d - r) % bs … (-d - 1) % bs
        periods, r = divmod(steps - 1, bs)
        total = self.n * periods
        if r:
            d = self.d
            if 4 * len(self.buckets) < r:  # few keys (large blocks, small batch): look at each
                for key, bucket in self.buckets.items():
                    if 0 < -(key + d) % bs <= r:  # first crossing within r (0 means at bs > r)
                        total += len(bucket)
            else:
                c = self.counts
                lo, hi = (-d - r) % bs, (-d - 1) % bs
                total += sum(c[lo : hi + 1]) if lo <= hi else sum(c[lo:]) + sum(c[: hi + 1])
        return total

    def most_steps(self, free: int) -> int:
        """The largest ``steps`` with ``blocks_for(steps) <= free``. Members cross block boundaries
        periodically (each once per ``bs`` steps), so whole periods are skipped and the last one walked
        in order of first crossing (members must exist)."""
        bs, d = self.bs, self.d
        periods, left = divmod(free, self.n)
        for first, count in sorted((-(key + d) % bs or bs, len(b)) for key, b in self.buckets.items()):
            if count > left:
                return periods * bs + first  # that step's token would need one block too many
            left -= count
        raise AssertionError("unreachable: left < n")

    def remaining(self) -> int:
        """Fewest tokens any member still has to produce (members must exist)."""
        fin = self.fin
        while not fin[0][2].lazy:  # left by abort
            heapq.heappop(fin)
        return fin[0][0] - self.d

    def advance(self, steps: int) -> None:
        """Every member computed ``steps`` more tokens."""
        self.d += steps
        self.kv += self.n * steps

    def pop_finished(self) -> list[_Seq]:
        """Remove and return (up to date, in admission order) the members that produced their last
        token; called at a step boundary."""
        fin, d = self.fin, self.d
        done: list[_Seq] = []
        while fin and fin[0][0] <= d:
            seq = heapq.heappop(fin)[2]
            if seq.lazy:
                self.leave(seq, 0)
                done.append(seq)
        return done

    def dissolve(self) -> None:
        """Every member leaves (at a step boundary)."""
        for bucket in list(self.buckets.values()):
            for seq in list(bucket):
                self.leave(seq, 0)
        self.fin.clear()


_EMPTY: set[_Seq] = set()


@dataclass(slots=True)
class _Step:
    """The step, or stretch of ``steps`` identical-batch decode steps, in progress.

    ``segs`` lists runs of equal-duration steps as ``(start, duration, count)``; the stretch ends at
    ``end``, which is the start time plus each step's duration added one at a time (exactly the
    float sum stepping would compute). ``work`` lists the requests stepped one at a time; with
    ``cohort`` every cohort member also takes part (one token a step)."""

    segs: list[tuple[float, float, int]]
    end: float
    steps: int
    work: list[tuple[_Seq, int]]  # (sequence, tokens computed in the first step)
    cohort: bool = False


class EngineModel:
    """One engine instance. All methods take the driver's time ``now`` in seconds where timing
    matters; none reads a clock. Mutates only itself."""

    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        if config.max_num_seqs <= 0 or config.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.config = config
        self.cost = cost
        self.kv = KVCacheManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._explicit: list[_Seq] = []  # running requests outside the cohort, in running order
        self._cohort: _Cohort | None = None if config.report_tokens else _Cohort(config.block_size)
        self._adm = 0
        self._seqs: dict[ReqId, _Seq] = {}
        self._step: _Step | None = None
        self._outputs: list[EngineOutput] = []
        self._queued_prefill = 0  # tokens still to prefill over waiting + running
        self._preemptions = 0
        self._held: dict[ReqId, _Seq] = {}  # finished hold_blocks requests, blocks still referenced
        self._held_blocks = 0
        self._ext_query = 0  # prompt tokens of remote-prefill requests at first admission
        self._ext_hit = 0  # of those, tokens read from the remote instance
        self.version = 0  # changes whenever ``stats()`` may have (a cheap staleness test for copies)

    # -- driver interface ---------------------------------------------------------------------
    def add_request(self, req: EngineRequest, now: float) -> None:
        """Queue a request arriving at ``now``. It joins the next step (now, if idle)."""
        if req.req_id in self._seqs or req.req_id in self._held:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        if req.prompt_len <= 0 or req.output_len <= 0:
            raise ValueError("prompt_len and output_len must be positive")
        if len(req.block_hashes) > req.prompt_len // self.config.block_size:
            raise ValueError("more block hashes than full prompt blocks")
        seq = _Seq(req)
        self.version += 1
        bs = self.config.block_size
        total = req.prompt_len + req.output_len
        if total > self.config.max_model_len or -(-total // bs) > self.config.num_kv_blocks:
            # can never run here (vLLM rejects it up front): report instead of queueing forever
            self._outputs.append(EngineOutput(OutputKind.ABORTED, req.req_id, now))
            return
        self._seqs[req.req_id] = seq
        self._waiting.append(seq)
        if not req.remote_prefill:
            seq.expect = self.kv.lookup(seq, seq.known)[0] * bs
        self._queued_prefill += _pending(seq)
        if self._step is None:
            self._start_step(now)
        else:
            self._cut_stretch(now)

    def abort(self, req_id: ReqId, now: float) -> bool:
        """Remove a request (client gone) and free its blocks. False if unknown or finished."""
        seq = self._seqs.get(req_id)
        if seq is None:
            return False
        self.version += 1
        self._cut_stretch(now)
        if seq.lazy:
            assert self._cohort is not None
            step = self._step
            self._cohort.leave(seq, 1 if step is not None and step.cohort else 0)
            self._running.remove(seq)
        elif seq in self._running:
            self._running.remove(seq)
            self._explicit.remove(seq)
        else:
            self._waiting.remove(seq)
        self._drop(seq)
        self._outputs.append(EngineOutput(OutputKind.ABORTED, req_id, now, seq.out, seq.cached_tokens))
        return True

    def release(self, req_id: ReqId, now: float) -> bool:
        """Free the blocks a finished ``hold_blocks`` request kept (its reader is done, or its lease
        expired). False if ``req_id`` holds nothing."""
        seq = self._held.pop(req_id, None)
        if seq is None:
            return False
        self.version += 1
        self._cut_stretch(now)
        self._held_blocks -= seq.nblocks
        self.kv.free(seq)
        if self._step is None and (self._waiting or self._running):
            self._start_step(now)  # freed blocks may admit a waiting request
        return True

    def held(self, req_id: ReqId) -> int:
        """Blocks a finished ``hold_blocks`` request still holds (0: none, or unknown)."""
        seq = self._held.get(req_id)
        return seq.nblocks if seq is not None else 0

    def local_hit_tokens(self, block_hashes: tuple[int, ...], prompt_len: int) -> int:
        """Tokens of a prompt this engine's prefix cache holds now (full blocks, at least one token
        left to compute, as at admission). No mutation."""
        if not (self.config.enable_prefix_caching and block_hashes):
            return 0
        hit, _ = self.kv.pool.count_hits(block_hashes, (prompt_len - 1) // self.config.block_size)
        return hit * self.config.block_size

    def next_time(self) -> float | None:
        """When the step in progress ends (the next time ``advance`` does something), or None
        when the engine is idle."""
        return self._step.end if self._step is not None else None

    def advance(self, now: float) -> list[EngineOutput]:
        """Complete every step ending at or before ``now`` (starting the next one back to back)
        and return the outputs produced, in time order."""
        while self._step is not None and self._step.end <= now:
            step = self._step
            self._step = None
            self.version += 1
            self._complete(step)
            if self._waiting or self._running:
                self._start_step(step.end)
        out, self._outputs = self._outputs, []
        return out

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: drop every cached block now; refused (False) while a
        running request references one. Its ``AllBlocksCleared`` event is taken with the other KV
        events of the next :meth:`take_events` (the emulator's next step, as vLLM publishes it)."""
        return self.kv.pool.clear()

    def take_events(self) -> list[KVEvent]:
        """KV events recorded since the last call, oldest first."""
        return self.kv.take_events()

    @property
    def pool(self) -> BlockPool:
        """The KV block pool (for inspection; only the ``KVCacheManager`` mutates it)."""
        return self.kv.pool

    def stats(self) -> EngineStats:
        kv = self.kv
        used = kv.used_blocks
        return EngineStats(
            running=len(self._running),
            waiting=len(self._waiting),
            num_kv_blocks=kv.num_blocks,
            used_blocks=used,
            cached_blocks=kv.cached_blocks,
            kv_usage=used / kv.num_blocks,
            queued_prefill_tokens=self._queued_prefill,
            prefix_query_tokens=kv.query_tokens,
            prefix_hit_tokens=kv.hit_tokens,
            preemptions=self._preemptions,
            external_query_tokens=self._ext_query,
            external_hit_tokens=self._ext_hit,
            held_requests=len(self._held),
            held_blocks=self._held_blocks,
        )

    def load(self) -> LoadSnapshot:
        """What a router copies of ``stats()``, cheaply (a named tuple, in ``InstanceView``'s
        names: ``kv_capacity_blocks`` is the pool size, ``decode_blocks`` the blocks in use)."""
        pool = self.kv.pool
        used = pool.private + pool.referenced
        return LoadSnapshot(
            len(self._running),
            len(self._waiting),
            self._queued_prefill,
            used / pool.num_blocks,
            pool.num_blocks,
            used,
        )

    def in_flight(self) -> list[tuple[ReqId, int]]:
        """(request id, prefill tokens it has left; 0 once decoding) of each request :meth:`load`
        counts (waiting, then running), at the same instant: a router matches its own requests
        against this to know which ones a load snapshot counts."""
        out = [(s.req.req_id, _pending(s)) for s in self._waiting]
        out.extend((s.req.req_id, 0 if s.lazy else _pending(s)) for s in self._running)
        return out

    @property
    def idle(self) -> bool:
        return self._step is None and not self._waiting and not self._running

    def check(self) -> None:
        """Assert the model's invariants (for tests): the pool's, the running batch in admission
        order, the requests outside the cohort listed in that order, the cohort's counters."""
        self.kv.check()
        running = self._running
        assert [s.adm for s in running] == sorted(s.adm for s in running)
        assert self._explicit == [s for s in running if not s.lazy]
        cohort = self._cohort
        members = [s for s in running if s.lazy]
        if cohort is None:
            assert not members
            return
        assert cohort.n == len(members) == sum(len(b) for b in cohort.buckets.values())
        assert cohort.counts == [len(cohort.buckets.get(k, ())) for k in range(cohort.bs)]
        assert cohort.kv == sum(s.computed + cohort.d - s.d0 for s in members)
        bs = cohort.bs
        for s in members:
            assert s in cohort.buckets[s.key] and s.key == (s.computed - s.d0) % bs
            assert s.nblocks == -(-s.computed // bs)  # blocks cover the tokens computed at joining
            assert s.out + cohort.d - s.d0 < s.req.output_len

    # -- scheduling ---------------------------------------------------------------------------
    def _start_step(self, now: float) -> None:
        cohort = self._cohort
        scheduled = self._schedule_cohort() if cohort is not None else None
        if scheduled is None:
            if cohort is not None and cohort.n:
                cohort.dissolve()
                self._explicit = list(self._running)
            work, preempted = self._schedule(now)
            with_cohort = False
        else:
            work, preempted, with_cohort = scheduled, False, True
        prefill: list[tuple[int, int]] = []
        num_decode = 0
        decode_kv = 0
        for seq, n in work:
            computed = seq.computed
            if n == 1 and seq.out and seq.known - computed == 1:
                num_decode += 1
                decode_kv += computed
            else:
                prefill.append((n, computed))
        if with_cohort:
            assert cohort is not None
            num_decode += cohort.n
            decode_kv += cohort.kv
        if not work and not num_decode:
            return  # nothing schedulable (cannot happen with a consistent pool; defensive)
        d = self.cost.step_time(prefill, num_decode, decode_kv)
        step = _Step([(now, d, 1)], now + d, 1, work, with_cohort)
        if not prefill and not preempted and cohort is not None:
            self._plan_stretch(step, num_decode, decode_kv)
        self._step = step

    def _schedule_cohort(self) -> list[tuple[_Seq, int]] | None:
        """The next step's schedule with the cohort taking part: the requests outside it (and
        admitted ones) with their tokens, blocks allocated; every member decodes one token. None
        (and nothing changed) when this would differ from ``_schedule``: a member starved of
        budget, a chunk cut short anywhere but at the end of the running batch, or too few blocks
        (a preemption)."""
        cohort = self._cohort
        assert cohort is not None
        kv, bs = self.kv, self.config.block_size
        budget = self.config.max_num_batched_tokens - cohort.n
        if budget < 0:
            return None
        running = self._running
        explicit = self._explicit
        work: list[tuple[_Seq, int]] = []
        needs: list[int] = []
        members = cohort.needing_block() if cohort.n else _EMPTY
        total = len(members)
        for seq in explicit:
            computed = seq.computed
            n = seq.known - computed
            if n > budget:
                if budget <= 0 or seq is not running[-1]:
                    return None  # vLLM's order would cut (or skip) a request the cohort cannot
                n = budget
            need = (computed + n + bs - 1) // bs - seq.nblocks
            if need > 0:
                total += need
            work.append((seq, n))
            needs.append(need)
            budget -= n
        if total > kv.free_blocks:
            if total > kv.available_blocks:
                return None  # a preemption: the per-request path handles it
            # evictions: allocate one request at a time in running order, as vLLM (one event each)
            if members:
                order = sorted(
                    [(s.adm, 1) for s in members]
                    + [(s.adm, k) for (s, _), k in zip(work, needs, strict=True) if k > 0]
                )
                kv.allocate_each([k for _, k in order])
            else:  # ``explicit`` is in running order already
                kv.allocate_each([k for k in needs if k > 0])
        elif total:
            kv.allocate(total)
        for (seq, _), need in zip(work, needs, strict=True):
            if need > 0:
                kv.credit(seq, need)
            seq.stepping = True
        self._admit(work, budget)
        return work

    def _schedule(self, now: float) -> tuple[list[tuple[_Seq, int]], bool]:
        """Pick this step's work one request at a time: running first, then waiting (vLLM v1
        order). With a cohort, only when it is empty."""
        allocate_slots = self.kv.allocate_slots
        budget = self.config.max_num_batched_tokens
        work: list[tuple[_Seq, int]] = []
        running = self._running
        preempted = False
        i = 0
        append = work.append
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.computed
            n = seq.known - computed
            if n > budget:
                n = budget
            lost = False
            while not allocate_slots(seq, computed + n):
                victim = running.pop()
                self._preempt(victim, now)
                preempted = True
                if victim is seq:
                    lost = True
                    break
            if lost:
                break
            seq.stepping = True
            append((seq, n))
            budget -= n
            i += 1
        if preempted:
            return work, True
        self._admit(work, budget)
        return work, False

    def _admit(self, work: list[tuple[_Seq, int]], budget: int) -> None:
        """Admit waiting requests into the running batch while ``budget`` tokens and the batch
        limit allow, with a prefix-cache lookup; append them to ``work``."""
        kv, bs = self.kv, self.config.block_size
        max_num_seqs = self.config.max_num_seqs
        running = self._running
        waiting = self._waiting
        while waiting and budget > 0 and len(running) < max_num_seqs:
            seq = waiting[0]
            hit, hit_evictable = kv.lookup(seq, seq.known)
            local = computed = hit * bs
            external = 0
            if seq.external < 0 and seq.req.remote_prefill:  # first admission: read what it lacks
                # all of it comes from the remote instance (vLLM counts it as external), and the last
                # prompt token is computed again here for its logits
                external = seq.known - computed
                computed = seq.known - 1
            n = min(seq.known - computed, budget)
            if not kv.admit(seq, hit, hit_evictable, computed + n, seq.out == 0):
                break
            waiting.popleft()
            if seq.external < 0:  # first admission: a preempted request keeps its first hit (as vLLM)
                seq.external = external
                seq.cached_tokens = local  # vLLM reports the local hit (the remote part is external)
                if seq.req.remote_prefill:
                    self._ext_query += seq.req.prompt_len
                    self._ext_hit += external
            self._queued_prefill -= _pending(seq)
            seq.expect = 0
            seq.computed = computed
            self._queued_prefill += _pending(seq)
            seq.stepping = True
            self._adm += 1
            seq.adm = self._adm
            running.append(seq)
            self._explicit.append(seq)
            work.append((seq, n))
            budget -= n

    def _plan_stretch(self, step: _Step, num_decode: int, decode_kv: int) -> None:
        """Extend a pure-decode step into a stretch of identical-batch steps (see module doc)."""
        if self._waiting and self._admissible():
            return
        bs = self.config.block_size
        work = step.work
        cohort = self._cohort if step.cohort else None
        if cohort is not None and not cohort.n:
            cohort = None
        k = min([seq.req.output_len - seq.out for seq, _ in work]) if work else 1 << 62
        if cohort is not None:
            r = cohort.remaining()
            if r < k:
                k = r
        if k < 2:
            return
        free = self.kv.free_blocks

        def blocks_for(steps: int) -> int:  # blocks needed beyond those held, after `steps` steps
            n = sum(max(-(-(seq.computed + steps) // bs) - seq.nblocks, 0) for seq, _ in work)
            return n + cohort.blocks_for(steps) if cohort is not None else n

        if not work and cohort is not None:
            if cohort.n * ((k + bs - 2) // bs) > free:  # else even every member crossing fits
                k = min(k, cohort.most_steps(free))
        elif blocks_for(k) > free:
            lo, hi = 1, k  # largest steps with blocks_for(steps) <= free; blocks_for(1) == 0
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if blocks_for(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k < 2:
            return
        segment = getattr(self.cost, "decode_segment", None)
        step_time = self.cost.step_time
        segs = step.segs
        t = step.end
        j = 1
        while j < k:
            kv = decode_kv + j * num_decode
            if segment is None:
                d, m = step_time((), num_decode, kv), 1
            else:
                d, m = segment(num_decode, kv)
                m = min(m, k - j)
            t0 = t
            for _ in range(m):
                t += d
            segs.append((t0, d, m))
            j += m
        step.end = t
        step.steps = k

    def _admissible(self) -> bool:
        """Whether the head of the waiting queue could be admitted in the next step."""
        if len(self._running) >= self.config.max_num_seqs:
            return False
        budget = self.config.max_num_batched_tokens - len(self._running)
        if budget <= 0:
            return False
        seq, kv = self._waiting[0], self.kv
        hit, hit_evictable = kv.lookup(seq, seq.known)
        computed = hit * self.config.block_size
        return kv.fits(hit, hit_evictable, computed + min(seq.known - computed, budget))

    def _cut_stretch(self, now: float) -> None:
        """Shorten the stretch in progress so that it ends at the first step boundary >= now."""
        step = self._step
        if step is None or step.steps == 1 or now >= step.end:
            return
        steps = 0
        for s, (t0, d, m) in enumerate(step.segs):
            t, j = t0, 0
            while j < m and (t < now or (s == 0 and j == 0)):
                t += d
                j += 1
            steps += j
            if j < m or t >= now:
                del step.segs[s + 1 :]
                step.segs[s] = (t0, d, j)
                step.end = t
                step.steps = steps
                return

    # -- completion ---------------------------------------------------------------------------
    def _complete(self, step: _Step) -> None:
        steps = step.steps
        t = step.end
        kv = self.kv
        outputs = self._outputs
        report = self.config.report_tokens
        cohort = self._cohort
        if step.cohort and cohort is not None and cohort.n:
            if steps > 1:  # blocks for the stretch's later steps (never evicting: see _plan_stretch)
                kv.allocate(cohort.blocks_for(steps))
            cohort.advance(steps)
        finished: list[_Seq] = []
        decoding: list[_Seq] = []  # stepped requests now decoding (they join the cohort)
        for seq, n in step.work:
            if not seq.stepping:
                continue  # aborted or preempted meanwhile
            seq.stepping = False
            if steps > 1:  # a decode stretch: allocate the blocks its later steps used
                computed = seq.computed + steps
                kv.allocate_slots(seq, computed)
                seq.computed = computed
                seq.out += steps
                seq.known += steps
                if seq.out >= seq.req.output_len:
                    finished.append(seq)
                else:
                    decoding.append(seq)
                continue
            if seq.out and seq.known - seq.computed == 1:  # one decode step: the hot path
                seq.computed += 1
            else:  # a prefill chunk (of the prompt, or of a recompute after preemption)
                self._prefill_done(seq, n)
                if seq.computed < seq.known:
                    continue  # prompt not complete yet
            seq.out += 1
            seq.known += 1
            if seq.out == 1:
                outputs.append(
                    EngineOutput(
                        OutputKind.FIRST_TOKEN, seq.req.req_id, t, 1, seq.cached_tokens, max(seq.external, 0)
                    )
                )
            elif report:
                outputs.append(EngineOutput(OutputKind.TOKEN, seq.req.req_id, t, seq.out, seq.cached_tokens))
            if seq.out >= seq.req.output_len:
                finished.append(seq)
            else:
                decoding.append(seq)
        explicit = self._explicit
        if finished:
            for seq in finished:
                explicit.remove(seq)
        if step.cohort and cohort is not None and cohort.fin:
            done = cohort.pop_finished()
            if done:
                finished = sorted(finished + done, key=_by_adm) if finished else done
        for seq in finished:
            self._running.remove(seq)
            if seq.req.hold_blocks:
                self._hold(seq)
            else:
                self._drop(seq)
            outputs.append(
                EngineOutput(
                    OutputKind.FINISHED, seq.req.req_id, t, seq.out, seq.cached_tokens, max(seq.external, 0)
                )
            )
        if cohort is not None:
            for seq in decoding:
                explicit.remove(seq)
                cohort.join(seq)

    def _prefill_done(self, seq: _Seq, n: int) -> None:
        """``seq`` computed ``n`` more prefill tokens: update the queued-prefill counter and cache
        the prompt blocks it has now filled."""
        self._queued_prefill -= _pending(seq)
        seq.computed += n
        self._queued_prefill += _pending(seq)
        self.kv.cache_blocks(seq, seq.computed)

    def _preempt(self, seq: _Seq, now: float) -> None:
        """Recompute preemption: free everything, requeue at the front; the prompt and the output
        so far must be prefilled again. ``seq`` was just taken off the end of the running batch."""
        self._preemptions += 1
        explicit = self._explicit
        if explicit and explicit[-1] is seq:
            explicit.pop()
        else:
            explicit.remove(seq)
        self._queued_prefill -= _pending(seq)
        self.kv.free(seq)
        seq.computed = 0
        seq.stepping = False
        self._queued_prefill += _pending(seq)
        self._waiting.appendleft(seq)
        self._outputs.append(
            EngineOutput(OutputKind.PREEMPTED, seq.req.req_id, now, seq.out, seq.cached_tokens)
        )

    def _hold(self, seq: _Seq) -> None:
        """A finished ``hold_blocks`` request: forget it as a request, keep its blocks referenced."""
        self._queued_prefill -= _pending(seq)
        seq.stepping = False
        del self._seqs[seq.req.req_id]
        self._held[seq.req.req_id] = seq
        self._held_blocks += seq.nblocks

    def _drop(self, seq: _Seq) -> None:
        """Forget a finished or aborted request and free its blocks."""
        self._queued_prefill -= _pending(seq)
        self.kv.free(seq)
        seq.stepping = False
        del self._seqs[seq.req.req_id]


_by_adm = attrgetter("adm")
