"""Prometheus metrics with vLLM's names (or SGLang's), in a registry owned by one emulated engine.

State gauges and prefix-cache counters are read from :meth:`EngineModel.stats` at scrape time;
latency histograms are observed as outputs arrive. Latencies are in **model seconds** (what the
emulated GPU took: wall seconds × time scale), so a scrape at any ``--time-scale`` reads like a real
engine's. Every series carries the label ``model_name``, and in vLLM's flavor also ``engine``
(vLLM 0.32's engine index: ``"0"``, one engine core per server).

``flavor="sglang"`` serves SGLang's names instead (``sglang/srt/metrics/collector.py``):
``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``,
``sglang:num_used_tokens``, ``sglang:max_total_num_tokens``, ``sglang:cache_hit_rate``, the histograms
``sglang:time_to_first_token_seconds``, ``sglang:inter_token_latency_seconds``,
``sglang:e2e_request_latency_seconds`` and the counters ``sglang:prompt_tokens_total``,
``sglang:generation_tokens_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.engine.types import EngineStats

__all__ = ["CONTENT_TYPE", "EngineMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE = "0"
"""vLLM's ``engine`` label: the index of the server's engine core (one per server here)."""

# vLLM's bucket boundaries (seconds)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


class _SglangStatsCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str, block_size: int) -> None:
        self._stats = stats
        self._model = model_name
        self._bs = block_size

    def collect(self) -> Iterator[Metric]:
        s = self._stats()

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], value)
            return g

        hit = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield gauge("sglang:num_running_reqs", "The number of running requests.", s.running)
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.waiting)
        yield gauge("sglang:token_usage", "The token usage.", s.kv_usage)
        yield gauge("sglang:num_used_tokens", "The number of used tokens.", s.used_blocks * self._bs)
        yield gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            s.num_kv_blocks * self._bs,
        )
        yield gauge("sglang:cache_hit_rate", "The prefix cache hit rate.", hit)


class _StatsCollector(Collector):
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        model_name: str,
        external: bool = False,
        block_size: int = 16,
    ) -> None:
        self._stats = stats
        self._model = model_name
        self._external = external
        self._bs = block_size

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        lbl = ["engine", "model_name"]
        val = [ENGINE, self._model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric(val, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=lbl)
            c.add_metric(val, value)
            return c

        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", s.running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage)
        yield gauge(
            "vllm:gpu_cache_usage_perc", "GPU KV-cache usage (older name). 1 means 100 percent.", s.kv_usage
        )
        # vLLM's CacheConfig as an info gauge (value 1; no model_name label); routers read
        # block_size and num_gpu_blocks from it
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=["block_size", "num_gpu_blocks"],
        )
        info.add_metric([str(self._bs), str(s.num_kv_blocks)], 1.0)
        yield info
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_query_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hit_tokens,
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.preemptions
        )
        # prompt tokens by where their KV came from (vLLM's PromptTokenStats; external: a KV connector)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            labels=["engine", "model_name", "source"],
        )
        local = s.prefix_query_tokens - s.prefix_hit_tokens - s.external_hit_tokens
        by_source.add_metric([ENGINE, self._model, "local_compute"], local)
        by_source.add_metric([ENGINE, self._model, "local_cache_hit"], s.prefix_hit_tokens)
        by_source.add_metric([ENGINE, self._model, "external_kv_transfer"], s.external_hit_tokens)
        yield by_source
        if self._external:  # vLLM registers these only with a KV connector
            yield counter(
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
                s.external_query_tokens,
            )
            yield counter(
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
                s.external_hit_tokens,
            )


class EngineMetrics:
    """One engine's metrics. ``observe_*`` take **model seconds**; mutates only its registry.
    ``flavor``: ``"vllm"`` or ``"sglang"`` (whose names to serve); ``block_size``: tokens per block
    (SGLang's gauges count tokens)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats],
        flavor: str = "vllm",
        block_size: int = 16,
        external: bool = False,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model_name
        r = self.registry
        if flavor == "sglang":
            r.register(_SglangStatsCollector(stats, model_name, block_size))
        else:
            r.register(_StatsCollector(stats, model_name, external, block_size))
        prefix = "sglang" if flavor == "sglang" else "vllm"
        # vLLM labels its series with the engine index too; SGLang does not
        names, values = (
            (["model_name"], [model_name])
            if flavor == "sglang"
            else (["engine", "model_name"], [ENGINE, model_name])
        )
        self._labels = values

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Any:
            return Histogram(f"{prefix}:{name}", doc, names, buckets=buckets, registry=r).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(f"{prefix}:{name}", doc, names, registry=r).labels(*values)

        self._ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self._e2e = hist(
            "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", E2E_BUCKETS
        )
        self._prompt = counter("prompt_tokens", "Number of prefill tokens processed.")
        self._gen = counter("generation_tokens", "Number of generation tokens processed.")
        # vLLM only: the older name of the inter-token latency, and finished requests by reason
        self._tpot: Any = None
        self._success: Counter | None = None
        if flavor != "sglang":
            self._tpot = hist(
                "time_per_output_token_seconds",
                "Histogram of time per output token in seconds (older name of the inter-token latency).",
                ITL_BUCKETS,
            )
            self._success = Counter(
                "vllm:request_success",
                "Count of successfully processed requests.",
                ["engine", "model_name", "finished_reason"],
                registry=r,
            )

    def observe_first_token(self, ttft_s: float, prompt_tokens: int) -> None:
        self._ttft.observe(ttft_s)
        self._prompt.inc(prompt_tokens)
        self._gen.inc()

    def observe_tokens(self, gap_s: float, count: int) -> None:
        """``count`` more output tokens, ``gap_s`` model seconds apart on average."""
        for _ in range(count):
            self._itl.observe(gap_s)
            if self._tpot is not None:
                self._tpot.observe(gap_s)
        self._gen.inc(count)

    def observe_finished(self, e2e_s: float, reason: str = "length") -> None:
        self._e2e.observe(e2e_s)
        if self._success is not None:
            self._success.labels(*self._labels, reason).inc()

    def render(self, names: Sequence[str] = ()) -> bytes:
        """The Prometheus text exposition of every metric, or only of the samples named in ``names``
        (prometheus_client's ``name[]`` filter, as vLLM's ``/metrics?name[]=...`` serves it)."""
        if names:
            return generate_latest(self.registry.restricted_registry(names))
        return generate_latest(self.registry)
