"""The settle stage: a request's outcome into the KV view, the counters and its decision record.

:func:`settle` books a relayed answer; :func:`refuse` a request refused before it was routed (bad
input, no healthy backend, over quota, its request id already in flight); :func:`unavailable` one no
backend took; :func:`late` one a backend took but did not answer in time. Each returns or
books, and calls no earlier stage.
"""

from __future__ import annotations

from aiohttp import web

from kvroute.server.observe.decisions import DecisionRecord
from kvroute.server.observe.observer import REQUEST_ID_HEADER, Observer
from kvroute.server.stages.decide import Plan, QuotaExceeded
from kvroute.server.stages.prepare import Tail
from kvroute.server.stages.wait import QueueExpired
from kvroute.server.state.router import RouterState
from kvroute.server.wire.http import error_response, extract_cached_tokens
from kvroute.server.wire.relay import (
    CANCELLED,
    CLIENT_ERROR,
    DRAINED,
    OK,
    UPSTREAM_ERROR,
    Relayed,
    timed_out,
)
from kvroute.server.wire.validate import ApiError

__all__ = ["late", "refuse", "settle", "unavailable"]


def settle(
    state: RouterState, plan: Plan, index: int, relayed: Relayed, tail: Tail | None, rec: DecisionRecord
) -> None:
    """Book the answer backend ``index`` gave: its outcome's counter; the ``cached_tokens`` its
    response reported correct the approximate KV view (against the plan's prediction); the record
    gets the first byte, status, completeness and real cached tokens."""
    c = state.counters
    outcome = relayed.outcome
    if outcome == OK:
        c.ok += 1
    elif outcome == CLIENT_ERROR:
        c.client_errors += 1
    elif outcome == UPSTREAM_ERROR:
        c.upstream_errors += 1
    elif outcome == CANCELLED:
        c.cancelled += 1
    elif outcome == DRAINED:
        c.drained += 1
    cached = None
    if relayed.end is not None:
        cached = extract_cached_tokens(relayed.end)
        if cached is not None:
            chain = tail.chain if tail is not None and tail.chain is not None else plan.chain
            state.kv.on_usage(index, chain, cached, plan.cached_blocks.get(index, 0), state.clock())
    rec.first_byte = relayed.first_byte
    if relayed.status is not None:
        rec.status = relayed.status
    rec.complete = relayed.complete
    rec.cached_real = cached


def refuse(
    state: RouterState, obs: Observer, err: ApiError, rid: str, path: str, arrival: float
) -> web.Response:
    """The answer to a request refused before it was routed, counted: 503 (no healthy backend)
    with Retry-After; 429 over quota with its own Retry-After, recorded with the core's refusal;
    any other error a rejected client error."""
    counters = state.counters
    if isinstance(err, QueueExpired):  # waited the router-side queue's TTL: 503 with Retry-After
        counters.unavailable += 1
        obs.refused(rid, err.decision, path, arrival, 503)
        resp = error_response(err, err.retry_after)
    elif err.status == 503:
        counters.unavailable += 1
        resp = error_response(err, state.config.retry_after_s)
    elif isinstance(err, QuotaExceeded):  # 429 with Retry-After (token quota)
        counters.client_errors += 1
        if err.decision is not None:
            obs.refused(rid, err.decision, path, arrival, 429)
        resp = error_response(err, err.retry_after)
    else:
        counters.client_errors += 1
        counters.rejected += 1
        resp = error_response(err)
    resp.headers[REQUEST_ID_HEADER] = rid
    return resp


def unavailable(state: RouterState, obs: Observer, rec: DecisionRecord, why: str) -> web.Response:
    """The 503 (with Retry-After) of a request no backend took; ``why``: the last attempt's failure."""
    state.counters.unavailable += 1
    resp = error_response(ApiError(503, why, etype="service_unavailable"), state.config.retry_after_s)
    rec.status = 503
    resp.headers.update(obs.response_headers(rec))
    return resp


def late(state: RouterState, obs: Observer, rec: DecisionRecord, why: str) -> web.Response:
    """The 504 of a request a backend took and did not answer in time (no head within
    ``upstream_timeout_s``); counted as an upstream error, the backend left healthy."""
    state.counters.upstream_errors += 1
    resp = error_response(timed_out(why))
    rec.status = 504
    resp.headers.update(obs.response_headers(rec))
    return resp
