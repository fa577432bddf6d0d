"""Seeing the router's decisions: request ids, decision records, latency and prediction metrics,
explanation headers, the JSON access log, shadow metrics and traces. The proxy calls
:class:`Observer` at three points of a request: :meth:`Observer.planned` (routed),
``DecisionRecord.attempt`` / :meth:`Observer.attempt` (each attempt sent), :meth:`Observer.finish`
(response ended, whatever the outcome).

Always on (a few µs a request, see ``benchmarks/bench_stages.py``): the request id, the decision
record in the ring buffer (:mod:`kvroute.server.observe.decisions`), the histograms below. Opt-in:
explanation headers (``--explain`` or the request header ``x-kvroute-explain: 1``), the access log
(``--access-log FILE``), shadow policies (``--shadow``), traces (``--otel``).

Request ids: the client's ``x-request-id`` when it sent a usable one (1-128 printable ASCII
characters), else a new random one (32 hex digits); it is sent to the backend and back to the client
as ``x-request-id``, and appears in the decision records, the access log, log lines and traces.

Explanation headers: ``x-kvroute-backend`` (the URL that answered), ``x-kvroute-policy``,
``x-kvroute-reason`` (as a decision record's ``reason``), ``x-kvroute-score`` (the policy's score of
that backend), ``x-kvroute-cached-tokens`` (predicted cached prompt tokens there),
``x-kvroute-prompt-tokens``, ``x-kvroute-retries`` and ``x-kvroute-engine-block-size`` (that
backend's block size as the router knows it, tokens: predicted hits are whole engine blocks). They reveal backend URLs to the client.

Metrics (on the router's own registry; ``{backend}`` is the URL, ``{policy}`` the decision's policy
name, e.g. ``lmetric`` or ``lmetric+hotspot``):

- ``kvroute_cached_tokens_error{backend}``: histogram of real − expected cached prompt tokens
  (tokens; negative: the router expected more cache than the engine had). Its buckets are signed,
  so, by Prometheus' rule, it has no ``_sum``/``_count``: the count is the ``le="+Inf"`` bucket and
  the sum is ``real_total − expected_total`` of the two counters that go with it,
  ``kvroute_cached_tokens_expected_total{backend}`` and ``kvroute_cached_tokens_real_total{backend}``
  over the same requests (those whose response reported ``cached_tokens``), and
  ``kvroute_prompt_tokens_total{backend}``: their prompt tokens (the router's count), so that
  ``real / prompt`` is the backend's observed KV hit rate.
- ``kvroute_request_routing_seconds{backend,policy}``: parse + tokenize + plan;
  ``kvroute_request_added_ttfb_seconds{backend,policy}``: from arrival to sending the attempt that
  answered (the router's share of the time to first byte); ``kvroute_request_ttft_seconds`` (arrival
  to the first upstream byte) and ``kvroute_request_e2e_seconds`` (arrival to the response's end),
  both ``{backend,policy}``. Requests that got no backend response are not observed.
- ``kvroute_shadow_decisions_total{shadow}``, ``kvroute_shadow_agreements_total{shadow}``,
  ``kvroute_shadow_mean_score_diff{shadow}``, ``kvroute_shadow_mean_cached_diff_tokens{shadow}``
  (see :mod:`kvroute.routing.shadow`).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import IO, Any

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvroute.errors import UserError
from kvroute.routing.core import Decision
from kvroute.routing.shadow import ShadowPick, Shadows
from kvroute.server.observe.decisions import DecisionLog, DecisionRecord
from kvroute.server.observe.tracing import Tracing
from kvroute.server.state.router import RouterState
from kvroute.server.wire.http import REQUEST_ID_HEADER

__all__ = ["EXPLAIN_HEADER", "REQUEST_ID_HEADER", "Observer", "request_id"]

log = logging.getLogger("kvroute.server")

EXPLAIN_HEADER = "x-kvroute-explain"
_TRUE = frozenset({"1", "true", "yes", "on"})

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
"""Seconds: from 100 µs (routing) to minutes (long generations)."""

ERROR_BUCKETS = tuple(sorted({s * v for v in (0, 16, 64, 256, 1024, 4096, 16384, 65536) for s in (-1, 1)}))
"""Tokens, signed: real − expected cached tokens (0 is its own bucket edge)."""


def request_id(headers: Mapping[str, str]) -> str:
    """The client's ``x-request-id`` when usable (module docstring), else a new random one."""
    given = headers.get(REQUEST_ID_HEADER)
    if given and len(given) <= 128 and given.isascii() and given.isprintable():
        return given
    return os.urandom(16).hex()


class _ShadowCollector(Collector):
    def __init__(self, shadows: Shadows) -> None:
        self.shadows = shadows

    def collect(self) -> Iterator[Metric]:
        n = CounterMetricFamily(
            "kvroute_shadow_decisions", "Requests a shadow policy was asked about", labels=["shadow"]
        )
        agree = CounterMetricFamily(
            "kvroute_shadow_agreements", "Requests where the shadow chose the real backend", labels=["shadow"]
        )
        score = GaugeMetricFamily(
            "kvroute_shadow_mean_score_diff",
            "Mean P-token x (BS+1) of the shadow's choice minus the real choice's",
            labels=["shadow"],
        )
        cached = GaugeMetricFamily(
            "kvroute_shadow_mean_cached_diff_tokens",
            "Mean predicted cached tokens of the shadow's choice minus the real choice's",
            labels=["shadow"],
        )
        for name, t in self.shadows.tallies.items():
            s = t.summary()
            n.add_metric([name], t.decisions)
            agree.add_metric([name], t.agreements)
            score.add_metric([name], s["mean_score_diff"])
            cached.add_metric([name], s["mean_cached_diff"])
        yield from (n, agree, score, cached)


class Observer:
    """Per-request observation for one router (module docstring). Owns the decision log, the
    histograms (registered on ``registry``), the access log file and the tracer; ``tracer_provider``
    replaces the one ``--otel`` would build (tests). Single event loop; :meth:`close` at shutdown."""

    def __init__(self, core: RouterState, registry: CollectorRegistry, tracer_provider: Any = None) -> None:
        self.waiting: Any = None  # the router-side queue (kvroute.server.stages.wait), set by the Proxy
        cfg = core.config
        self.state = core
        self.explain_all = cfg.explain
        self.log = DecisionLog(cfg.decisions_kept)
        # per (backend index, policy): routing, added TTFB, TTFT, end-to-end (seconds); per backend:
        # the cached-token error. Exported at scrape time for live backends only (_HistCollector).
        self.latency: dict[tuple[int, str], tuple[_Hist, _Hist, _Hist, _Hist]] = {}
        self.errors: dict[int, _Hist] = {}
        # expected/real cached tokens per backend index (requests whose response reported them)
        self.cached_expected: dict[int, int] = {}
        self.cached_real: dict[int, int] = {}
        self.prompt_tokens: dict[int, int] = {}  # prompt tokens of those same requests
        registry.register(_HistCollector(self))
        shadows = core.shadows
        if shadows is not None:
            registry.register(_ShadowCollector(shadows))
        self._access: IO[str] | None = None
        self._own_access = False
        if cfg.access_log is not None:
            self._open_access(cfg.access_log)
        self._own_provider = None
        if tracer_provider is None and cfg.otel:
            from kvroute.server.observe.tracing import make_provider

            tracer_provider = self._own_provider = make_provider()
        self.tracing = Tracing(tracer_provider) if tracer_provider is not None else None

    def _open_access(self, path: str) -> None:
        if path == "-":
            self._access = sys.stdout
            return
        try:
            self._access = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - closed in close()
        except OSError as exc:
            raise UserError(f"cannot open the access log {path}: {exc.strerror}") from None
        self._own_access = True

    def close(self) -> None:
        """Close the access log and flush the traces of a provider built here."""
        if self._access is not None and self._own_access:
            self._access.close()
        self._access = None
        if self._own_provider is not None:
            self._own_provider.shutdown()
            self._own_provider = None

    # ---- the request's path ----------------------------------------------------------------------

    def planned(
        self,
        rid: str,
        decision: Decision,
        shadow: tuple[ShadowPick, ...],
        path: str,
        headers: Mapping[str, str],
        arrival: float,
        routing_s: float,
    ) -> DecisionRecord:
        """A request was routed: its record (kept in the ring buffer), with its request span when
        traced. ``decision``: the routing core's; ``shadow``: the shadow policies' picks for the same
        request; ``arrival``: ``time.perf_counter()`` when it arrived; ``routing_s``: seconds routing."""
        explain = self.explain_all
        if not explain:
            flag = headers.get(EXPLAIN_HEADER)
            explain = flag is not None and flag.strip().lower() in _TRUE
        rec = DecisionRecord(rid, decision, path, arrival, routing_s, shadow, explain)
        self.log.append(rec)
        if self.tracing is not None:
            start_ns = time.time_ns() - int((time.perf_counter() - arrival) * 1e9)
            span = self.tracing.request_span(f"POST {path}", headers, start_ns)
            d = decision
            span.set_attributes(
                {
                    "kvroute.request_id": rid,
                    "kvroute.policy": d.policy,
                    "kvroute.prompt_tokens": d.prompt_tokens,
                    "kvroute.routing_ms": routing_s * 1e3,
                }
            )
            rec.spans = [span, None]
        return rec

    def refused(self, rid: str, plan_decision: Any, path: str, arrival: float, status: int) -> None:
        """A request the core refused (token quota): recorded with its outcome."""
        now = time.perf_counter()
        rec = DecisionRecord(rid, plan_decision, path, arrival, now - arrival)
        rec.status = status
        rec.end = now
        self.log.append(rec)
        self._write_access(rec)

    def attempt(
        self, rec: DecisionRecord, backend: int, url: str, retry: bool, headers: dict[str, str]
    ) -> None:
        """An attempt goes to ``backend`` (``url``) now; with tracing its child span starts and its
        ``traceparent`` goes into ``headers`` (the upstream request's, mutated)."""
        rec.attempt(backend, retry, time.perf_counter())
        spans = rec.spans
        if spans is not None and self.tracing is not None:
            if spans[1] is not None:  # the previous attempt failed
                self.tracing.fail(spans[1], "retried")
            spans[1] = self.tracing.upstream_span(spans[0], url, retry, headers)

    def response_headers(self, rec: DecisionRecord) -> dict[str, str]:
        """The headers to add to the client's response: ``x-request-id``, and the explanation when
        asked for (module docstring)."""
        out = {REQUEST_ID_HEADER: rec.request_id}
        if rec.explain:
            d = rec.decision
            b = rec.backend
            score = rec.score()
            out.update(
                {
                    "x-kvroute-backend": self.state.backends[b].url if b is not None else "",
                    "x-kvroute-policy": d.policy,
                    "x-kvroute-reason": rec.reason,
                    "x-kvroute-score": "" if score is None else f"{score:.6g}",
                    "x-kvroute-cached-tokens": str(rec.expected_cached),
                    "x-kvroute-prompt-tokens": str(d.prompt_tokens),
                    "x-kvroute-retries": str(rec.retries),
                    "x-kvroute-engine-block-size": ""
                    if b is None
                    else str(self.state.kv.engine_block_size(b)),
                }
            )
        return out

    def finish(self, rec: DecisionRecord) -> None:
        """The response ended (or the client went away, or no backend answered): the outcome goes into
        the record, the histograms, the access log and the spans."""
        now = rec.end = time.perf_counter()
        b = rec.backend
        if b is not None and rec.first_byte:
            key = (b, rec.decision.policy)
            hists = self.latency.get(key)
            if hists is None:
                lb = LATENCY_BUCKETS
                hists = self.latency[key] = (_Hist(lb), _Hist(lb), _Hist(lb), _Hist(lb))
            arrival = rec.arrival
            hists[0].observe(rec.routing_s)
            hists[1].observe(rec.sent - arrival)
            hists[2].observe(rec.first_byte - arrival)
            hists[3].observe(now - arrival)
            real = rec.cached_real
            if real is not None:
                expected = rec.expected_cached
                err = self.errors.get(b)
                if err is None:
                    err = self.errors[b] = _Hist(ERROR_BUCKETS)
                err.observe(real - expected)
                self.cached_expected[b] = self.cached_expected.get(b, 0) + expected
                self.cached_real[b] = self.cached_real.get(b, 0) + real
                self.prompt_tokens[b] = self.prompt_tokens.get(b, 0) + rec.decision.prompt_tokens
        if self._access is not None:
            self._write_access(rec)
        if rec.spans is not None:
            self._end_spans(rec)

    def _end_spans(self, rec: DecisionRecord) -> None:
        assert self.tracing is not None
        server, upstream = rec.spans
        b = rec.backend
        attrs: dict[str, Any] = {
            "kvroute.reason": rec.reason,
            "kvroute.retries": rec.retries,
            "kvroute.cached_tokens_expected": rec.expected_cached,
        }
        if b is not None:
            attrs["kvroute.backend"] = self.state.backends[b].url
            score = rec.score()
            if score is not None:
                attrs["kvroute.score"] = score
        if rec.cached_real is not None:
            attrs["kvroute.cached_tokens"] = rec.cached_real
        if rec.status is not None:
            attrs["http.response.status_code"] = rec.status
        server.set_attributes(attrs)
        if upstream is not None:
            if rec.status is not None:
                upstream.set_attribute("http.response.status_code", rec.status)
            if rec.complete:
                upstream.end()
            else:
                self.tracing.fail(upstream, "incomplete")
        if rec.complete:
            server.end()
        else:
            self.tracing.fail(server, "incomplete" if rec.status is not None else "no response")
        rec.spans = None

    def _write_access(self, rec: DecisionRecord) -> None:
        out = self._access
        if out is None:
            return
        b = rec.backend
        line = {
            "time": rec.wall,
            "request_id": rec.request_id,
            "path": rec.path,
            "status": rec.status,
            "complete": rec.complete,
            "backend": self.state.backends[b].url if b is not None else None,
            "policy": rec.decision.policy,
            "reason": rec.reason,
            "retries": rec.retries,
            "prompt_tokens": rec.decision.prompt_tokens,
            "cached_tokens_expected": rec.expected_cached,
            "cached_tokens": rec.cached_real,
            "routing_ms": round(rec.routing_s * 1e3, 3),
            "ttft_ms": round((rec.first_byte - rec.arrival) * 1e3, 3) if rec.first_byte else None,
            "e2e_ms": round((rec.end - rec.arrival) * 1e3, 3),
        }
        try:
            out.write(orjson.dumps(line).decode() + "\n")
        except (OSError, ValueError) as exc:  # a full disk or closed stream must not fail requests
            log.warning("access log write failed: %r", exc)


class _Hist:
    """A histogram's counts (``counts[k]``: observations ≤ ``bounds[k]`` and above the previous
    bound; the last one: above every bound) and sum. Cheaper than a labelled prometheus_client
    histogram: no lock, no label lookup (one event loop observes)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs, ending with ``+Inf``."""
        out = []
        acc = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            acc += n
            out.append((floatToGoString(bound), float(acc)))
        return out


_LATENCY = (
    ("kvroute_request_routing_seconds", "Parse, tokenize and plan time of routed requests"),
    (
        "kvroute_request_added_ttfb_seconds",
        "Arrival to sending the attempt that answered: the router's share of the first byte",
    ),
    ("kvroute_request_ttft_seconds", "Arrival to the first upstream byte"),
    ("kvroute_request_e2e_seconds", "Arrival to the end of the response"),
)


class _HistCollector(Collector):
    """The observer's histograms and cached-token counters (module docstring), for the backends not
    removed (a removed backend's series disappear, as the router's other per-backend series do)."""

    def __init__(self, obs: Observer) -> None:
        self.obs = obs

    def collect(self) -> Iterator[Metric]:
        obs = self.obs
        live = {b.index: b.url for b in obs.state.live_backends()}
        fams = [HistogramMetricFamily(n, doc, labels=["backend", "policy"]) for n, doc in _LATENCY]
        for (b, policy), hists in sorted(obs.latency.items()):
            url = live.get(b)
            if url is not None:
                for fam, h in zip(fams, hists, strict=True):
                    fam.add_metric([url, policy], h.buckets(), h.total)
        yield from fams
        err = HistogramMetricFamily(
            "kvroute_cached_tokens_error",
            "Real minus expected cached prompt tokens of the backend that answered",
            labels=["backend"],
        )
        exp = CounterMetricFamily(
            "kvroute_cached_tokens_expected",
            "Predicted cached prompt tokens of requests whose response reported cached_tokens",
            labels=["backend"],
        )
        real = CounterMetricFamily(
            "kvroute_cached_tokens_real",
            "Cached prompt tokens the engine reported (usage.prompt_tokens_details.cached_tokens)",
            labels=["backend"],
        )
        prompt = CounterMetricFamily(
            "kvroute_prompt_tokens",
            "Prompt tokens (router's count) of requests whose response reported cached_tokens",
            labels=["backend"],
        )
        for b, h in sorted(obs.errors.items()):
            url = live.get(b)
            if url is not None:
                err.add_metric([url], h.buckets(), h.total)
                exp.add_metric([url], obs.cached_expected.get(b, 0))
                real.add_metric([url], obs.cached_real.get(b, 0))
                prompt.add_metric([url], obs.prompt_tokens.get(b, 0))
        yield from (err, exp, real, prompt)
