"""The simulated cluster: N engine models behind one router that uses a registry policy.

The router here is the simulator's twin of the live router (``kvroute.server``):

- **Decisions**: the routing core (:class:`~kvroute.routing.core.RoutingCore`), the same object the
  live router calls; this module only gathers views and carries decisions out.
- **KV view**: the router's :class:`~kvroute.routing.kvview.KVView`, fed by the engines' KV events
  delivered ``event_delay`` seconds after the step that produced them (``kv_view="exact"``), or, with
  ``kv_view="approx"``, by routing history (the chosen instance is assumed to hold the prompt's blocks,
  LRU capacity = the engine's pool) corrected from each finished request's cached tokens, exactly as
  the live router does from ``usage.prompt_tokens_details.cached_tokens``.
- **Load view**: engine-reported state (running, waiting, KV usage, queued prefill tokens, blocks in
  use) copied when the router's copy is older than ``scrape_interval`` seconds (0: always current),
  plus the router's optimistic counters: a request routed since that copy counts as waiting, its new
  prefill tokens as queued and its prompt's blocks as held (the decode term), until its first token
  or the next copy (which then includes it).

  ``decode_blocks`` is therefore the engine's blocks in use at the copy plus the blocks of the
  requests routed since it: the definition of :attr:`~kvroute.views.InstanceView.decode_blocks`,
  which the live router (:mod:`kvroute.server.state.backends`) follows with its scrapes in place of
  the copies, at the same interval by default (0.05 s). What differs live: a scrape takes time where
  a copy here is instantaneous (a request routed while a scrape is in flight counts until the next
  one), a request's first byte reaches the router a network hop after the engine's first token, and
  without a fresh scrape the live router counts the blocks of all its requests in flight. The
  optimistic blocks matter: without them (a request routed since the copy adding no blocks until the
  next copy) ``kvroute sim`` gives other results on most of the preset's cells
  (``docs/results/policy-findings.md``, "What is not shown here").

Requests reach the chosen engine at once; engines are woken at their ``next_time()``.

**Router-side queue** (``router_queue``, :mod:`kvroute.routing.queue`): a request whose instances are
all saturated waits at the router and is decided when one can take it, by the same queue code as the
live router. The queue is tried again whenever an instance's state changes while it holds requests
(every step end of that engine, which also brings the router a fresh copy of that engine's load: the
first token or the finish the live router would see, or a chunk of a long prefill done), and at every
tick with ``tick_s`` > 0 (then only at ticks). Requests that wait ``ttl_s`` are dropped and counted in
``queue_expired`` (they stay ``unfinished``: the live router answers them 503).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kvroute.engine.host import EngineHost
from kvroute.engine.memo import DecodeMemo
from kvroute.engine.model import EngineModel
from kvroute.engine.types import (
    CostModel,
    EngineConfig,
    EngineRequest,
    KVEvent,
    LoadSnapshot,
    OutputKind,
)
from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.features.timeline import TtftTimeline
from kvroute.metrics import LatencyRecorder
from kvroute.policies.base import Policy
from kvroute.routing.core import Decision, RouteRequest, RoutingCore
from kvroute.routing.kvview import KVView
from kvroute.routing.queue import QueueConfig, Released, RouterQueue, Ticket, band_of, saturated
from kvroute.routing.shadow import Shadows
from kvroute.sim.loop import PRIO_ARRIVAL, PRIO_DELIVERY, PRIO_ENGINE, EventLoop, SimClock
from kvroute.views import Hold, InstanceView
from kvroute.workloads.request import Request

KV_VIEWS = ("exact", "approx")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's settings.

    - ``kv_capacity_tokens``: KV pool of each instance in tokens (blocks = this // block size).
    - ``scrape_interval``: seconds between the router's copies of engine load (0: always current).
    - ``event_delay``: seconds from a KV event to the router's index seeing it.
    - ``max_sim_seconds``: stop (counting the rest as unfinished) at this simulated time.
    - ``prefix_caching``: False turns every engine's prefix cache off (no hits, no KV events).
    """

    instances: int
    kv_capacity_tokens: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_view: str = "exact"
    scrape_interval: float = 0.05
    event_delay: float = 0.002
    seed: int = 0
    max_sim_seconds: float | None = None
    prefix_caching: bool = True
    # Features (kvroute.features): ``scale_out`` = ((time s, new instances), ...) joins during the run;
    # the last ``spot_instances`` initial instances carry the tag "spot".
    scale_out: tuple[tuple[float, int], ...] = ()
    spot_instances: int = 0
    by_class: bool = False  # report latencies per request class (``by_class`` in the output)
    router_queue: QueueConfig | None = None  # the router-side queue (None: off)

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
        if self.router_queue is not None:
            self.router_queue.check()


def sim_router(config: SimConfig, policy: Policy, block_size: int, capacity_blocks: int) -> RoutingCore:
    """The simulated router's routing core: ``policy`` over a KV view of ``config.instances`` instances,
    exact (fed by the engines' events) or approximate (routing history with an LRU capacity of
    ``capacity_blocks`` per instance, the engines' pool; no TTL)."""
    exact = config.kv_view == "exact"
    kv = KVView(
        num_backends=config.instances,
        block_size=block_size,
        capacity_blocks=capacity_blocks,
        ttl_s=None,
        recovery_s=0.0,
        exact_backends=range(config.instances) if exact else (),
        rehash=False,  # the engines hash with the workload's block ids, as the router does
        history=False,  # engine events never break here: exact instances need no fallback
    )
    return RoutingCore(policy, kv)


@dataclass(slots=True)
class _Inst:
    """The router's per-instance state and the engine behind it."""

    engine: EngineModel
    snap: LoadSnapshot  # the engine's load() when copied
    snap_time: float
    snap_version: int = -1  # the engine's ``version`` when ``snap`` was copied
    opt: dict[int, tuple[int, int]] = field(default_factory=dict)  # req_id -> (new prefill tokens, blocks)
    opt_tokens: int = 0
    opt_blocks: int = 0
    host: EngineHost | None = None  # runs the engine on the loop (set by ClusterSim._add_instance)
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
    chain: tuple[int, ...] = ()  # block ids (kept for the approximate view's correction)
    predicted_blocks: int = 0  # cached blocks the router predicted on ``instance``
    hold: Hold | None = None  # the policy's own bookkeeping of the request (RoutingCore.dispatched)


class ClusterSim:
    """Runs one workload through a cluster. Build, then ``run(workload)``; mutates only itself."""

    def __init__(
        self, config: SimConfig, policy: Policy, cost: CostModel, shadow: tuple[str, ...] = ()
    ) -> None:
        config.check()
        self.config = config
        self.policy = policy
        self.cost = DecodeMemo(cost)
        self.loop = EventLoop()
        self._clock = SimClock(self.loop)  # engine wake-ups at PRIO_ENGINE
        self.recorder = LatencyRecorder()
        self.rng = random.Random(config.seed)
        self._insts: list[_Inst] = []
        self._block_size = 0
        self.core: RoutingCore | None = None
        self._approx = False
        self._live: dict[int, _Live] = {}
        self.requests = 0
        self.rejected = 0
        self.preemptions = 0
        # features: the Guarded wrapper (if the policy is one), preload requests in flight, per-class
        # latencies, quota rejections, TTFT by arrival (with scale-out events)
        self.guard: Any = None  # the features' state (Guarded) once built
        self._preload: set[int | str] = set()
        self._by_class: dict[str, LatencyRecorder] = {}
        self.quota_rejected = 0
        self.timeline = TtftTimeline() if config.scale_out else None
        # routing views as of the last full pass; ``_oldest_snap``: the oldest load copy then (no
        # copy is due before ``_oldest_snap + scrape_interval``); ``_dirty``: views to rebuild
        self._views: list[InstanceView] = []
        self._oldest_snap = -math.inf
        self._dirty: set[int] = set()
        self._shadow_names = shadow  # shadow policies (kvroute.routing.shadow), built with the core
        self.shadows: Shadows | None = None
        self._routed_views: Sequence[InstanceView] = ()  # the views of the queue's last route call
        # the router-side queue: bands from the request classes' BS weights (the classes feature's
        # if it is on); waits (s) of the requests that were queued; armed tick / TTL events
        q = config.router_queue
        self.queue = RouterQueue(q) if q is not None else None
        classes = getattr(getattr(policy, "features", None), "classes", None)
        self._band_weights = (classes if classes is not None else ClassConfig()).weight_map
        self.queue_waits: list[float] = []
        self.queue_expired = 0
        self._tick_armed = False
        self._deadline_armed = False

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
            enable_prefix_caching=cfg.prefix_caching,
        )
        self._block_size = block_size
        for k in range(cfg.instances):
            spot = k >= cfg.instances - cfg.spot_instances
            self._add_instance(
                EngineModel(ecfg, self.cost), 0.0, frozenset({"spot"}) if spot else frozenset()
            )
        self._approx = cfg.kv_view != "exact"
        self.core = sim_router(cfg, self.policy, block_size, blocks)
        self.core.kv.on_cleared = self._cleared
        self.guard = self.core.guard
        if self._shadow_names:
            self.shadows = Shadows(self._shadow_names, self.core.kv, random.Random(cfg.seed))
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
        if self.shadows is not None:
            out["shadow"] = self.shadows.summary()
        if self.queue is not None:
            out["router_queue"] = self._queue_output()
        return out

    def _queue_output(self) -> dict[str, Any]:
        """The queue's counters and the waits of the requests it held (ms)."""
        q = self.queue
        assert q is not None
        waits = sorted(self.queue_waits)

        def pick(p: float) -> float:
            return round(waits[min(len(waits) - 1, int(p * len(waits)))] * 1000.0, 3) if waits else 0.0

        return {
            "queued": q.enqueued,
            "dispatched": q.dispatched,
            "expired": self.queue_expired,
            "left": len(q),
            "wait_ms": {"p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)},
        }

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
            self._add_instance(EngineModel(self._ecfg, self.cost), now)
            assert self.core is not None
            self.core.kv.add_backend(self.config.kv_view == "exact")
            self._reset_instance(len(self._insts) - 1, now)

    def _add_instance(self, eng: EngineModel, now: float, tags: frozenset[str] = frozenset()) -> None:
        """Append an instance: the router's state for it and the host that runs ``eng`` on the loop
        (its outputs to :meth:`_outputs`, its KV events to the KV view after ``event_delay``)."""
        i = len(self._insts)
        inst = _Inst(eng, eng.load(), now, tags=tags)
        on_events = None
        if self.config.kv_view == "exact":

            def on_events(events: list[KVEvent]) -> None:
                loop = self.loop
                loop.schedule(loop.now + self.config.event_delay, PRIO_DELIVERY, self._deliver, i, events)

        clock: Any = self._clock if self.queue is None else _StepClock(self.loop, partial(self._stepped, i))
        inst.host = EngineHost(eng, clock, partial(self._outputs, i, inst), on_events)
        self._insts.append(inst)

    def _reset_instance(self, i: int, now: float) -> None:
        """Instance ``i`` joined or lost its cache: tell the guard, send it the preload requests."""
        if self.guard is None:
            return
        bs = self._block_size
        prefixes = self.guard.instance_reset(i, now)
        reqs = []
        for k, p in enumerate(prefixes):
            rid = f"preload-{i}-{now:.3f}-{k}"
            self._preload.add(rid)
            assert self.core is not None
            self.core.kv.on_routed(i, p.chain, now)
            reqs.append(EngineRequest(rid, len(p.chain) * bs, 1, p.chain))
        if reqs:  # one call: they join the same step
            host = self._insts[i].host
            assert host is not None
            host.add(*reqs)

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
                inst.opt_tokens = inst.opt_blocks = 0
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
                decode_blocks=used + inst.opt_blocks,
                tags=inst.tags,
                max_batched_tokens=self.config.max_num_batched_tokens,
                max_num_seqs=self.config.max_num_seqs,
            )
            inst.view = view
        return view

    def _route(self, req: Request) -> None:
        now = self.loop.now
        rr = RouteRequest(
            chain=req.block_ids,
            prompt_tokens=req.prompt_len,
            max_tokens=req.output_len,
            user=req.user,
            req_class=req.req_class,
            quota_key=req.user,
        )
        q = self.queue
        if q is None:
            self._decide(req, rr, now, self._all_views(now))
            return
        band = band_of(req.req_class, self._band_weights)
        cost = req.prompt_len + req.output_len
        ticket = Ticket(req.req_id, band, req.user or "-", cost, None, (req, rr, now))
        self._released(q.offer(ticket, now, self._pool_views, self._route_ticket, self._commit))
        self._arm(now)

    # -- the router-side queue --------------------------------------------------------------------
    def _pool_views(self, _pool: object) -> list[InstanceView]:
        return self._all_views(self.loop.now)

    def _route_ticket(self, ticket: Ticket, views: Sequence[InstanceView], first: bool) -> Decision:
        assert self.core is not None
        self._routed_views = views  # the queue commits right after routing, with these views
        return self.core.route(ticket.payload[1], views, self.loop.now, charge=first, gated=True)

    def _commit(self, ticket: Ticket, decision: Decision) -> None:
        req, rr, arrived = ticket.payload
        self._carry_out(req, rr, arrived, self._routed_views, decision)

    def _released(self, released: list[Released]) -> None:
        self.queue_waits.extend(r.waited_s for r in released if r.queued)

    def _drain(self, decide: bool = True) -> None:
        """Drop expired requests, decide what can be decided (``decide``), arm the next events."""
        q = self.queue
        assert q is not None
        now = self.loop.now
        self.queue_expired += len(q.expire(now))
        if decide and len(q):
            self._released(q.drain(now, self._pool_views, self._route_ticket, self._commit))
        self._arm(now)

    def _arm(self, now: float) -> None:
        """While requests are queued: the next tick (``tick_s`` > 0) and the oldest one's deadline."""
        q = self.queue
        assert q is not None
        if not len(q):
            return
        if q.config.tick_s and not self._tick_armed:
            self._tick_armed = True
            self.loop.schedule(q.next_tick(now), PRIO_ARRIVAL, self._tick)
        deadline = q.next_deadline()
        if deadline is not None and not self._deadline_armed:
            self._deadline_armed = True
            self.loop.schedule(max(deadline, now), PRIO_ARRIVAL, self._deadline)

    def _tick(self) -> None:
        self._tick_armed = False
        self._drain()

    def _deadline(self) -> None:
        self._deadline_armed = False
        assert self.queue is not None
        # an expiry changes no instance: what could not go before still cannot (decisions come at
        # step ends and ticks); a pass per expiry cost a route per queued request under overload
        self._drain(decide=False)

    def _stepped(self, i: int) -> None:
        """Instance ``i``'s engine ended a step: with requests queued (and no ticks), the router
        takes a fresh copy of its load and tries the queue."""
        q = self.queue
        if q is None or not len(q) or q.config.tick_s:
            return
        self._insts[i].snap_time = -math.inf
        self._dirty.add(i)
        if saturated(self._all_views(self.loop.now)[i]):
            return  # it still cannot take a request: a pass would route every queued one to no end
        self._drain()

    def _decide(self, req: Request, rr: RouteRequest, arrived: float, views: list[InstanceView]) -> None:
        """Route ``req`` (arrived at the router at ``arrived``) among ``views`` now and carry it out."""
        assert self.core is not None
        self._carry_out(req, rr, arrived, views, self.core.route(rr, views, self.loop.now))

    def _carry_out(
        self,
        req: Request,
        rr: RouteRequest,
        arrived: float,
        views: Sequence[InstanceView],
        decision: Decision,
    ) -> None:
        """Carry ``decision`` (made among ``views``) out: reserve on the chosen instance, send."""
        now = self.loop.now
        core = self.core
        assert core is not None
        chain = rr.chain
        prompt = rr.prompt_tokens
        choice = decision.instance
        if choice is None:  # refused by the token quota
            self.quota_rejected += 1
            return
        if self.shadows is not None:  # what the shadow policies would have chosen, same views
            self.shadows.observe(rr, views, now, decision)
        inst = self._insts[choice]
        cached = decision.cached_on(choice)
        new_tokens = prompt - cached
        blocks = -(-prompt // self._block_size)
        inst.opt[req.req_id] = (new_tokens, blocks)
        inst.opt_tokens += new_tokens
        inst.opt_blocks += blocks
        inst.view = None
        self._dirty.add(choice)
        core.kv.on_routed(choice, chain, now)
        live = _Live(arrived, prompt, req.output_len, choice, req_class=req.req_class)
        live.hold = core.dispatched(decision, choice, now)
        if self._approx:
            live.chain = chain
            live.predicted_blocks = cached // self._block_size
        self._live[req.req_id] = live
        assert inst.host is not None
        inst.host.add(EngineRequest(req.req_id, prompt, req.output_len, chain))

    def _unreserve(self, i: int, inst: _Inst, req_id: Any) -> None:
        """Drop the optimistic counters of ``req_id`` on instance ``i`` (first token, or aborted)."""
        entry = inst.opt.pop(req_id, None)
        if entry is not None:
            inst.opt_tokens -= entry[0]
            inst.opt_blocks -= entry[1]
            inst.view = None
            self._dirty.add(i)

    # -- engines ----------------------------------------------------------------------------------
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
                self._unreserve(i, inst, o.req_id)
                if rec.hold is not None:
                    rec.hold.first_token(o.time)
            if kind is OutputKind.FINISHED:
                rec = live.pop(o.req_id)
                if rec.hold is not None:
                    rec.hold.finished(o.time)
                if rec.chain and self.core is not None:  # approximate view: corrected from the real hit
                    self.core.kv.on_usage(i, rec.chain, rec.cached, rec.predicted_blocks, o.time)
                self.recorder.add(rec.arrival, rec.first, o.time, rec.prompt_len, rec.cached, rec.output_len)
                if self.config.by_class:
                    by = self._by_class.get(rec.req_class)
                    if by is None:
                        by = self._by_class[rec.req_class] = LatencyRecorder()
                    by.add(rec.arrival, rec.first, o.time, rec.prompt_len, rec.cached, rec.output_len)
                if self.timeline is not None:
                    self.timeline.add(rec.arrival, rec.first - rec.arrival)
            elif kind is OutputKind.ABORTED:
                gone = live.pop(o.req_id, None)
                if gone is not None and gone.hold is not None:
                    gone.hold.finished(o.time)
                self._unreserve(i, inst, o.req_id)
                self.rejected += 1

    def _deliver(self, i: int, events: list[KVEvent]) -> None:
        assert self.core is not None
        self.core.kv.apply_events(i, events)

    def _cleared(self, i: int) -> None:
        """Instance ``i``'s cache was cleared (its AllBlocksCleared event reached the KV view)."""
        self._reset_instance(i, self.loop.now)  # cold start: warming again, preloads


class _StepClock:
    """The loop as one engine host's clock, with ``after()`` called after each of its wake-ups (the
    router-side queue learns of every step end)."""

    __slots__ = ("after", "loop")

    def __init__(self, loop: EventLoop, after: Callable[[], None]) -> None:
        self.loop = loop
        self.after = after

    def now(self) -> float:
        return self.loop.now

    def call_at(self, when: float, fn: Callable[[float], object]) -> None:
        """Run ``fn(when)`` at ``when`` at ``PRIO_ENGINE``, then ``after()``."""
        self.loop.schedule(when, PRIO_ENGINE, self._wake, fn, when)

    def _wake(self, fn: Callable[[float], object], when: float) -> None:
        fn(when)
        self.after()
