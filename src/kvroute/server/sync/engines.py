"""Engine kinds: what a backend's ``/metrics`` is called, read per backend (vLLM or SGLang).

- **vLLM**: :func:`~kvroute.server.state.backends.parse_vllm_metrics` (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``).
- **SGLang** (``sglang/srt/metrics/collector.py``, ``SchedulerMetricsCollector``):
  ``sglang:num_running_reqs`` and ``sglang:num_queue_reqs`` (requests), ``sglang:token_usage`` (share
  of the KV pool in use, 0..1), ``sglang:max_total_num_tokens`` (the pool's size in tokens: the KV
  capacity in the router's blocks is that over the router's block size). Several label sets (data
  parallel ranks) are summed; the usage is their maximum.

A backend's engine is its spec's ``engine`` (``vllm`` or ``sglang``), or, when unset, detected from
the names its first useful scrape carries (:func:`parse_metrics` returns the kind it read). The router
scrapes one filtered page naming both engines' samples (:data:`SCRAPE_PATH`): each engine renders
only its own.
"""

from __future__ import annotations

import re

from kvroute.server.state.backends import ScrapedMetrics, parse_vllm_metrics

__all__ = ["ENGINES", "SCRAPE_PATH", "parse_metrics", "parse_sglang_metrics"]

ENGINES = ("vllm", "sglang")
"""Engine kinds a backend may declare (``engine:`` in the config)."""

_VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
)
_SGLANG_NAMES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:token_usage",
    "sglang:max_total_num_tokens",
)

SCRAPE_PATH = "/metrics?" + "&".join("name%5B%5D=" + n for n in (*_VLLM_NAMES, *_SGLANG_NAMES))
"""``/metrics`` restricted (prometheus_client's ``name[]`` filter, which vLLM and SGLang both serve)
to the samples either parser reads; a server that ignores the query sends its whole page."""

_SGL_LINE = re.compile(
    rb"(?m)^sglang:(num_running_reqs|num_queue_reqs|token_usage|max_total_num_tokens)(?:\{[^}\n]*\})?"
    rb"[ \t]+([^ \t\r\n]+)"
)


def parse_sglang_metrics(text: bytes, at: float, block_size: int) -> ScrapedMetrics | None:
    """SGLang's Prometheus text → load; None when it has neither running nor queued gauges.
    ``at``: the router's monotonic clock, seconds; ``block_size``: the router's, tokens."""
    running = waiting = 0.0
    usage = 0.0
    pool_tokens = 0.0
    seen = False
    for m in _SGL_LINE.finditer(text):
        try:
            v = float(m.group(2))
        except ValueError:
            continue
        if v != v:  # NaN
            continue
        name = m.group(1)
        if name == b"num_running_reqs":
            running += v
            seen = True
        elif name == b"num_queue_reqs":
            waiting += v
            seen = True
        elif name == b"token_usage":
            usage = max(usage, v)
        else:
            pool_tokens += v
    if not seen:
        return None
    usage = min(max(usage, 0.0), 1.0)
    blocks = max(int(pool_tokens) // block_size, 0)
    return ScrapedMetrics(max(int(running), 0), max(int(waiting), 0), usage, at, blocks)


def parse_metrics(
    text: bytes, at: float, engine: str | None, block_size: int
) -> tuple[ScrapedMetrics | None, str | None]:
    """Parse a scrape as ``engine``'s (None: whichever engine's names it carries). Returns the load
    (None when the page has no load gauges of that engine) and the engine it was read as."""
    if engine == "sglang":
        return parse_sglang_metrics(text, at, block_size), "sglang"
    parsed = parse_vllm_metrics(text, at)
    if parsed is not None or engine == "vllm":
        return parsed, "vllm" if parsed is not None or engine == "vllm" else None
    parsed = parse_sglang_metrics(text, at, block_size)
    return parsed, "sglang" if parsed is not None else None
