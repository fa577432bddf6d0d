"""The simulated disaggregated cluster: a pool of prefill (P) and a pool of decode (D) engine models
behind one P/D router (:class:`~kvroute.routing.pd.PDRouter`, the live router's decision step).

Per request, at its arrival:

- the router picks D by the policy's load term and either skips P (the conditional skip: D prefills the
  prompt itself, as a colocated engine would) or picks P by the policy over the P pool;
- **P leg**: P runs the prompt with one output token and keeps its blocks (``hold_blocks``);
- **transfer**: when P's token is out, the D leg starts ``TransferModel.seconds(tokens D lacks)`` later
  (the prompt less what D's cache holds then), and P's blocks are released then
  (D read them and notified);
- **D leg**: D runs the request with ``remote_prefill`` (computes only the last prompt token again) and all its
  output tokens. The TTFT is D's first token (vLLM's proxy relays D's stream); the cached tokens reported
  are P's (vLLM's proxy reports P's ``cached_tokens``), D's own when P was skipped.

The router's views are always current (the engines' ``load()`` at decision time, plus the D legs in
transfer counted as waiting on their D); the KV views are exact, fed by each pool's events after
``event_delay`` seconds. Simplification: D reserves its blocks when the transfer ends, not while it runs.

Units: seconds of simulated time, tokens.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvroute.engine.host import EngineHost
from kvroute.engine.memo import DecodeMemo
from kvroute.engine.model import EngineModel
from kvroute.engine.transfer import TransferModel
from kvroute.engine.types import CostModel, EngineConfig, EngineOutput, EngineRequest, KVEvent, OutputKind
from kvroute.errors import UserError
from kvroute.metrics import LatencyRecorder
from kvroute.policies.registry import make_policy
from kvroute.routing.core import RouteRequest, RoutingCore
from kvroute.routing.kvview import KVView
from kvroute.routing.pd import PDRouter
from kvroute.sim.loop import PRIO_ARRIVAL, PRIO_DELIVERY, EventLoop, SimClock
from kvroute.views import InstanceView
from kvroute.workloads.request import Request

__all__ = ["PDClusterSim", "PDSimConfig", "parse_ratio"]


def parse_ratio(text: str) -> tuple[int, int]:
    """``"P:D"`` → (P, D), both >= 1 (UserError otherwise)."""
    p, sep, d = text.strip().partition(":")
    try:
        if not sep:
            raise ValueError
        pair = int(p), int(d)
    except ValueError:
        raise UserError(f"--pd {text!r}: give P:D, e.g. 1:3") from None
    if min(pair) < 1:
        raise UserError(f"--pd {text!r}: both pools need at least one instance")
    return pair


@dataclass(frozen=True, slots=True)
class PDSimConfig:
    """``prefill``/``decode``: pool sizes; ``kv_capacity_tokens``: KV pool of every instance;
    ``conditional``: allow the conditional skip of P; ``event_delay``: seconds from a KV event to the
    router's view; ``max_sim_seconds``: stop there (the rest counts as unfinished)."""

    prefill: int
    decode: int
    kv_capacity_tokens: int
    transfer: TransferModel
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    prefix_caching: bool = True
    conditional: bool = True
    event_delay: float = 0.002
    seed: int = 0
    max_sim_seconds: float | None = None

    def check(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise UserError("a P/D cluster needs at least one prefill and one decode instance")
        if self.kv_capacity_tokens <= 0 or self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise UserError("KV capacity, max-num-seqs and max-num-batched-tokens must be positive")
        if not 0 <= self.event_delay < math.inf:
            raise UserError("the event delay must be finite and >= 0")


@dataclass(slots=True)
class _Live:
    arrival: float
    prompt_len: int
    output_len: int
    chain: tuple[int, ...]
    decode: int
    prefill: int | None
    cached: int = 0  # reported cached tokens (P's, or D's when P was skipped)
    first: float = -1.0


class PDClusterSim:
    """Runs one workload through a P/D cluster: ``run(workload)`` → the summary dict of ``kvroute sim``
    plus ``pd``. Mutates only itself."""

    def __init__(self, config: PDSimConfig, policy: str, cost: CostModel) -> None:
        config.check()
        self.config = config
        self.policy_name = policy
        self.cost = DecodeMemo(cost)
        self.loop = EventLoop()
        self._clock = SimClock(self.loop)
        self.recorder = LatencyRecorder()
        self._rng = random.Random(config.seed)
        self._pools: dict[str, list[EngineModel]] = {"prefill": [], "decode": []}
        self._hosts: dict[str, list[EngineHost]] = {"prefill": [], "decode": []}
        self._in_transfer = [0] * config.decode  # D legs routed to each D, not yet added
        self._live: dict[Any, _Live] = {}
        self.router: PDRouter | None = None
        self.requests = 0
        self.skipped = 0
        self.transferred_tokens = 0
        self.transfer_seconds = 0.0

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
        cores = {}
        for pool, n in (("prefill", cfg.prefill), ("decode", cfg.decode)):
            kv = KVView(n, block_size, blocks, None, 0.0, range(n), rehash=False, history=False)
            cores[pool] = RoutingCore(make_policy(self.policy_name, random.Random(self._rng.random())), kv)
            for i in range(n):
                eng = EngineModel(ecfg, self.cost)
                host = EngineHost(
                    eng, self._clock, partial(self._outputs, pool, i), partial(self._events, pool, i)
                )
                self._pools[pool].append(eng)
                self._hosts[pool].append(host)
        self._cores = cores
        self.router = PDRouter(
            cores["prefill"],
            cores["decode"],
            self.cost,
            cfg.transfer,
            cfg.max_num_batched_tokens,
            cfg.conditional,
        )

    # -- run ----------------------------------------------------------------------------------------
    def run(self, workload: Iterator[Request]) -> dict[str, Any]:
        wall0 = time.perf_counter()
        it = iter(workload)
        first = next(it, None)
        if first is None:
            raise UserError("the workload is empty")
        self._build(first.block_size)
        self._block_size = first.block_size
        self._next(first, it)
        self.loop.run_until(self.config.max_sim_seconds)
        cfg = self.config
        engines = self._pools["prefill"] + self._pools["decode"]
        return {
            "policy": self.policy_name,
            "instances": cfg.prefill + cfg.decode,
            "requests": self.requests,
            "unfinished": self.requests - self.recorder.finished,
            **self.recorder.summary(),
            "sim_seconds": self.loop.now,
            "wall_seconds": time.perf_counter() - wall0,
            "rejected": 0,
            "preemptions": sum(e.stats().preemptions for e in engines),
            "pd": {
                "prefill": cfg.prefill,
                "decode": cfg.decode,
                "conditional": cfg.conditional,
                "skipped_prefill": self.skipped,
                "transferred_tokens": self.transferred_tokens,
                "transfer_s_mean": self.transfer_seconds / max(self.requests - self.skipped, 1),
            },
        }

    def _next(self, req: Request, it: Iterator[Request]) -> None:
        self.loop.schedule(max(req.arrival, self.loop.now), PRIO_ARRIVAL, self._arrive, req, it)

    def _arrive(self, req: Request, it: Iterator[Request]) -> None:
        if req.block_size != self._block_size:
            raise UserError(f"request {req.req_id}: block size {req.block_size} != {self._block_size}")
        self.requests += 1
        self._route(req)
        nxt = next(it, None)
        if nxt is not None:
            self._next(nxt, it)

    def _views(self, pool: str) -> list[InstanceView]:
        out = []
        for i, eng in enumerate(self._pools[pool]):
            running, waiting, queued, usage, blocks, used = eng.load()
            if pool == "decode":
                waiting += self._in_transfer[i]
            out.append(InstanceView(i, running, waiting, queued, usage, blocks, used))
        return out

    def _route(self, req: Request) -> None:
        now = self.loop.now
        router = self.router
        assert router is not None
        rr = RouteRequest(chain=req.block_ids, prompt_tokens=req.prompt_len, max_tokens=req.output_len)
        dec = router.route(rr, self._views("prefill"), self._views("decode"), now)
        d = dec.decode.instance
        assert d is not None
        chain = req.block_ids
        if dec.prefill is None or dec.prefill.instance is None:
            self.skipped += 1
            self._live[req.req_id] = _Live(now, req.prompt_len, req.output_len, chain, d, None)
            self._cores["decode"].kv.on_routed(d, chain, now)
            self._hosts["decode"][d].add(EngineRequest(req.req_id, req.prompt_len, req.output_len, chain))
            return
        p = dec.prefill.instance
        self._live[req.req_id] = _Live(now, req.prompt_len, req.output_len, chain, d, p)
        self._in_transfer[d] += 1
        self._hosts["prefill"][p].add(EngineRequest(req.req_id, req.prompt_len, 1, chain, hold_blocks=True))

    # -- engines ------------------------------------------------------------------------------------
    def _events(self, pool: str, i: int, events: list[KVEvent]) -> None:
        kv = self._cores[pool].kv
        self.loop.schedule(self.loop.now + self.config.event_delay, PRIO_DELIVERY, kv.apply_events, i, events)

    def _outputs(self, pool: str, i: int, outs: list[EngineOutput]) -> None:
        for o in outs:
            rec = self._live.get(o.req_id)
            if rec is None:
                continue
            if pool == "prefill":
                if o.kind is OutputKind.FIRST_TOKEN:
                    rec.cached = o.num_cached_tokens
                elif o.kind is OutputKind.FINISHED:
                    self._start_transfer(o.req_id, rec, i, o.time)
                continue
            if o.kind is OutputKind.FIRST_TOKEN:
                rec.first = o.time
                if rec.prefill is None:
                    rec.cached = o.num_cached_tokens
            elif o.kind is OutputKind.FINISHED:
                del self._live[o.req_id]
                self.recorder.add(rec.arrival, rec.first, o.time, rec.prompt_len, rec.cached, rec.output_len)

    def _start_transfer(self, rid: Any, rec: _Live, p: int, now: float) -> None:
        """P's token is out: D reads the tokens it lacks, then starts; P frees when the read is done."""
        d_eng = self._pools["decode"][rec.decode]
        chain = rec.chain
        lacking = rec.prompt_len - d_eng.local_hit_tokens(chain, rec.prompt_len)
        took = self.config.transfer.seconds(lacking)
        self.transferred_tokens += lacking
        self.transfer_seconds += took
        self.loop.schedule(now + took, PRIO_ARRIVAL, self._land, rid, rec, p)

    def _land(self, rid: Any, rec: _Live, p: int) -> None:
        now = self.loop.now
        self._hosts["prefill"][p].release(rid)
        self._in_transfer[rec.decode] -= 1
        self._cores["decode"].kv.on_routed(rec.decode, rec.chain, now)
        req = EngineRequest(rid, rec.prompt_len, rec.output_len, rec.chain, remote_prefill=True)
        self._hosts["decode"][rec.decode].add(req)
