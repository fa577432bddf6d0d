"""Prometheus view of a :class:`~kvroute.routing.guarded.Guarded`, read at scrape time.

Metric names (prefix ``kvroute_``), each present only when its feature is on:

- hot spots: ``hotspot_alarms_total``, ``hotspot_mitigations_total``, ``hotspot_clears_total``,
  ``hotspot_mitigated_requests_total``, ``hotspot_active_alarms``, ``hotspot_active_mitigations``;
- score: ``decision_score`` (histogram of the chosen backend's P-token × (BS + 1), tokens × requests),
  ``decision_score_rolling_p95``, ``decision_score_alerts_total``, ``decision_score_alerting`` (1 while
  decisions stay above the rolling p95);
- cold start: ``cold_start_warming{backend}``, ``cold_start_warmups_total``, ``cold_start_preloads_total``;
- limits and classes: ``quota_rejected_total``, ``feature_decisions_total{kind}`` (``spot_excluded``,
  ``p_token_capped``, ``warming_capped``, ``load_reweighted``, ``mitigated``, ``class:<name>``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.routing.guarded import Guarded

__all__ = ["FeatureCollector"]

_DECISION_KINDS = ("spot_excluded", "p_token_capped", "warming_capped", "load_reweighted", "mitigated")


class FeatureCollector(Collector):
    """``backends`` lists ``(index, label)`` of the router's backends, or is a function returning
    them at each scrape (backends that come and go); ``clock`` gives ``now``."""

    def __init__(
        self,
        guard: Guarded,
        backends: Sequence[tuple[int, str]] | Callable[[], Sequence[tuple[int, str]]],
        clock: Callable[[], float],
    ) -> None:
        self.guard = guard
        self.backends = backends
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        g = self.guard
        det = g.hotspot
        if det is not None:
            for name, value, doc in (
                ("alarms", det.alarms, "Hot-spot alarms raised (stage 1)"),
                ("mitigations", det.mitigations, "Hot-spot mitigations started (stage 2)"),
                ("clears", det.clears, "Hot-spot alarms cleared"),
                ("mitigated_requests", det.mitigated_requests, "Requests routed by load alone"),
            ):
                yield CounterMetricFamily(f"kvroute_hotspot_{name}", doc, value=value)
            yield GaugeMetricFamily(
                "kvroute_hotspot_active_alarms", "Classes in alarm", value=det.active_alarms
            )
            yield GaugeMetricFamily(
                "kvroute_hotspot_active_mitigations", "Classes under mitigation", value=det.active_mitigations
            )
        mon = g.monitor
        if mon is not None:
            buckets = [(("+Inf" if b == float("inf") else repr(float(b))), c) for b, c in mon.cumulative()]
            yield HistogramMetricFamily(
                "kvroute_decision_score",
                "P-token x (BS + 1) of the chosen backend, per routing decision",
                buckets=buckets,
                sum_value=mon.sum,
            )
            p95 = mon.threshold if mon.threshold != float("inf") else 0.0
            yield GaugeMetricFamily(
                "kvroute_decision_score_rolling_p95", "Rolling p95 of the score", value=p95
            )
            yield CounterMetricFamily(
                "kvroute_decision_score_alerts", "Persistent above-p95 episodes", value=mon.alerts
            )
            yield GaugeMetricFamily(
                "kvroute_decision_score_alerting",
                "1 while decisions stay above the p95",
                value=float(mon.alerting),
            )
        if g.warmup is not None:
            now = self.clock()
            warming = GaugeMetricFamily("kvroute_cold_start_warming", "1 while warming", labels=["backend"])
            backends = self.backends() if callable(self.backends) else self.backends
            for index, label in backends:
                warming.add_metric([label], 1.0 if g.warmup.warming(index, now) else 0.0)
            yield warming
            yield CounterMetricFamily(
                "kvroute_cold_start_warmups", "Warm-ups started", value=g.counts["warmups"]
            )
            yield CounterMetricFamily(
                "kvroute_cold_start_preloads", "Preload requests issued", value=g.counts["preloads"]
            )
        if g.quota is not None:
            yield CounterMetricFamily(
                "kvroute_quota_rejected",
                "Requests rejected over quota (429)",
                value=g.counts["quota_rejected"],
            )
        kinds = CounterMetricFamily(
            "kvroute_feature_decisions", "Decisions a feature changed or classified", labels=["kind"]
        )
        for kind in sorted({*_DECISION_KINDS, *(k for k in g.counts if k.startswith("class:"))}):
            kinds.add_metric([kind], g.counts[kind])
        yield kinds
