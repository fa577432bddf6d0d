"""The router's own Prometheus metrics, read from its state at scrape time (no per-request cost).

Metric names (all prefixed ``kvroute_``): ``requests_total{outcome}``, ``retries_total``,
``backend_healthy{backend}``, ``backend_waiting{backend}``, ``backend_running{backend}``,
``backend_queued_prefill_tokens{backend}``, ``backend_routed_total{backend}``,
``kv_view_mode{backend,mode}``, ``kv_event_batches_total{backend}``, ``kv_event_gaps_total{backend}``,
``backends{state}`` (how many backends are ``active``, ``draining``, ``removed``),
``tokenizer_cache_hits_total``, ``tokenizer_cache_misses_total``, ``routing_seconds_total``,
``routed_total``, ``upstream_stray_responses_total`` (responses dropped because their echoed
``x-request-id`` was another request's: see :mod:`kvroute.server.wire.h1`; :class:`StrayCollector`,
which the P/D router registers too), ``upstream_connections{backend}`` (the transport's open
connections to each backend, idle in its pool or carrying a request; a removed backend's series
disappears with its connections). Each router owns its own ``CollectorRegistry``. The per-backend
series cover active and draining backends (a draining one's in-flight gauges show its drain); a
removed backend's series disappear.

The ``backend_waiting``/``running``/``queued_prefill_tokens`` gauges are this machine's: summed over
the rows of the in-flight table, i.e. over every worker of ``kvroute serve --workers N`` (not the load
other replicas announced). Every other metric is the answering process's own (one worker's, see
:mod:`kvroute.server.workers`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.prepare.events import EventSubscriber
from kvroute.server.state.backends import STATES
from kvroute.server.state.router import RouterState

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Upper bounds (seconds) of the router queue's wait histogram on /metrics."""

__all__ = ["OUTCOMES", "RouterCollector", "StrayCollector", "render_metrics"]

OUTCOMES = ("ok", "client_errors", "upstream_errors", "cancelled", "unavailable", "drained")
"""``kvroute_requests_total{outcome}``: ``unavailable`` counts 503s (no backend could take the request,
or it came after a shutdown's grace); ``drained`` counts requests still in flight when a shutdown's
drain timed out, which the router ended (see ``RouterServer.shutdown``)."""


class StrayCollector(Collector):
    """The transport's own metrics, read at scrape time: ``kvroute_upstream_stray_responses_total``
    (its ``strays`` count; 0 for a transport that keeps none) and
    ``kvroute_upstream_connections{backend}`` (its ``open_connections()``, base URL → open
    connections; no series for a transport without pools)."""

    def __init__(self, transport: object) -> None:
        self.transport = transport

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "kvroute_upstream_stray_responses",
            "Upstream responses dropped: their echoed x-request-id was another request's",
            value=int(getattr(self.transport, "strays", 0)),
        )
        conns = GaugeMetricFamily(
            "kvroute_upstream_connections",
            "Open connections to the backend (idle in the pool or carrying a request)",
            labels=["backend"],
        )
        count = getattr(self.transport, "open_connections", None)
        for url, n in (count() if callable(count) else {}).items():
            conns.add_metric([url], n)
        yield conns


class RouterCollector(Collector):
    def __init__(
        self, core: RouterState, subscribers: Sequence[EventSubscriber], proxy_stats: object
    ) -> None:
        self.state = core
        self.subscribers = subscribers
        self.proxy_stats = proxy_stats

    def collect(self) -> Iterator[Metric]:
        core = self.state
        c = core.counters
        req = CounterMetricFamily("kvroute_requests", "Requests by outcome", labels=["outcome"])
        for outcome in OUTCOMES:
            req.add_metric([outcome], getattr(c, outcome))
        yield req
        yield CounterMetricFamily("kvroute_retries", "Attempts retried on another backend", value=c.retries)
        fams = {
            "healthy": GaugeMetricFamily("kvroute_backend_healthy", "1 if admitted", labels=["backend"]),
            "waiting": GaugeMetricFamily(
                "kvroute_backend_waiting", "Routed requests before their first byte", labels=["backend"]
            ),
            "running": GaugeMetricFamily(
                "kvroute_backend_running", "Routed requests past their first byte", labels=["backend"]
            ),
            "queued_prefill": GaugeMetricFamily(
                "kvroute_backend_queued_prefill_tokens",
                "Uncached prompt tokens routed, not started",
                labels=["backend"],
            ),
        }
        routed = CounterMetricFamily(
            "kvroute_backend_routed", "Attempts sent to the backend", labels=["backend"]
        )
        mode = GaugeMetricFamily(
            "kvroute_kv_view_mode", "KV view mode of the backend", labels=["backend", "mode"]
        )
        now = core.clock()
        states = GaugeMetricFamily("kvroute_backends", "Backends by membership state", labels=["state"])
        for state in STATES:
            states.add_metric([state], sum(1 for b in core.backends if b.state == state))
        yield states
        for b in core.live_backends():
            waiting, running, prefill, _ = b.table.totals(b.slot, remote=False)  # every worker's
            fams["healthy"].add_metric([b.url], 1.0 if b.healthy else 0.0)
            fams["waiting"].add_metric([b.url], waiting)
            fams["running"].add_metric([b.url], running)
            fams["queued_prefill"].add_metric([b.url], prefill)
            routed.add_metric([b.url], b.requests_total)
            current = core.kv.mode(b.index, now)
            for m in ("approx", "exact", "recovering"):
                mode.add_metric([b.url, m], 1.0 if m == current else 0.0)
        yield from fams.values()
        yield routed
        yield mode
        batches = CounterMetricFamily(
            "kvroute_kv_event_batches", "KV event batches applied", labels=["backend"]
        )
        gaps = CounterMetricFamily("kvroute_kv_event_gaps", "KV event sequence gaps", labels=["backend"])
        partial = CounterMetricFamily(
            "kvroute_kv_event_partial_replays",
            "KV event replays that no longer reached back to the batch asked for (partial view)",
            labels=["backend"],
        )
        for s in self.subscribers:
            url = core.backends[s.backend].url
            batches.add_metric([url], s.batches)
            gaps.add_metric([url], s.gaps)
            partial.add_metric([url], s.partial)
        shortfalls = CounterMetricFamily(
            "kvroute_kv_cached_shortfalls",
            "Responses whose real cached_tokens fell far below the prediction (the backend's view beyond "
            "it was dropped)",
            labels=["backend"],
        )
        for b in core.live_backends():
            shortfalls.add_metric([b.url], core.kv.shortfalls.get(b.index, 0))
        yield batches
        yield gaps
        yield partial
        yield shortfalls
        tok = core.tokenizer
        yield CounterMetricFamily(
            "kvroute_tokenizer_cache_hits", "Per-message token cache hits", value=tok.hits
        )
        yield CounterMetricFamily(
            "kvroute_tokenizer_cache_misses", "Per-message token cache misses", value=tok.misses
        )
        yield CounterMetricFamily(
            "kvroute_routing_seconds",
            "Time spent parsing, tokenizing and routing",
            value=float(getattr(self.proxy_stats, "route_seconds_sum", 0.0)),
        )
        yield CounterMetricFamily(
            "kvroute_routed", "Requests routed", value=int(getattr(self.proxy_stats, "route_count", 0))
        )
        stages = getattr(self.proxy_stats, "stage_seconds", None)
        if stages:
            fam = CounterMetricFamily(
                "kvroute_routing_stage_seconds",
                "Routing time by stage: parse, split (token cache lookups), tokenize, hash, plan",
                labels=["stage"],
            )
            for stage, seconds in stages.items():
                fam.add_metric([stage], float(seconds))
            yield fam
        room = getattr(self.proxy_stats, "waiting", None)
        if room is not None:
            yield from queue_metrics(room)


def queue_metrics(waiting: Any) -> Iterator[Metric]:
    """The router-side queue (:mod:`kvroute.server.stages.wait`): requests waiting per band, the
    wait-time histogram of those that went out, TTL expiries and client disconnects while waiting."""
    from prometheus_client.core import HistogramMetricFamily

    q = waiting.queue
    depth = GaugeMetricFamily(
        "kvroute_router_queue_waiting",
        "Requests waiting in the router-side queue, by priority band (the class's BS weight)",
        labels=["band"],
    )
    for band, n in sorted(q.depth.items()):
        depth.add_metric([f"{band:g}"], n)
    yield depth
    hist = HistogramMetricFamily(
        "kvroute_router_queue_wait_seconds", "Time waited in the router-side queue by requests that went out"
    )
    bounds = [f"{b:g}" for b in WAIT_BUCKETS] + ["+Inf"]
    hist.add_metric([], list(zip(bounds, map(float, waiting.wait_counts), strict=True)), waiting.wait_sum)
    yield hist
    yield CounterMetricFamily(
        "kvroute_router_queue_queued", "Requests that waited in the queue", value=q.enqueued
    )
    yield CounterMetricFamily(
        "kvroute_router_queue_expired", "Requests answered 503 after the queue's TTL", value=q.expired
    )
    yield CounterMetricFamily(
        "kvroute_router_queue_disconnects",
        "Clients that went away while their request waited",
        value=q.cancelled,
    )


def render_metrics(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
