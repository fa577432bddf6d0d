"""The reserve and forward stages: one attempt's share of a backend (:class:`Reservation`), and the
request sent to it through the :class:`~kvroute.server.wire.transport.Transport`.

The routing history (the approximate KV view's "the routed instance now holds the prompt") is
written when the attempt is reserved, except for a backend whose KV view is exact: it needs the
history only as a fallback for a later event gap, so it is written once the request is on its way
(:func:`sent`), off the TTFT path. A P/D request (next) is two forward legs, each its own
reservation, target and body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvroute.server.stages.decide import Plan
from kvroute.server.stages.prepare import Tail
from kvroute.server.state.backends import ACTIVE, Lease
from kvroute.server.state.router import RouterState
from kvroute.server.wire.transport import Transport, UpstreamResponse

__all__ = ["Reservation", "forward", "reserve", "sent", "takes"]


@dataclass(frozen=True, slots=True)
class Reservation:
    """One attempt on backend ``index`` (at ``url``): its ``lease`` on the backend's counters (the
    caller releases it on every path); ``late``: the routing history is written by :func:`sent`;
    ``at``: the router's clock when reserved (seconds)."""

    index: int
    url: str
    lease: Lease
    late: bool
    at: float


def takes(state: RouterState, index: int, retry: bool) -> bool:
    """Backend ``index`` may take an attempt now: not drained or removed since the plan, and healthy
    for a retry (the first choice is tried even if ejected meanwhile)."""
    backend = state.backends[index]
    return backend.state == ACTIVE and (not retry or backend.healthy)


def reserve(state: RouterState, plan: Plan, index: int, tail: Tail | None) -> Reservation:
    """Lease backend ``index`` for ``plan``'s request (+1 waiting, its new prefill queued, its KV
    blocks, pending until its first byte or the next scrape: :class:`Lease`) and write the routing history unless the backend's view is
    exact (module docstring). ``tail``: the request's deferred tokenization, told about the attempt."""
    backend = state.backends[index]
    now = state.clock()
    late = state.kv.mode(index, now) == "exact"
    blocks = -(-plan.prompt_tokens // state.config.block_size)  # its KV once it runs
    if tail is None:
        lease = Lease(backend, plan.new_prefill[index], blocks, now)
        if not late:
            state.kv.on_routed(index, plan.chain, now)
    else:
        known = tail.chain is not None
        lease = Lease(backend, tail.prefill(index) if known else plan.new_prefill[index], blocks, now)
        if not late:
            state.kv.on_routed(index, tail.chain or plan.chain, now)
        tail.routed.append(index)
        tail.lease = lease
    hold = state.routing.dispatched(plan.decision, index, now)  # the policy's own bookkeeping
    if hold is not None:
        lease.attach(hold, state.clock)
    return Reservation(index, backend.url, lease, late, now)


async def forward(
    transport: Transport, target: Reservation, path: str, body: bytes, headers: Mapping[str, str]
) -> UpstreamResponse:
    """POST ``body`` to ``path`` on the reserved backend; raises
    :class:`~kvroute.server.wire.transport.UpstreamConnectError` when no response came (its subclass
    :class:`~kvroute.server.wire.transport.UpstreamTimeoutError` when the backend took the request
    and gave no head in time)."""
    return await transport.send(target.url, "POST", path, body, headers)


def sent(state: RouterState, plan: Plan, target: Reservation, tail: Tail | None) -> None:
    """The request is on its way to ``target``: the deferred tail's timer starts, and a backend
    with an exact view gets its routing history now."""
    if tail is not None:
        tail.arm()
    if target.late:
        chain = plan.chain if tail is None else (tail.chain or plan.chain)
        state.kv.on_routed(target.index, chain, target.at)
