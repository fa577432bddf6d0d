"""The simulated cluster: N engine models behind one router that uses a registry policy.

The router here is the simulator's twin of the live router (``kvroute.server``):

- **KV view**: a prefix index fed by the engines' KV events, delivered ``event_delay`` seconds after
  the step that produced them (``kv_view="exact"``), or, with ``kv_view="approx"``, fed by routing
  history (the chosen instance is assumed to hold the prompt's blocks, with the engine's capacity
  and LRU eviction).
- **Load view**: engine-reported state (running, waiting, KV usage, queued prefill tokens) copied
  when the router's copy is older than ``scrape_interval`` seconds (0: always current), plus the
  router's optimistic counters: a request routed since that copy counts as waiting and its new
  prefill tokens as queued, until its first token or the next copy (which then includes it).

Requests reach the chosen engine at once; engines are woken at their ``next_time()``.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvroute.engine.memo import DecodeMemo
from kvroute.engine.model import EngineModel
from kvroute.engine.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CostModel,
    EngineConfig,
    EngineRequest,
    KVEvent,
    OutputKind,
)
from kvroute.errors import UserError
from kvroute.features.timeline import TtftTimeline
from kvroute.index import ApproxPrefixIndex, PrefixIndex
from kvroute.metrics import LatencyRecorder
from kvroute.policies.base import Policy
from kvroute.routing.guarded import Guarded
from kvroute.sim.loop import PRIO_ARRIVAL, PRIO_DELIVERY, PRIO_ENGINE, EventLoop
from kvroute.views import InstanceView, RequestView
from kvroute.workloads.request import Request

KV_VIEWS = ("exact", "approx")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's settings.

    - ``kv_capacity_tokens``: KV pool of each instance in tokens (blocks = this // block size).
    - ``scrape_interval``: seconds between the router's copies of engine load (0: always current).
    - ``event_delay``: seconds from a KV event to the router's index seeing it.
    - ``max_sim_seconds``: stop (counting the rest as unfinished) at this simulated time.
    """

    instances: int
    policy: str
    kv_capacity_tokens: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_view: str = "exact"
    scrape_interval: float = 0.05
    event_delay: float = 0.002
    seed: int = 0
    max_sim_seconds: float | None = None
    # Features (kvroute.features): ``scale_out`` = ((time s, new instances), ...) joins during the run;
    # the last ``spot_instances`` initial instances carry the tag "spot".
    scale_out: tuple[tuple[float, int], ...] = ()
    spot_instances: int = 0
    by_class: bool = False  # report latencies per request class (``by_class`` in the output)

    def check(self) -> None:
        """Raise UserError for nonsense settings."""
        if self.instances <= 0:
            raise UserError(f"--instances must be at least 1 (got {self.instances})")
        if self.kv_capacity_tokens <= 0:
            raise UserError("KV capacity must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise UserError("max-num-seqs and max-num-batched-tokens must be positive")
        if self.kv_view not in KV_VIEWS:
            raise UserError(f"unknown KV view {self.kv_view!r}; valid: {', '.join(KV_VIEWS)}")
        if not (0 <= self.scrape_interval < math.inf and 0 <= self.event_delay < math.inf):
            raise UserError("scrape interval and event delay must be finite and >= 0")
        if any(t < 0 or n < 1 for t, n in self.scale_out) or not 0 <= self.spot_instances <= self.instances:
            raise UserError("--scale-out needs T >= 0 and N >= 1; --spot-instances must be in [0, instances]")


@dataclass(slots=True)
class _Inst:
    """The router's per-instance state and the engine behind it."""

    engine: EngineModel
    snap: tuple[int, int, int, float, int, int]  # the engine's load() when copied
    snap_time: float
    snap_version: int = -1  # the engine's ``version`` when ``snap`` was copied
    opt: dict[int, int] = field(default_factory=dict)  # req_id -> new prefill tokens (optimistic)
    opt_tokens: int = 0
    wake: float | None = None  # time of the scheduled wake-up (None: none pending)
    view: InstanceView | None = None  # cached view; None when stale
    tags: frozenset[str] = frozenset()


@dataclass(slots=True)
class _Live:
    arrival: float
    prompt_len: int
    output_len: int
    instance: int
    first: float = -1.0
    cached: int = 0
    req_class: str = "default"


class ClusterSim:
    """Runs one workload through a cluster. Build, then ``run(workload)``; mutates only itself."""

    def __init__(self, config: SimConfig, policy: Policy, cost: CostModel) -> None:
        config.check()
        self.config = config
        self.policy = policy
        self.cost = DecodeMemo(cost)
        self.loop = EventLoop()
        self.recorder = LatencyRecorder()
        self.rng = random.Random(config.seed)
        self._insts: list[_Inst] = []
        self._block_size = 0
        self._index: PrefixIndex | ApproxPrefixIndex | None = None
        self._live: dict[int, _Live] = {}
        self.requests = 0
        self.rejected = 0
        self.preemptions = 0
        # features: the Guarded wrapper (if the policy is one), preload requests in flight, per-class
        # latencies, quota rejections, TTFT by arrival (with scale-out events)
        self.guard = policy if isinstance(policy, Guarded) else None
        self._preload: set[int | str] = set()
        self._by_class: dict[str, LatencyRecorder] = {}
        self.quota_rejected = 0
        self.timeline = TtftTimeline() if config.scale_out else None
        # routing views as of the last full pass; ``_oldest_snap``: the oldest load copy then (no
        # copy is due before ``_oldest_snap + scrape_interval``); ``_dirty``: views to rebuild
        self._views: list[InstanceView] = []
        self._oldest_snap = -math.inf
        self._dirty: set[int] = set()

    # -- set-up ---------------------------------------------------------------------------------
    def _build(self, block_size: int) -> None:
        cfg = self.config
        blocks = cfg.kv_capacity_tokens // block_size
        if blocks <= 0:
            raise UserError(f"KV capacity {cfg.kv_capacity_tokens} tokens is less than one block")
        ecfg = EngineConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_kv_blocks=blocks,
            block_size=block_size,
        )
        self._block_size = block_size
        for k in range(cfg.instances):
            eng = EngineModel(ecfg, self.cost)
            spot = k >= cfg.instances - cfg.spot_instances
            self._insts.append(_Inst(eng, eng.load(), 0.0, tags=frozenset({"spot"}) if spot else frozenset()))
        self._index = PrefixIndex() if cfg.kv_view == "exact" else ApproxPrefixIndex(blocks)
        self._ecfg = ecfg
        for t, n in cfg.scale_out:
            self.loop.schedule(max(t, self.loop.now), PRIO_ARRIVAL, self._join, n)

    # -- run --------------------------------------------------------------------------------------
    def run(
        self, workload: Iterator[Request], progress: Callable[[float, int, int], None] | None = None
    ) -> dict[str, Any]:
        """Simulate until every request finished (or ``max_sim_seconds``); returns the summary dict
        of the command-line contract. ``progress(sim_time, routed, finished)`` is called now and then."""
        wall0 = time.perf_counter()
        it = iter(workload)
        first = next(it, None)
        if first is None:
            raise UserError("the workload is empty")
        self._build(first.block_size)
        self._next_arrival(first, it)
        until = self.config.max_sim_seconds
        loop = self.loop
        if progress is None:
            loop.run_until(until)
        else:
            step = 30.0
            t = step
            while len(loop) and (until is None or t - step < until):
                loop.run_until(t if until is None else min(t, until))
                progress(loop.now, self.requests, self.recorder.finished)
                t += step
        out = {
            "policy": self.policy.name,
            "instances": len(self._insts),
            "requests": self.requests,
            "unfinished": self.requests - self.recorder.finished,
            **self.recorder.summary(),
            "sim_seconds": loop.now,
            "wall_seconds": time.perf_counter() - wall0,
            "rejected": self.rejected,
            "preemptions": sum(i.engine.stats().preemptions for i in self._insts),
        }
        self._feature_output(out)
        return out

    def _feature_output(self, out: dict[str, Any]) -> None:
        """Feature counters, per-class latencies (several classes), TTFT around scale-out events."""
        if self.guard is not None:
            out["features"] = self.guard.summary()
            out["quota_rejected"] = self.quota_rejected
        if len(self._by_class) > 1:
            out["by_class"] = {
                c: r.summary() | {"requests": r.finished} for c, r in sorted(self._by_class.items())
            }
        if self.timeline is not None:
            out["scale_out"] = [list(e) for e in self.config.scale_out]
            out["ttft_timeline"] = self.timeline.buckets()

    def _join(self, n: int) -> None:
        """``n`` new instances join now (scale-out); with cold start they warm up and get preloads."""
        now = self.loop.now
        for _ in range(n):
            eng = EngineModel(self._ecfg, self.cost)
            self._insts.append(_Inst(eng, eng.load(), now))
            self._reset_instance(len(self._insts) - 1, now)

    def _reset_instance(self, i: int, now: float) -> None:
        """Instance ``i`` joined or lost its cache: tell the guard, send it the preload requests."""
        if self.guard is None:
            return
        bs = self._block_size
        prefixes = self.guard.instance_reset(i, now)
        for k, p in enumerate(prefixes):
            rid = f"preload-{i}-{now:.3f}-{k}"
            self._preload.add(rid)
            if isinstance(self._index, ApproxPrefixIndex):
                self._index.assign(i, p.chain, now)
            self._insts[i].engine.add_request(EngineRequest(rid, len(p.chain) * bs, 1, p.chain), now)
        if prefixes:
            self._after_engine(i, now)

    def _next_arrival(self, req: Request, it: Iterator[Request]) -> None:
        self.loop.schedule(max(req.arrival, self.loop.now), PRIO_ARRIVAL, self._arrive, req, it)

    def _arrive(self, req: Request, it: Iterator[Request]) -> None:
        if req.block_size != self._block_size:
            raise UserError(f"request {req.req_id}: block size {req.block_size} != {self._block_size}")
        self.requests += 1
        self._route(req)
        nxt = next(it, None)
        if nxt is not None:
            self._next_arrival(nxt, it)

    # -- routing ----------------------------------------------------------------------------------
    def _all_views(self, now: float) -> list[InstanceView]:
        """One view per instance at ``now`` (``_view`` of each, skipped while no copy is due)."""
        insts = self._insts
        interval = self.config.scrape_interval
        views = self._views
        if interval and now - self._oldest_snap < interval and len(views) == len(insts):
            for i in self._dirty:
                views[i] = self._view(i, insts[i], now)
        else:
            views = self._views = [self._view(i, inst, now) for i, inst in enumerate(insts)]
            self._oldest_snap = min(inst.snap_time for inst in insts)
        self._dirty.clear()
        return list(views)

    def _view(self, i: int, inst: _Inst, now: float) -> InstanceView:
        interval = self.config.scrape_interval
        if now - inst.snap_time >= interval or interval == 0:
            eng = inst.engine
            if eng.version != inst.snap_version:  # else the copy would be the same
                inst.snap = eng.load()
                inst.snap_version = eng.version
                inst.view = None
            inst.snap_time = now
            if inst.opt:
                inst.opt.clear()
                inst.opt_tokens = 0
                inst.view = None
        view = inst.view
        if view is None:
            running, waiting, queued, kv_usage, blocks, used = inst.snap
            view = InstanceView(
                index=i,
                running=running,
                waiting=waiting + len(inst.opt),
                queued_prefill_tokens=queued + inst.opt_tokens,
                kv_usage=kv_usage,
                kv_capacity_blocks=blocks,
                decode_blocks=used,
                tags=inst.tags,
            )
            inst.view = view
        return view

    def _route(self, req: Request) -> None:
        now = self.loop.now
        insts = self._insts
        assert self._index is not None
        bs = self._block_size
        matched = self._index.match(req.block_ids, len(insts))
        prompt = req.prompt_len
        cached = tuple([m * bs if m * bs < prompt else prompt for m in matched])
        guard = self.guard
        key = 0
        if guard is not None:
            if guard.quota_wait(req.user, prompt + req.output_len, now):
                self.quota_rejected += 1
                return
            key = guard.note(req.block_ids, bs, now)
        views = self._all_views(now)
        rv = RequestView(
            prompt_tokens=prompt,
            cached_tokens=cached,
            num_blocks=len(req.block_ids),
            block_size=bs,
            max_tokens=req.output_len,
            user=req.user,
            req_class=req.req_class,
            prefix_key=key,
        )
        choice = (guard.decide(rv, views, now) if guard is not None else self.policy.choose(rv, views)).choice
        inst = insts[choice]
        new_tokens = prompt - cached[choice]
        inst.opt[req.req_id] = new_tokens
        inst.opt_tokens += new_tokens
        inst.view = None
        self._dirty.add(choice)
        if isinstance(self._index, ApproxPrefixIndex):
            self._index.assign(choice, req.block_ids, now)
        self._live[req.req_id] = _Live(now, prompt, req.output_len, choice, req_class=req.req_class)
        inst.engine.add_request(EngineRequest(req.req_id, prompt, req.output_len, req.block_ids), now)
        self._after_engine(choice, now)

    # -- engines ----------------------------------------------------------------------------------
    def _after_engine(self, i: int, now: float) -> None:
        """Handle what engine ``i`` produced and (re)schedule its wake-up."""
        inst = self._insts[i]
        eng = inst.engine
        outs = eng.advance(now)
        if outs:
            self._outputs(i, inst, outs)
        events = eng.take_events()
        if events and self.config.kv_view == "exact":
            self.loop.schedule(now + self.config.event_delay, PRIO_DELIVERY, self._deliver, i, events)
        nt = eng.next_time()
        if nt is not None and nt != inst.wake:
            inst.wake = nt
            self.loop.schedule(nt, PRIO_ENGINE, self._wake, i, nt)
        elif nt is None:
            inst.wake = None

    def _wake(self, i: int, t: float) -> None:
        inst = self._insts[i]
        if inst.wake != t:
            return  # superseded (the step in progress was cut short by an arrival)
        inst.wake = None
        self._after_engine(i, t)

    def _outputs(self, i: int, inst: _Inst, outs: list) -> None:
        live = self._live
        preload = self._preload
        for o in outs:
            kind = o.kind
            if preload and o.req_id in preload:  # cold-start preload requests are not workload requests
                if kind is OutputKind.FINISHED or kind is OutputKind.ABORTED:
                    preload.discard(o.req_id)
                continue
            if kind is OutputKind.FIRST_TOKEN:
                rec = live[o.req_id]
                rec.first = o.time
                rec.cached = o.num_cached_tokens
                tokens = inst.opt.pop(o.req_id, None)
                if tokens is not None:
                    inst.opt_tokens -= tokens
                    inst.view = None
                    self._dirty.add(i)
            if kind is OutputKind.FINISHED:
                rec = live.pop(o.req_id)
                self.recorder.add(rec.arrival, rec.first, o.time, rec.prompt_len, rec.cached, rec.output_len)
                if self.config.by_class:
                    by = self._by_class.get(rec.req_class)
                    if by is None:
                        by = self._by_class[rec.req_class] = LatencyRecorder()
                    by.add(rec.arrival, rec.first, o.time, rec.prompt_len, rec.cached, rec.output_len)
                if self.timeline is not None:
                    self.timeline.add(rec.arrival, rec.first - rec.arrival)
            elif kind is OutputKind.ABORTED:
                live.pop(o.req_id, None)
                tokens = inst.opt.pop(o.req_id, None)
                if tokens is not None:
                    inst.opt_tokens -= tokens
                    inst.view = None
                    self._dirty.add(i)
                self.rejected += 1

    def _deliver(self, i: int, events: list[KVEvent]) -> None:
        index = self._index
        assert isinstance(index, PrefixIndex)
        for ev in events:
            if isinstance(ev, BlockStored):
                index.store(i, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                index.remove(i, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                index.clear(i)
                self._reset_instance(i, self.loop.now)  # cold start: warming again, preloads
