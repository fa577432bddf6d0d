"""kvroute's routing core as a Ray Serve request router (extra ``kvroute[ray]``).

Use it per deployment::

    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from kvroute.integrations.ray_serve import KVRouteRequestRouter

    @serve.deployment(
        num_replicas=4,
        request_router_config=RequestRouterConfig(
            request_router_class=KVRouteRequestRouter,
            request_router_kwargs={"policy": "lmetric", "features": {"hotspot": True}},
            request_routing_stats_period_s=0.5,
        ),
    )
    class Model: ...

and call the deployment's handle with the OpenAI body (a dict, or a pydantic request as Ray Serve
LLM's ingress passes it) as the first argument. Ray Serve's HTTP proxy hands routers no body, so a
deployment reached straight from HTTP is routed by load alone; route at the handle hop behind an
ingress deployment, as Ray Serve LLM does.

How it follows Ray's own routers (``PowerOfTwoChoicesRequestRouter``, Ray Serve LLM's
``PrefixCacheAffinityRouter``) and its custom-router guide:

- :meth:`choose_replicas` returns ranks, best first: one replica per rank in the order of the
  core's :attr:`Decision.order`, so Ray's own queue-length check and back-off still apply (a full
  replica is skipped for the next one). A replica whose queue length Ray cannot read within its
  probe deadline is skipped too: Ray's default, 0.1 s, is missed on a loaded host, and Ray then
  sends the request to the decision's second choice (two long requests landed on one replica of two
  that way); the router sets the deadline to ``queue_len_deadline_s`` (default 1 s, Ray's own
  ceiling for its backed-off probes), so a busy replica is still read and a hung one skipped.
- ``request_router_kwargs`` reach :meth:`initialize_state`: ``policy`` (any registry name,
  default :data:`~kvroute.policies.registry.DEFAULT_POLICY`), ``router_queue`` (below; on by
  default), ``features`` (the design's features as in a router YAML file's ``features``
  section, e.g. ``{"hotspot": true, "limits": {"p_token_cap": 8192}}``), ``block_size``,
  ``tokenizer`` (a ``tokenizer.json`` path; default: the bundled Qwen3 tokenizer), the approximate
  KV view's ``approx_capacity_blocks`` / ``approx_ttl_s``, ``kv_recovery_s``, ``sync_interval_s``
  (shared-state period, seconds), ``reservation_ttl_s``, ``queue_len_deadline_s`` (seconds, above),
  ``share_state`` (False: this router alone), ``seed`` (random policies).
- ``on_request_routed`` / ``on_request_completed`` / ``on_replica_actor_died`` /
  ``update_replicas`` keep the in-flight accounting (:mod:`kvroute.integrations.inflight`) and the KV
  view's membership.
- Replicas report load through ``record_routing_stats`` (keys in
  :data:`kvroute.integrations.inflight.STAT_KEYS`; :mod:`kvroute.integrations.ray_engine` is an
  example): ``running``, ``waiting``, ``queued_prefill_tokens``, ``kv_usage``,
  ``kv_capacity_blocks``, ``time``, ``requests`` (``[[internal_request_id, prefill tokens left], ...]``
  of the requests the snapshot counts: which of this router's requests it counts, by id, not by
  time), ``ttft_p50_s`` (where a request's prefill ends: without it,
  a request routed since the replica's last report counts as prefilling until it completes); ``usage``: ``[[internal_request_id, cached_tokens], ...]`` of
  recently finished requests (corrects the approximate view, as ``usage.prompt_tokens_details.cached_tokens``
  does in the live router); ``kv_events_endpoint`` (and ``kv_events_replay_endpoint``): a vLLM-style
  ZMQ KV event stream, which makes that replica's view exact (:class:`KVView`).
- State the routers of one deployment share (routing history, in-flight load) lives in a named,
  detached actor per deployment (:mod:`kvroute.integrations.ray_state`; namespace
  ``serve::<app>::<deployment>``, registered for clean-up on ``serve.shutdown()``, as Ray Serve LLM
  does with its prefix tree actor). Unlike that router, no decision waits on the actor: a background
  task exchanges news every ``sync_interval_s``; decisions read the local copy.

A quota refusal (feature ``quota``) cannot be returned by a Ray router (it has no "refuse"); the
request then goes by Ray's queue lengths alone. Put quotas in the ingress.

**The router-side queue** (``router_queue``: ``true`` or ``{ttl_s, tick_s}``, ``false`` for off; on by
default, :data:`~kvroute.policies.registry.DEFAULT_ROUTER_QUEUE`;
:mod:`kvroute.routing.queue`): :meth:`choose_replicas` is a coroutine, so a request whose chosen
replica is saturated waits in it, in the same :class:`~kvroute.routing.queue.RouterQueue` the live
router and the simulator use, and is routed again from fresh views when a request completes, when a
replica's stats change and every ``sync_interval_s``. Saturation needs the replica's limits in its
stats (``max_num_batched_tokens``, ``max_num_seqs``; :mod:`kvroute.integrations.ray_engine` reports
them); a replica without them is never saturated. What Ray does not allow: a router cannot answer a
request, so a request past the TTL is not answered 503 but handed back to Ray's own queue-length
order (counted in ``queue.expired``); priority bands and fair share apply among the requests waiting
in this router process only, and the replicas' stats are only as fresh as
``request_routing_stats_period_s`` (plus this router's own reservations). A caller that goes away
while its request waits cancels the routing coroutine: the request leaves the queue, counted in
``queue.cancelled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import ray
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.integrations.inflight import InFlight, Row, instance_view
from kvroute.integrations.prompts import PromptChains, body_of
from kvroute.integrations.ray_state import Load, Routed, SharedRoutingState
from kvroute.policies.registry import DEFAULT_POLICY, DEFAULT_ROUTER_QUEUE
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.core import Decision, RouteRequest, RoutingCore, build_policy
from kvroute.routing.kvview import KVView
from kvroute.routing.queue import RouterQueue, Ticket, band_of, queue_from_mapping
from kvroute.tokenizer import load_tokenizer
from kvroute.views import InstanceView

__all__ = ["STATE_ACTOR_NAME", "KVRouteRequestRouter", "state_actor"]

log = logging.getLogger("kvroute.integrations.ray_serve")

STATE_ACTOR_NAME = "KVRouteRoutingState"
_PREDICTIONS = 4096  # request ids remembered for the cached_tokens correction


def state_actor(app: str | None, deployment: str | None) -> Any:
    """The deployment's shared-state actor (created on first use; ``get_if_exists``). Non-blocking:
    returns the handle at once. Registered with the Serve controller for clean-up when it exists."""
    namespace = "::".join([SERVE_NAMESPACE, *(p for p in (app, deployment) if p)])
    actor = (
        ray.remote(SharedRoutingState)
        .options(
            name=STATE_ACTOR_NAME, namespace=namespace, get_if_exists=True, lifetime="detached", num_cpus=0
        )
        .remote()
    )
    with contextlib.suppress(ValueError):  # no Serve controller (a test's bare router)
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(actor)  # fire and forget
    return actor


class KVRouteRequestRouter(RequestRouter):
    """See the module docstring. Attributes for tests and logs: ``core`` (the :class:`RoutingCore`,
    its ``kv`` the KV view), ``inflight``, ``last_decision``, ``decisions``, ``syncs``."""

    def initialize_state(self, **kwargs: Any) -> None:
        """Ray calls this with ``request_router_kwargs`` (see :meth:`setup` for the names)."""
        self.setup(**kwargs)

    def setup(
        self,
        policy: str = DEFAULT_POLICY,
        features: Mapping[str, Any] | None = None,
        block_size: int = 16,
        tokenizer: str | None = None,
        approx_capacity_blocks: int = 16384,
        approx_ttl_s: float | None = None,
        kv_recovery_s: float = 5.0,
        sync_interval_s: float = 0.05,
        reservation_ttl_s: float = 60.0,
        queue_len_deadline_s: float = 1.0,
        share_state: bool = True,
        seed: int = 0,
        state: Any = None,
        router_queue: Any = DEFAULT_ROUTER_QUEUE,
    ) -> None:
        """Build the core from ``request_router_kwargs`` (module docstring); ``state``: a shared-state
        actor handle to use instead of the deployment's (tests). Raises UserError for a bad policy,
        feature or tokenizer."""
        from kvroute.features.mapping import features_from_mapping

        feats = features_from_mapping(features, "request_router_kwargs") if features else None
        kv = KVView(0, block_size, approx_capacity_blocks, approx_ttl_s, kv_recovery_s)
        self.core = RoutingCore(build_policy(policy, feats, random.Random(seed)), kv)
        qcfg = queue_from_mapping(router_queue, "request_router_kwargs")
        self.queue = RouterQueue(qcfg) if qcfg is not None else None
        classes = feats.classes if feats is not None else None
        self._band_weights = (classes if classes is not None else ClassConfig()).weight_map
        self._by_rid: dict[str, RunningReplica] = {}  # full replica id → the latest RunningReplica
        self.prompts = PromptChains(RequestTokenizer(load_tokenizer(tokenizer)), block_size)
        self.inflight = InFlight(reservation_ttl_s)
        if not queue_len_deadline_s > 0:
            raise UserError("request_router_kwargs: queue_len_deadline_s must be positive")
        # Ray's probe of a replica's queue length (module docstring): its first deadline and its ceiling
        self.queue_len_response_deadline_s = queue_len_deadline_s
        self.max_queue_len_response_deadline_s: float = max(
            queue_len_deadline_s, self.max_queue_len_response_deadline_s
        )
        self.sync_interval_s = sync_interval_s
        self.name = uuid.uuid4().hex
        self.decisions = 0
        self.syncs = 0
        self.last_decision: Decision | None = None
        self._index: dict[str, int] = {}  # full replica id → KV view index (never reused)
        self._chosen: dict[str, tuple[RouteRequest, Decision]] = {}  # internal request id → decision
        self._predictions: OrderedDict[str, tuple[int, tuple[int, ...], int]] = OrderedDict()
        self._stats_seen: dict[str, object] = {}
        self._others: Load = {}
        self._outbox: list[Routed] = []
        self._cursor = 0
        self._subscribers: dict[str, asyncio.Task[None]] = {}
        self._zmq: Any = None
        self._background: asyncio.Task[None] | None = None
        self._state = state
        self._sync_failing = False
        if state is None and share_state:
            dep = self._deployment_id
            self._state = state_actor(dep.app_name if dep else None, dep.name if dep else None)

    # ---- the decision -------------------------------------------------------------------------

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """Rank ``candidate_replicas`` with the core: one replica per rank, best first."""
        if not candidate_replicas:
            return []
        self._start_background()
        now = self._get_curr_time_s()
        req = RouteRequest(chain=(), prompt_tokens=1)
        if pending_request is not None:
            req = self.prompts.route_request(body_of(pending_request.args, pending_request.kwargs))
        by_index: dict[int, RunningReplica] = {}
        for r in candidate_replicas:
            rid = r.replica_id.to_full_id_str()
            idx = self._index_of(rid)
            self._read_stats(rid, idx, r.routing_stats or {}, now)
            by_index[idx] = r
            self._by_rid[rid] = r
        pool = tuple(r.replica_id.to_full_id_str() for r in candidate_replicas)
        if self.queue is not None and pending_request is not None:
            decision = await self._queued(req, pending_request, pool, now)
            if decision is None:  # waited past the TTL: Ray's own order (module docstring)
                return [candidate_replicas]
        else:
            decision = self.core.route(req, self._views(pool), now)
            self._decided(decision, req, pending_request, now)
        if decision.instance is None:  # quota refusal: Ray cannot refuse here (module docstring)
            return [candidate_replicas]
        order = [by_index[i] for i in decision.order if i in by_index]
        return [[r] for r in order]

    def _views(self, pool: Hashable) -> list[InstanceView]:
        """The views of the replicas ``pool`` (a tuple of full ids) now: their stats plus the
        in-flight load."""
        assert isinstance(pool, tuple)
        mine = self.inflight.rows()
        done = self.inflight.completed_rows()
        now = self._get_curr_time_s()
        views = []
        for rid in pool:
            r = self._by_rid.get(rid)
            idx = self._index.get(rid)
            if r is None or idx is None:
                continue  # left since
            load: list[Row] = [*mine.get(rid, []), *self._others.get(rid, [])]
            views.append(instance_view(idx, r.routing_stats or {}, load, done.get(rid, []), now))
        return views

    def _decided(self, decision: Decision, req: RouteRequest, pr: PendingRequest | None, now: float) -> None:
        """Count ``decision`` and reserve its first choice for ``pr``."""
        self.decisions += 1
        self.last_decision = decision
        if decision.instance is None or pr is None:
            return
        key = pr.metadata.internal_request_id
        rid = self._rid_of(decision.instance)
        if rid is None:
            return
        self.inflight.reserve(key, rid, decision.new_prefill(decision.instance), now)
        self._chosen[key] = (req, decision)
        if not self._use_replica_queue_len_cache:  # Ray calls no on_request_routed then
            self._record_routed(pr, self._by_rid[rid].replica_id, now)

    def _rid_of(self, idx: int) -> str | None:
        for rid, i in self._index.items():
            if i == idx:
                return rid
        return None

    # ---- the router-side queue -----------------------------------------------------------------

    async def _queued(
        self, req: RouteRequest, pr: PendingRequest, pool: tuple[str, ...], now: float
    ) -> Decision | None:
        """Route ``pr`` through the queue: its decision once its choice can take it (at once if it
        can now), or None past the TTL. Cancelled (the caller went away): it leaves the queue."""
        q = self.queue
        assert q is not None
        fut: asyncio.Future[Decision | None] = asyncio.get_running_loop().create_future()
        key = pr.metadata.internal_request_id
        ticket = Ticket(
            key,
            band_of(req.req_class, self._band_weights),
            req.user or "-",
            req.prompt_tokens + req.max_tokens,
            pool,
            (req, pr, fut),
        )
        q.offer(ticket, now, self._views, self._route_ticket, self._commit)
        try:
            return await fut
        finally:
            if not fut.done():
                q.cancel(key)

    def _route_ticket(self, ticket: Ticket, views: Sequence[InstanceView], first: bool) -> Decision:
        return self.core.route(ticket.payload[0], views, self._get_curr_time_s(), charge=first, gated=True)

    def _commit(self, ticket: Ticket, decision: Decision) -> None:
        req, pr, fut = ticket.payload
        if fut.done():
            return
        self._decided(decision, req, pr, self._get_curr_time_s())
        fut.set_result(decision)

    def _drain(self) -> None:
        """Drop expired requests (handed back to Ray's order), route what can go now."""
        q = self.queue
        if q is None or not len(q):
            return
        now = self._get_curr_time_s()
        for r in q.expire(now):
            fut = r.ticket.payload[2]
            if not fut.done():
                fut.set_result(None)
        q.drain(now, self._views, self._route_ticket, self._commit)

    # ---- Ray's hooks ---------------------------------------------------------------------------

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult
    ) -> None:
        """Ray sent the request to ``replica_id``: move its reservation there, record the history."""
        self._record_routed(pending_request, replica_id, self._get_curr_time_s())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """The request ended (success, error or rejection): it no longer counts as load."""
        self.inflight.release(internal_request_id, self._get_curr_time_s())
        self._chosen.pop(internal_request_id, None)
        self._drain()

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Drop the replica from the candidates, the KV view and the load."""
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.to_full_id_str())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Ray's replica list changed: forget the replicas that left (new ones join on first sight)."""
        super().update_replicas(replicas)
        alive = {r.replica_id.to_full_id_str() for r in replicas}
        for rid in [rid for rid in self._index if rid not in alive]:
            self._forget(rid)

    # ---- bookkeeping ---------------------------------------------------------------------------

    def _index_of(self, rid: str) -> int:
        idx = self._index.get(rid)
        if idx is None:
            idx = self._index[rid] = self.core.kv.add_backend(exact=False)
        return idx

    def _forget(self, rid: str) -> None:
        idx = self._index.pop(rid, None)
        if idx is not None:
            self.core.kv.remove_backend(idx)
        self.inflight.drop_replica(rid)
        self._by_rid.pop(rid, None)
        self._others.pop(rid, None)
        self._stats_seen.pop(rid, None)
        task = self._subscribers.pop(rid, None)
        if task is not None:
            task.cancel()

    def _record_routed(self, pr: PendingRequest, replica_id: ReplicaID, now: float) -> None:
        rid = replica_id.to_full_id_str()
        idx = self._index.get(rid)
        chosen = self._chosen.get(pr.metadata.internal_request_id)
        if idx is None or chosen is None:
            return
        req, decision = chosen
        self.inflight.move(pr.metadata.internal_request_id, rid, decision.new_prefill(idx), now)
        if not req.chain:
            return
        self.core.kv.on_routed(idx, req.chain, now)
        if self._state is not None:
            self._outbox.append((rid, req.chain, now))
        preds = self._predictions
        preds[pr.metadata.internal_request_id] = (
            idx,
            req.chain,
            decision.cached_on(idx) // self.core.block_size,
        )
        while len(preds) > _PREDICTIONS:
            preds.popitem(last=False)

    def _read_stats(self, rid: str, idx: int, stats: Mapping[str, Any], now: float) -> None:
        """New stats from ``rid``: apply its cached-token reports, follow its KV event endpoint."""
        stamp = stats.get("time")
        if stamp is None or self._stats_seen.get(rid) == stamp:
            return
        self._stats_seen[rid] = stamp
        for item in stats.get("usage") or ():
            if not isinstance(item, list | tuple) or len(item) != 2:
                continue
            pred = self._predictions.pop(str(item[0]), None)
            if pred is not None and pred[0] == idx and isinstance(item[1], int):
                self.core.kv.on_usage(idx, pred[1], item[1], pred[2], now)
        endpoint = stats.get("kv_events_endpoint")
        if isinstance(endpoint, str) and rid not in self._subscribers:
            self._subscribe(rid, idx, endpoint, stats.get("kv_events_replay_endpoint"), now)

    def _subscribe(self, rid: str, idx: int, endpoint: str, replay: Any, now: float) -> None:
        import zmq.asyncio

        from kvroute.prepare.events import EventSubscriber

        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        sub = EventSubscriber(
            self._zmq,
            idx,
            endpoint,
            replay if isinstance(replay, str) else None,
            self.core.kv,
            self._get_curr_time_s,
        )
        self.core.kv.set_exact(idx, True, now)
        self._subscribers[rid] = asyncio.get_running_loop().create_task(sub.run())

    # ---- the shared state, off the decision path ------------------------------------------------

    def _start_background(self) -> None:
        if self._background is None or self._background.done():
            self._background = asyncio.get_running_loop().create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        try:
            while ray.is_initialized():  # after ray.shutdown() a call would start a new Ray: stop
                now = self._get_curr_time_s()
                self.inflight.expire(now)
                if self._state is not None:
                    await self._sync_once()
                self._drain()
                await asyncio.sleep(self.sync_interval_s)
        finally:
            self._close_subscribers()

    def _close_subscribers(self) -> None:
        """Stop following KV events (Ray is gone): cancel the subscribers, close their sockets."""
        for task in self._subscribers.values():
            task.cancel()
        self._subscribers.clear()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    async def _sync_once(self) -> None:
        outbox, self._outbox = self._outbox, []
        try:
            cursor, news, others = await self._state.sync.remote(
                self.name, self._cursor, outbox, self.inflight.load()
            )
        except ray.exceptions.ActorDiedError:  # gone for good (serve.shutdown): local state from now on
            log.info("kvroute shared routing state is gone; this router continues alone")
            self._state = None
            return
        except Exception as exc:  # unavailable for now: keep deciding on local state, retry
            if not self._sync_failing:
                log.warning("kvroute shared routing state unavailable: %s", exc)
            self._sync_failing = True
            self._outbox = outbox + self._outbox
            return
        self._sync_failing = False
        self._cursor = cursor
        self._others = {rid: rows for rid, rows in others.items() if rid in self._index}
        kv = self.core.kv
        for rid, chain, t in news:
            idx = self._index.get(rid)
            if idx is not None and chain:
                kv.on_routed(idx, chain, t)
        self.syncs += 1
