"""What the live dashboard shows, as JSON-able data, built only when the page asks
(``GET /debug/dashboard``, see :mod:`kvroute.server.observe.dashboard`): nothing here runs per request.

:func:`dashboard_state` extends :func:`kvroute.server.observe.decisions.router_state` (policy, counters,
each backend's load, queued prefill, health and KV view mode, the latest decisions) with::

    "time": Unix seconds,
    "features": ["hotspot", "monitor", ...],
    "requests_total": every outcome of kvroute_requests_total, summed,
    "rate": {"window_s": 60, "per_second": [n, ...] (oldest first, whole seconds before now),
             "recent_s": 10, "decisions_per_s": mean over the last recent_s seconds},
    "backends": [{... router_state's fields ...,
                  "reported_requests": responses that reported cached_tokens,
                  "prompt_tokens": their prompt tokens (router's count), "cached_tokens": the
                  engine's cached tokens over them, "hit_rate": cached / prompt (null: none yet),
                  "cached_error_mean": mean real − expected cached tokens (null: none yet),
                  "ttft_ms_mean", "e2e_ms_mean": over responses (null: none yet),
                  "warming": true while cold start warms it (false when that feature is off)}],
    "score": null (score monitor off) | {"count", "mean", "max", "p95" (null until the first
             refresh), "quantile", "alerting", "alerts", "persist",
             "buckets": [{"le": upper bound (null: +Inf), "count": decisions in that bucket}, ...]
                        (from the first to the last non-empty bucket),
             "recent_alerts": [{"age_s", "score", "threshold"}, ...] newest first},
    "hotspot": null (hot-spot feature off) | {"alarms", "mitigations", "clears",
               "mitigated_requests", "active": [{"key": "0x…", "share", "holders", "instances",
               "mitigating"}], "events": [{"age_s", "kind", "key", "share", "holders",
               "instances"}, ...] newest first}

The counters match the router's /metrics at the same moment: ``backends[i].requests_total`` is
``kvroute_backend_routed_total``, ``cached_tokens``/``prompt_tokens`` are
``kvroute_cached_tokens_real_total``/``kvroute_prompt_tokens_total``, ``score`` is
``kvroute_decision_score`` and its gauges, ``hotspot`` the ``kvroute_hotspot_*`` series.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvroute.features.hotspot import HotspotDetector
from kvroute.features.monitor import ScoreMonitor
from kvroute.server.observe.decisions import router_state
from kvroute.server.observe.exporter import OUTCOMES
from kvroute.server.observe.persecond import PerSecond

if TYPE_CHECKING:
    from kvroute.server.observe.observer import Observer

__all__ = ["dashboard_state", "hit_rate", "hotspot_view", "rate_view", "score_view"]

EVENTS_SHOWN = 10
"""Hot-spot events and score alerts listed (the newest)."""


def rate_view(counts: PerSecond, now: float, window_s: int = 60, recent_s: int = 10) -> dict[str, Any]:
    """Events per whole second over the ``window_s`` seconds before ``now`` (Unix seconds) and their
    mean over the last ``recent_s`` (events per second). ``recent_s`` ≤ ``window_s``."""
    series = counts.series(now, window_s)
    recent = series[-recent_s:]
    return {
        "window_s": window_s,
        "per_second": series,
        "recent_s": recent_s,
        "decisions_per_s": sum(recent) / recent_s,
    }


def hit_rate(cached: int, prompt: int) -> float | None:
    """``cached / prompt`` (the share of prompt tokens served from the KV cache); None when
    ``prompt`` is 0."""
    return cached / prompt if prompt > 0 else None


def score_view(mon: ScoreMonitor | None, now: float) -> dict[str, Any] | None:
    """The score monitor's distribution, rolling threshold and alerts (module docstring); None when
    the feature is off. ``now``: the router clock's seconds (alert ages)."""
    if mon is None:
        return None
    raw = mon.bucket_counts
    used = [k for k, c in enumerate(raw) if c]
    buckets = []
    if used:
        bounds = mon.buckets
        for k in range(used[0], used[-1] + 1):
            buckets.append({"le": bounds[k] if k < len(bounds) else None, "count": raw[k]})
    cfg = mon.config
    alerts = list(mon.events)[-EVENTS_SHOWN:]
    return {
        "count": mon.count,
        "mean": mon.sum / mon.count if mon.count else 0.0,
        "max": mon.max,
        "p95": mon.threshold if mon.threshold != float("inf") else None,
        "quantile": cfg.quantile,
        "persist": cfg.persist,
        "alerting": mon.alerting,
        "alerts": mon.alerts,
        "buckets": buckets,
        "recent_alerts": [
            {"age_s": round(now - t, 3), "score": score, "threshold": threshold}
            for t, score, threshold in reversed(alerts)
        ],
    }


def hotspot_view(det: HotspotDetector | None, now: float) -> dict[str, Any] | None:
    """The hot-spot detector's counters, the classes in alarm and its latest events (module
    docstring); None when the feature is off. ``now``: the router clock's seconds (event ages)."""
    if det is None:
        return None
    events = list(det.events)[-EVENTS_SHOWN:]
    return {
        "alarms": det.alarms,
        "mitigations": det.mitigations,
        "clears": det.clears,
        "mitigated_requests": det.mitigated_requests,
        "active": [
            {"key": f"{key:#x}", "share": share, "holders": m, "instances": n, "mitigating": mitigating}
            for key, share, m, n, mitigating in det.active()
        ],
        "events": [
            {
                "age_s": round(now - e.time, 3),
                "kind": e.kind,
                "key": f"{e.key:#x}",
                "share": e.share,
                "holders": e.holders,
                "instances": e.instances,
            }
            for e in reversed(events)
        ],
    }


def _mean_ms(total_s: float, count: int) -> float | None:
    return round(total_s / count * 1e3, 3) if count else None


def _backend_extras(obs: Observer, index: int, warming: bool) -> dict[str, Any]:
    """One backend's observed outcomes: hit rate, prediction error, mean TTFT and end-to-end."""
    err = obs.errors.get(index)
    reported = sum(err.counts) if err is not None else 0
    prompt = obs.prompt_tokens.get(index, 0)
    cached = obs.cached_real.get(index, 0)
    expected = obs.cached_expected.get(index, 0)
    ttft_s = e2e_s = 0.0
    n = 0
    for (b, _policy), hists in obs.latency.items():
        if b == index:
            ttft_s += hists[2].total
            e2e_s += hists[3].total
            n += sum(hists[3].counts)
    return {
        "reported_requests": reported,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": hit_rate(cached, prompt),
        "cached_error_mean": (cached - expected) / reported if reported else None,
        "ttft_ms_mean": _mean_ms(ttft_s, n),
        "e2e_ms_mean": _mean_ms(e2e_s, n),
        "warming": warming,
    }


def dashboard_state(obs: Observer, limit: int = 20, wall: float | None = None) -> dict[str, Any]:
    """The dashboard's JSON (module docstring) for the router ``obs`` observes, with its newest
    ``limit`` decisions; ``wall``: Unix seconds now (default ``time.time()``). Reads only."""
    core = obs.state
    wall = time.time() if wall is None else wall
    now = core.clock()
    state = router_state(core, obs.log, limit)
    guard = core.guard
    warmup = guard.warmup if guard is not None else None
    for b in state["backends"]:
        i = b["index"]
        b.update(_backend_extras(obs, i, warmup is not None and warmup.warming(i, now)))
    state.update(
        {
            "time": wall,
            "features": list(guard.features.names()) if guard is not None else [],
            "requests_total": sum(state["counters"][k] for k in OUTCOMES),
            "rate": rate_view(obs.log.per_second, wall),
            "score": score_view(guard.monitor if guard is not None else None, now),
            "hotspot": hotspot_view(guard.hotspot if guard is not None else None, now),
        }
    )
    return state
