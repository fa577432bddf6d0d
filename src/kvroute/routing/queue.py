"""The router-side queue: late binding, priority bands, fair share, a TTL, batched decisions.

Late binding: a request is routed by the routing core (:class:`~kvroute.routing.core.RoutingCore`)
over all its candidates, as they are now; it goes out only when the instance the policy chose can take
it (is not **saturated**). Otherwise it waits here, not in that engine's queue, and is routed again
from fresh views each time the queue is drained (an instance's state changed): it leaves as soon as
the policy's choice can take it, which may by then be another instance. So an engine's queue only
holds work it can start in its next step, and a request bound to an instance that frees up later can
still be sent to one that frees up sooner. A request is never sent to a saturated instance while it
is queued. It waits between *decide* and *reserve* in every driver: the simulator
(:mod:`kvroute.sim.cluster`), the live router and the Ray Serve router call the same
:class:`RouterQueue`.

**Saturated** (:func:`saturated`) is read from the engine's own limits, not from a tuned constant:
an instance is saturated when its next step cannot start a new request's prefill —

- its chunk budget is spent before it reaches a new request: ``max_batched_tokens`` (vLLM's
  ``max_num_batched_tokens``, tokens per step) is at most what the next step owes the work already
  there: one token per running sequence plus the queued prefill (``queued_prefill_tokens``: prompt
  tokens routed there and not yet computed) that the step in progress leaves over. A request sent
  now reaches the engine while a step is running (the router learns of a step end only after the
  engine scheduled the next one), so its first chance is the step after: the step in progress takes
  up to ``max_batched_tokens − running`` of the queued prefill first. Keeping that one step of work
  queued on the engine keeps it busy: late binding never leaves a step's budget idle; or
- its batch is full: ``running + waiting`` reaches ``max_num_seqs``, so a new request can only join
  the engine's waiting queue.

Requests that sit in an engine's waiting queue only until its next step starts (every request
routed mid-step does) are not a sign of saturation: their prefill is in ``queued_prefill_tokens`` and
the budget test counts it; a waiting queue the engine cannot drain (the batch limit, or the budget)
is caught by one of the two tests. An instance whose view does not carry a limit (0: unknown) is
never saturated by that limit, so a driver without them behaves as without the queue.

**Order** (:meth:`RouterQueue.drain`): priority bands first (``Ticket.band``, lower first: the
design's request classes, TTFT-sensitive before batch — :func:`band_of` ranks a class by its BS
exponent, the lower the more TTFT-sensitive), then fair share between users within a band
(``Ticket.user``: the user or API key of the design's per-user quotas) by start-time fair queueing
over tokens (``Ticket.cost``: prompt + expected output tokens): each user's next request is tagged
``max(V, F_user)`` where ``F_user`` is where that user's last served request ended and ``V`` the tag
last served; the smallest tag goes first, ties in arrival order. With one user this is FCFS; a user
who was idle gets no credit for it. Requests of different ``pool`` (a model's candidate set) wait in
separate lanes: one pool's saturation never holds another pool's requests.

**TTL** (``QueueConfig.ttl_s``): a request that waited this long is dropped from the queue
(:meth:`RouterQueue.expire`) and answered **503** with ``Retry-After`` (:data:`TTL_STATUS`): the
cluster, not the client, is over its capacity (429 stays the quota's answer: the client is over its
own rate), and RFC 9110 §15.6.4 pairs 503 with ``Retry-After``; the value is the TTL, rounded up
(:func:`retry_after_s`), since a retry sooner would join the same backlog.

**Batched decisions** (``QueueConfig.tick_s`` > 0, design §3.1: a batch every 10 ms): drivers call
:meth:`RouterQueue.drain` only at multiples of ``tick_s`` (:meth:`RouterQueue.next_tick`), so the
requests that arrived within one tick are decided together, in queue order, each from views that
include the reservations of those before it (the driver's ``views`` callback reflects what its
``commit`` callback reserved). With ``tick_s == 0`` a request is routed as soon as it arrives
(:meth:`RouterQueue.offer`) and waits only if its choice is saturated.

**Claims**: a request that waits for the instance its decision chose still weighs on that
instance in every later decision (:meth:`RouterQueue.claims`): the views the policy sees add, per
instance, the queued requests waiting for it to ``waiting`` and their new prefill tokens (prompt less
that instance's cached prefix) to ``queued_prefill_tokens``, as if they had been sent. Saturation is
still judged on the engine's own view. Without claims a load-counting policy (``vllm``'s
4·waiting + running, a prefix policy's load tie-break) saw no effect of the requests it held back and
sent every later one to the same saturated instance while others stood idle: on ``api`` at ×9 that
cost vllm 804 vs 151 ms mean TTFT; with claims 159 ms, p99 482 vs 626 ms
(docs/results/router-queue.md). A request decided afresh withdraws its own claim first. The
decisions the queue asks for are made behind it (``RequestView.gated``; with an instance's chunk budget
known this queue decides what reaches its engine: :func:`kvroute.views.held_back`), so a policy can
tell the engine's own queue from the router's.

**Why the choice over all instances, not the choice among the open ones**: sending a queued request
to whichever instance frees first throws away its prefix-cache affinity; measured in the simulator
(coder, 4 instances, near capacity) it cost more prefill than the late binding saved.

Pure: no I/O, no clock (``now`` in seconds on the driver's clock comes with every call), no globals.
Single-threaded: one owner per queue.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvroute.errors import UserError
from kvroute.features.classes import class_weight
from kvroute.policies.registry import DEFAULT_ROUTER_QUEUE
from kvroute.routing.core import Decision
from kvroute.views import InstanceView

__all__ = [
    "TTL_STATUS",
    "CommitFn",
    "QueueConfig",
    "Released",
    "RouterQueue",
    "Ticket",
    "band_of",
    "default_queue",
    "open_views",
    "queue_from_mapping",
    "retry_after_s",
    "saturated",
]

ViewsFn = Callable[[Hashable], Sequence[InstanceView]]
"""``views(pool)``: the pool's instance views now (with the reservations made so far)."""
RouteFn = Callable[["Ticket", Sequence[InstanceView], bool], Decision]
"""``route(ticket, views, first)``: the routing core's decision over ``views`` (``first``: may charge
a quota; later calls must not), made behind the queue (``RoutingCore.route(..., gated=True)``)."""
CommitFn = Callable[["Ticket", Decision], Any]
"""``commit(ticket, decision)``: carry the decision out (reserve, send; or answer a refusal)."""


def _binds(decision: Decision, views: Sequence[InstanceView]) -> bool:
    """Whether ``decision`` leaves the queue now: refused, or its instance can take the request."""
    chosen = decision.instance
    if chosen is None:
        return True
    for v in views:
        if v.index == chosen:
            return not saturated(v)
    raise ValueError(f"the decision chose instance {chosen}, which is not among the views")


TTL_STATUS = 503
"""HTTP status of a request that waited ``ttl_s`` in the queue (with ``Retry-After``)."""


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """``ttl_s``: longest wait at the router, seconds (> 0); ``tick_s``: 0 decides each request when
    it arrives, > 0 decides the requests queued within each tick together (seconds)."""

    ttl_s: float = 30.0
    tick_s: float = 0.0

    def check(self) -> QueueConfig:
        for name in ("ttl_s", "tick_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UserError(f"router queue: {name} must be a number of seconds (got {value!r})")
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise UserError(f"router queue: ttl_s must be a positive number of seconds (got {self.ttl_s})")
        if not (self.tick_s >= 0 and math.isfinite(self.tick_s)):
            raise UserError(f"router queue: tick_s must be >= 0 seconds (got {self.tick_s})")
        return self


def default_queue() -> QueueConfig | None:
    """The queue the default runs behind when nothing says otherwise (``kvroute sim``, ``serve``,
    ``up``, the Ray router): :class:`QueueConfig`'s defaults when
    :data:`~kvroute.policies.registry.DEFAULT_ROUTER_QUEUE`, else None (off)."""
    return QueueConfig() if DEFAULT_ROUTER_QUEUE else None


def queue_from_mapping(value: Any, where: str) -> QueueConfig | None:
    """A config value (a router YAML's ``router_queue``, Ray's ``request_router_kwargs``): ``true``
    (the defaults), ``false`` (off), null (the default: :func:`default_queue`, so a key left empty
    changes nothing) or a mapping of :class:`QueueConfig` fields (UserError for anything else or a
    bad field)."""
    from kvroute.features.mapping import build

    if value is None:
        return default_queue()
    if value is False:
        return None
    if value is True:
        return QueueConfig()
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: router_queue must be true, false or a mapping, got {value!r}")
    for key, field_value in value.items():
        if field_value is None:
            raise UserError(f"{where}: router_queue: {key} must be a number of seconds, got null")
    queue: QueueConfig = build(QueueConfig, value, f"{where}: router_queue")
    return queue.check()


def saturated(view: InstanceView) -> bool:
    """Whether ``view``'s next step cannot start a new request's prefill (module docstring)."""
    seqs = view.max_num_seqs
    if seqs and view.running + view.waiting >= seqs:
        return True
    budget = view.max_batched_tokens
    if not budget:
        return False
    running = view.running
    in_step = budget - running if budget > running else 0  # prefill the step in progress can take
    left = view.queued_prefill_tokens - in_step
    return running + (left if left > 0 else 0) >= budget


def open_views(views: Sequence[InstanceView]) -> list[InstanceView]:
    """The views of instances that can take a request now (not :func:`saturated`), in order."""
    return [v for v in views if not saturated(v)]


def band_of(req_class: str, weights: Mapping[str, float]) -> float:
    """A request class's priority band: its BS exponent (lower first). TTFT-sensitive classes weigh
    the batch size least (design §5.3), batch classes most; ``default`` is 1."""
    return class_weight(req_class, weights)


def retry_after_s(config: QueueConfig) -> int:
    """``Retry-After`` of a TTL answer, whole seconds (>= 1)."""
    return max(1, math.ceil(config.ttl_s))


@dataclass(frozen=True, slots=True)
class Ticket:
    """A queued request, as the queue sees it.

    - ``key``: unique while queued (the driver's request id; :meth:`RouterQueue.cancel` takes it).
    - ``band``: priority band, lower first (:func:`band_of`). ``user``: fair-share key (user or API key).
    - ``cost``: what fair share counts, tokens (prompt + expected output; >= 1 is used).
    - ``pool``: which candidate set it needs (the driver's ``views(pool)``); ``payload``: the driver's.
    """

    key: Hashable
    band: float = 1.0
    user: str = "-"
    cost: int = 1
    pool: Hashable = None
    payload: Any = None


@dataclass(frozen=True, slots=True)
class Released:
    """A ticket that left the queue: decided (``decision``: what the driver's ``decide`` returned)
    after ``waited_s`` seconds, or expired (``decision`` None). ``queued``: False for a request
    :meth:`RouterQueue.offer` decided at once (it never waited)."""

    ticket: Ticket
    decision: Any
    waited_s: float
    queued: bool = True


class _Entry:
    __slots__ = ("at", "claim", "live", "seq", "ticket", "tried")

    def __init__(self, ticket: Ticket, seq: int, at: float, tried: bool) -> None:
        self.ticket = ticket
        self.seq = seq
        self.at = at
        self.live = True
        self.tried = tried  # routed at least once (a quota was charged then)
        self.claim: tuple[int, int] | None = None  # (instance, new prefill tokens) it waits for


class _Lane:
    """One (band, pool)'s requests: a FCFS deque per user and the fair-queueing tags.

    :meth:`first` is O(log users): a user whose finish tag is at most the lane's virtual time has
    tag V, so those users wait in ``_at_v`` ordered by their head's arrival seq; the others in
    ``_ahead`` ordered by (finish tag, seq). Heap entries carry the user's version and are checked
    when they reach the top (a stale one is dropped and the user re-filed): :meth:`refile` must be
    called whenever a user's head moves to an *earlier* request or the user's finish tag changes;
    a head that died or was taken off only makes the user's key larger, which the check catches."""

    __slots__ = ("_ahead", "_at_v", "_ver", "finish", "users", "vtime")

    def __init__(self) -> None:
        self.users: dict[str, deque[_Entry]] = {}
        self.finish: dict[str, float] = {}  # user -> tag where its last served request ended
        self.vtime = 0.0  # start tag of the request served last
        self._ahead: list[tuple[float, int, str, int]] = []  # (finish tag > V, head seq, user, version)
        self._at_v: list[tuple[int, str, int]] = []  # (head seq, user, version): finish tag <= V
        self._ver: dict[str, int] = {}

    def add(self, user: str, e: _Entry) -> None:
        """Append ``e`` to ``user``'s requests (files the user when ``e`` is its head)."""
        q = self.users.setdefault(user, deque())
        q.append(e)
        if len(q) == 1:
            self.refile(user)

    def put_back(self, user: str, e: _Entry) -> None:
        """``e`` was taken off ``user``'s front and not served: it is the head again."""
        self.users.setdefault(user, deque()).appendleft(e)
        self.refile(user)

    def refile(self, user: str) -> None:
        """File ``user`` under its current head and finish tag (older entries become stale)."""
        e = self.head(user)
        if e is None:
            return
        ver = self._ver[user] = self._ver.get(user, 0) + 1
        f = self.finish.get(user)
        if f is not None and f > self.vtime:
            heapq.heappush(self._ahead, (f, e.seq, user, ver))
        else:
            heapq.heappush(self._at_v, (e.seq, user, ver))

    def head(self, user: str) -> _Entry | None:
        """``user``'s first live entry (dead ones dropped); None, and the user removed, if none."""
        q = self.users.get(user)
        while q and not q[0].live:
            q.popleft()
        if q:
            return q[0]
        if q is not None:
            del self.users[user]
        self._ver.pop(user, None)
        if self.finish.get(user, 0.0) <= self.vtime:
            self.finish.pop(user, None)  # no debt left: forget the user
        return None

    def _current(self, user: str, ver: int, seq: int) -> bool:
        """Whether a heap entry still describes ``user`` (else the user is re-filed)."""
        if self._ver.get(user) != ver:
            return False
        e = self.head(user)
        if e is not None and e.seq == seq:
            return True
        self.refile(user)
        return False

    def first(self) -> tuple[float, int, str] | None:
        """(start tag, arrival seq, user) of the request fair queueing serves next; None if empty."""
        v = self.vtime
        ahead, at_v = self._ahead, self._at_v
        while ahead and ahead[0][0] <= v:  # its finish tag is no longer ahead of V: tag V from now
            _, seq, user, ver = heapq.heappop(ahead)
            if self._ver.get(user) == ver:
                heapq.heappush(at_v, (seq, user, ver))
        while at_v:
            seq, user, ver = at_v[0]
            if self._current(user, ver, seq):
                return (v, seq, user)
            heapq.heappop(at_v)
        while ahead:
            f, seq, user, ver = ahead[0]
            if self._current(user, ver, seq):
                return (f, seq, user)
            heapq.heappop(ahead)
        return None

    def served(self, tag: float, user: str, e: _Entry) -> None:
        """``e`` (already taken off ``user``'s deque) was served at start tag ``tag``."""
        self.vtime = tag
        self.finish[user] = tag + max(1, e.ticket.cost)
        if not self.users[user]:
            del self.users[user]
            self._ver.pop(user, None)
        else:
            self.refile(user)


class RouterQueue:
    """The queue (module docstring). Mutated by :meth:`push`, :meth:`offer`, :meth:`drain`,
    :meth:`cancel` and :meth:`expire`; counters: ``enqueued``, ``dispatched`` (decided after waiting),
    ``expired``, ``cancelled`` and the live ``depth`` per band (back to zero when the queue empties)."""

    def __init__(self, config: QueueConfig) -> None:
        self.config = config.check()
        self._lanes: dict[tuple[float, Hashable], _Lane] = {}
        self._live: dict[Hashable, _Entry] = {}
        self._order: deque[_Entry] = deque()  # push order = deadline order (one TTL)
        self._seq = 0
        self.depth: dict[float, int] = {}
        self.enqueued = 0
        self.dispatched = 0
        self.expired = 0
        self.cancelled = 0
        # pool -> instance -> [requests, new prefill tokens] of the queued requests whose last
        # decision chose that instance (their claims; see the module docstring)
        self._claims: dict[Hashable, dict[int, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def tickets(self) -> Iterator[tuple[Ticket, float]]:
        """The queued tickets with the time each was queued, oldest first."""
        return ((e.ticket, e.at) for e in self._order if e.live)

    # -- in -------------------------------------------------------------------------------------
    def push(self, ticket: Ticket, now: float, tried: bool = False) -> None:
        """Queue ``ticket`` at ``now`` (ValueError if its key is already queued); ``tried``: it was
        routed once already (its quota charged)."""
        if ticket.key in self._live:
            raise ValueError(f"request {ticket.key!r} is already queued")
        self._seq += 1
        e = _Entry(ticket, self._seq, now, tried)
        lane = self._lanes.get((ticket.band, ticket.pool))
        if lane is None:
            lane = self._lanes[(ticket.band, ticket.pool)] = _Lane()
        lane.add(ticket.user, e)
        self._live[ticket.key] = e
        self._order.append(e)
        self.depth[ticket.band] = self.depth.get(ticket.band, 0) + 1
        self.enqueued += 1

    def offer(
        self, ticket: Ticket, now: float, views: ViewsFn, route: RouteFn, commit: CommitFn
    ) -> list[Released]:
        """A request arriving at ``now``. With ``tick_s == 0`` it is routed at once and committed if its
        chosen instance can take it (or it was refused), else queued. The requests already queued
        are not tried again: they could not go at the last drain and an arrival changes no
        instance, so one that waits for its chosen instance never holds back one that prefers an
        open instance (a pass per arrival cost a route per queued request, to no end, under
        overload). With ticks it is queued for the next tick. Returns what left the queue: this
        request, if it never waited (``queued`` False)."""
        if not self.config.tick_s:
            candidates = views(ticket.pool)
            d = route(ticket, self._claimed(ticket.pool, candidates), True)
            if _binds(d, candidates):
                return [Released(ticket, commit(ticket, d), 0.0, queued=False)]
            self.push(ticket, now, tried=True)
            self._claim(self._live[ticket.key], d)
            return []
        self.push(ticket, now)
        return []

    # -- out ------------------------------------------------------------------------------------
    def drain(self, now: float, views: ViewsFn, route: RouteFn, commit: CommitFn) -> list[Released]:
        """Route queued requests in queue order while their pool has an instance that can take one.

        For each: ``route(ticket, views(pool), first)`` (``first``: its first routing, which may
        charge a quota) gives the core's decision over *all* the pool's instances, as they are now;
        if the chosen instance can take it (or the core refused it), ``commit(ticket, decision)``
        carries it out (reserves: the next ``views`` call shows it) and its result is returned in
        :class:`Released`; else the request keeps its place (late binding: it waits for the instance
        the policy prefers instead of joining that engine's queue) and the next one is tried. A pass
        over a pool stops when none of its instances can take a request, or after as many requests
        kept their place as the pool has instances (a bound on the work of one pass; the oldest are
        the ones tried). Expired requests are not dropped here (see :meth:`expire`)."""
        out: list[Released] = []
        blocked: set[Hashable] = set()
        kept: list[tuple[tuple[float, Hashable], str, _Entry]] = []
        skips: dict[Hashable, int] = {}
        while True:
            pick = self._next(blocked)
            if pick is None:
                break
            lane_key, tag, user = pick
            pool = lane_key[1]
            candidates = views(pool)
            if not open_views(candidates):
                blocked.add(pool)
                continue
            lane = self._lanes[lane_key]
            e = lane.users[user].popleft()
            self._unclaim(e)  # it is decided afresh: its own claim must not weigh on its choice
            d = route(e.ticket, self._claimed(pool, candidates), not e.tried)
            e.tried = True
            if not _binds(d, candidates):
                self._claim(e, d)
                kept.append((lane_key, user, e))
                skips[pool] = n = skips.get(pool, 0) + 1
                if n >= len(candidates):
                    blocked.add(pool)
                continue
            lane.served(tag, user, e)
            del self._live[e.ticket.key]
            self._forget(e)
            self.dispatched += 1
            out.append(Released(e.ticket, commit(e.ticket, d), now - e.at))
        for lane_key, user, e in reversed(kept):  # back at the front, in their order
            self._lanes[lane_key].put_back(user, e)
        for key in [k for k, lane in self._lanes.items() if not lane.users]:
            del self._lanes[key]  # the lane's busy period ended: its tags start afresh
        return out

    def cancel(self, key: Hashable) -> Ticket | None:
        """Drop a queued request (its client went away); None if it is not queued."""
        e = self._live.pop(key, None)
        if e is None:
            return None
        self._forget(e)
        self.cancelled += 1
        return e.ticket

    def expire(self, now: float) -> list[Released]:
        """Drop the requests that have waited ``ttl_s`` or more at ``now`` (oldest first)."""
        ttl = self.config.ttl_s
        order = self._order
        out: list[Released] = []
        while order and (not order[0].live or order[0].at + ttl <= now):  # as next_deadline computes it
            e = order.popleft()
            if not e.live:
                continue
            del self._live[e.ticket.key]
            self._forget(e)
            self.expired += 1
            out.append(Released(e.ticket, None, now - e.at))
        return out

    def next_deadline(self) -> float | None:
        """When the oldest queued request expires (seconds), or None if the queue is empty."""
        order = self._order
        while order and not order[0].live:
            order.popleft()
        return order[0].at + self.config.ttl_s if order else None

    def next_tick(self, now: float) -> float:
        """The first tick boundary strictly after ``now`` (``now`` itself when ``tick_s == 0``)."""
        tick = self.config.tick_s
        if not tick:
            return now
        t = (math.floor(now / tick) + 1) * tick
        while t <= now:  # rounding: ``now / tick`` can land just below a whole number
            t += tick
        return t

    # -- internals ------------------------------------------------------------------------------
    def _next(self, blocked: set[Hashable]) -> tuple[tuple[float, Hashable], float, str] | None:
        """The lane, tag and user served next: the lowest band, then the lane whose next request
        arrived first, among lanes whose pool is not ``blocked``; empty lanes are dropped."""
        best: tuple[float, int, tuple[float, Hashable], float, str] | None = None
        for key, lane in self._lanes.items():
            first = lane.first()
            if first is None:
                continue
            if key[1] in blocked:
                continue
            tag, seq, user = first
            cand = (key[0], seq, key, tag, user)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return None
        return best[2], best[3], best[4]

    def _forget(self, e: _Entry) -> None:
        self._unclaim(e)
        e.live = False
        self._count_out(e.ticket.band)

    def claims(self, pool: Hashable = None) -> dict[int, tuple[int, int]]:
        """Per instance index of ``pool``: (queued requests, their new prefill tokens) of the
        requests waiting for it (module docstring, *claims*); instances with none left out."""
        return {i: (c[0], c[1]) for i, c in self._claims.get(pool, {}).items()}

    def _claimed(self, pool: Hashable, views: Sequence[InstanceView]) -> Sequence[InstanceView]:
        """``views`` as the policy sees them under the queue: the claims on each instance added to its
        ``waiting`` and ``queued_prefill_tokens`` (only the claimed views are copied). Saturation is
        judged on ``views`` themselves."""
        claims = self._claims.get(pool)
        if not claims:
            return views
        out = []
        for v in views:
            c = claims.get(v.index)
            if c is not None:
                v = replace(v, waiting=v.waiting + c[0], queued_prefill_tokens=v.queued_prefill_tokens + c[1])
            out.append(v)
        return out

    def _claim(self, e: _Entry, d: Decision) -> None:
        """``e`` keeps its place waiting for ``d``'s instance: it claims that instance's load."""
        chosen = d.instance
        if chosen is None:
            return
        tokens = d.prompt_tokens - d.cached_tokens[d.instances.index(chosen)]
        e.claim = (chosen, tokens if tokens > 0 else 0)
        c = self._claims.setdefault(e.ticket.pool, {}).setdefault(chosen, [0, 0])
        c[0] += 1
        c[1] += e.claim[1]

    def _unclaim(self, e: _Entry) -> None:
        """Withdraw ``e``'s claim, if it holds one (empty entries are dropped)."""
        if e.claim is None:
            return
        chosen, tokens = e.claim
        e.claim = None
        pool = self._claims[e.ticket.pool]
        c = pool[chosen]
        c[0] -= 1
        c[1] -= tokens
        if not c[0]:
            del pool[chosen]
            if not pool:
                del self._claims[e.ticket.pool]

    def _count_out(self, band: float) -> None:
        n = self.depth[band] - 1
        if n:
            self.depth[band] = n
        else:
            del self.depth[band]
