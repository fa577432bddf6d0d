"""The wait stage: the router-side queue (:mod:`kvroute.routing.queue`) between decide and reserve.

With ``router_queue`` on, a request is routed as in the decide stage; if its chosen backend is
saturated it waits here, in the same :class:`~kvroute.routing.queue.RouterQueue` the simulator and the
Ray router use, and is routed again from the views of the moment each time the queue is drained:

- when a request of this router gets its first byte or ends (its lease frees the backend's queue),
  coalesced into one drain per event-loop turn;
- every ``scrape_interval_s`` while requests wait (the scraped load changed), or at each tick with
  ``tick_s`` > 0 (then only at ticks: the design's batched decisions).

A request that goes out gets a *hold* on its first choice at once (a :class:`Lease` like the
reserve stage's), so the next request decided in the same drain sees it; the reserve stage replaces
the hold with the real lease. A request that waits ``ttl_s`` is answered **503** with ``Retry-After``
(:class:`QueueExpired`, decision reason ``queue_ttl``); a client that goes away while waiting cancels
its handler: it leaves the queue, counted in ``cancelled``. Saturation needs the engines' limits
(``engine_limits`` in the config, or ``--engine-max-num-batched-tokens`` / ``--engine-max-num-seqs``;
`kvroute up` sets its emulated engines'): without them no backend is ever saturated.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Hashable, Mapping, Sequence

from kvroute.features.classes import ClassConfig
from kvroute.routing.core import Decision
from kvroute.routing.queue import QueueConfig, RouterQueue, Ticket, band_of, retry_after_s
from kvroute.server.stages.decide import Plan, candidate_views, plan_of, route_request
from kvroute.server.stages.prepare import Prepared
from kvroute.server.state.backends import Lease
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import ApiError, ParsedRequest
from kvroute.views import InstanceView

__all__ = ["WAIT_BUCKETS", "QueueExpired", "WaitingRoom"]

from kvroute.server.observe.exporter import WAIT_BUCKETS


class QueueExpired(ApiError):
    """503: the request waited the queue's TTL; retry after ``retry_after`` seconds."""

    def __init__(self, message: str, retry_after: int, decision: Decision) -> None:
        super().__init__(503, message, etype="service_unavailable")
        self.retry_after = retry_after
        self.decision = decision


class WaitingRoom:
    """The queue of one router process (module docstring). Counters for /metrics and the dashboard:
    ``queue`` (its own counters and depth per band), ``wait_counts`` (cumulative per
    :data:`WAIT_BUCKETS` bound, then +Inf), ``wait_sum`` (seconds). Use from one event loop."""

    def __init__(self, state: RouterState, config: QueueConfig) -> None:
        self.state = state
        self.queue = RouterQueue(config)
        feats = state.guard.features if state.guard is not None else None
        classes = feats.classes if feats is not None else None
        self._weights: Mapping[str, float] = (classes if classes is not None else ClassConfig()).weight_map
        self._ids = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._soon = False
        self._views: Sequence[InstanceView] = ()
        self._offering: Hashable = None  # the ticket being offered (decided in its own arrival: no wait)
        self._fresh: tuple[Hashable, list[InstanceView]] | None = None  # views just built by decide()
        self.wait_counts = [0] * (len(WAIT_BUCKETS) + 1)
        self.wait_sum = 0.0

    async def decide(
        self, req: ParsedRequest, prep: Prepared, headers: Mapping[str, str]
    ) -> tuple[Plan, Lease | None]:
        """The request's plan once its chosen backend can take it, and the hold on that backend
        (the caller releases it once reserved). Raises what the decide stage raises (a quota
        refusal included), and :class:`QueueExpired` past the TTL."""
        state = self.state
        rr = route_request(state, req, headers, prep)
        now = state.clock()
        # 503 / 404 now, not after a wait; the views serve the first routing
        self._fresh = (req.model, candidate_views(state, req.model, now))
        fut: asyncio.Future[tuple[Plan, Lease | None]] = asyncio.get_running_loop().create_future()
        ticket = Ticket(
            next(self._ids),
            band_of(rr.req_class, self._weights),
            rr.quota_key or rr.user or "-",
            rr.prompt_tokens + rr.max_tokens,
            req.model,
            (rr, prep, fut, now),
        )
        self._offering = ticket.key
        try:
            for r in self.queue.offer(ticket, now, self._pool_views, self._route, self._commit):
                if r.queued:
                    self._observe(r.waited_s)
        finally:
            self._offering = None
            self._fresh = None
        self._arm()
        try:
            return await fut
        except asyncio.CancelledError:  # the client went away while waiting (or just as it went out)
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                hold = fut.result()[1]
                if hold is not None:
                    hold.release()
            else:
                self.queue.cancel(ticket.key)
            raise

    def poke(self) -> None:
        """A backend's load dropped (a first byte, an end): drain once this event-loop turn ends."""
        if self._soon or not len(self.queue) or self.queue.config.tick_s:
            return
        self._soon = True
        asyncio.get_running_loop().call_soon(self._drain)

    # ---- the queue's callbacks ------------------------------------------------------------------

    def _pool_views(self, pool: Hashable) -> list[InstanceView]:
        state = self.state
        fresh, self._fresh = self._fresh, None
        if fresh is not None and fresh[0] == pool:
            self._views = fresh[1]
            return fresh[1]
        try:
            views = candidate_views(state, pool if isinstance(pool, str) else None, state.clock())
        except ApiError:
            views = []  # no healthy backend now: the request keeps waiting (until its TTL)
        self._views = views
        return views

    def _route(self, ticket: Ticket, views: Sequence[InstanceView], first: bool) -> Decision:
        state = self.state
        self._views = views
        return state.routing.route(ticket.payload[0], views, state.clock(), charge=first, gated=True)

    def _commit(self, ticket: Ticket, decision: Decision) -> None:
        rr, prep, fut, queued_at = ticket.payload
        if fut.done():
            return
        state = self.state
        now = state.clock()
        if ticket.key != self._offering:  # it waited: the decision record says how long
            decision = dataclasses.replace(decision, queued_s=now - queued_at)
        try:
            plan = plan_of(state, rr, prep, self._views, decision, now)
        except ApiError as err:  # the quota refused it
            fut.set_exception(err)
            return
        hold = None
        if plan.order:
            first = plan.order[0]
            blocks = -(-plan.prompt_tokens // state.config.block_size)
            hold = Lease(state.backends[first], plan.new_prefill[first], blocks, now, routed=False)
        fut.set_result((plan, hold))

    # ---- when the queue is tried ----------------------------------------------------------------

    def _drain(self) -> None:
        self._soon = False
        state = self.state
        now = state.clock()
        q = self.queue
        for r in q.expire(now):
            rr, _, fut, _ = r.ticket.payload
            if not fut.done():
                retry = retry_after_s(q.config)
                decision = state.routing.expired(rr, (), r.waited_s, retry)
                fut.set_exception(
                    QueueExpired(
                        f"waited {r.waited_s:.1f} s at the router for a free backend", retry, decision
                    )
                )
        for r in q.drain(now, self._pool_views, self._route, self._commit):
            self._observe(r.waited_s)
        self._arm()

    def _observe(self, waited: float) -> None:
        self.wait_sum += waited
        for i, bound in enumerate(WAIT_BUCKETS):
            if waited <= bound:
                self.wait_counts[i] += 1
        self.wait_counts[-1] += 1

    def _arm(self) -> None:
        """While requests wait: a drain at the next tick, scrape or deadline, whichever is first."""
        q = self.queue
        if not len(q) or self._timer is not None:
            return
        now = self.state.clock()
        tick = q.config.tick_s
        due = q.next_tick(now) if tick else now + self.state.config.scrape_interval_s
        deadline = q.next_deadline()
        if deadline is not None:
            due = min(due, deadline)
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(max(0.0, due - now), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._drain()
