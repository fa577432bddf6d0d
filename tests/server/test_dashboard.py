"""The dashboard's server side: the per-second counter, the pure views of :mod:`kvroute.server.observe.dashstate`,
and the routes over real sockets (404 without an admin token, 401 without the bearer, 400 for a bad
limit, the page's security headers, the JSON agreeing with /metrics). The page in a browser:
test_dashboard_browser.py."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path

import aiohttp
import pytest

from kvroute.features.hotspot import HotspotConfig, HotspotDetector
from kvroute.features.monitor import ScoreMonitor, ScoreMonitorConfig
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.observe.dashboard import STATIC_FILES
from kvroute.server.observe.dashstate import hit_rate, hotspot_view, rate_view, score_view
from kvroute.server.observe.persecond import PerSecond
from kvroute.tokenizer import Tokenizer

from .test_observe import AUTH, TOKEN, HeaderEngine, _metric, _router

DEFAULT_POLICY = RouterConfig(backends=()).policy  # what serve/up route with by default

ROOT = Path(__file__).resolve().parents[2]


# ---- pure parts -----------------------------------------------------------------------------------


def test_per_second_counts_whole_seconds_and_forgets_old_ones() -> None:
    c = PerSecond(size=5)
    for t in (100.1, 100.9, 101.5, 103.0, 103.2, 103.7):
        c.add(t)
    assert c.series(104.5, 4) == [2, 1, 0, 3]  # seconds 100..103; 104 is still filling
    assert c.series(103.99, 2) == [1, 0]  # the current second (103) is left out
    c.add(105.2)  # slot of second 100, reused
    assert c.series(106.0, 4) == [0, 3, 0, 1]  # seconds 102..105
    assert c.series(200.0, 4) == [0, 0, 0, 0]  # long after: nothing left
    with pytest.raises(ValueError):
        c.series(200.0, 5)


def test_rate_view_means_the_recent_seconds() -> None:
    c = PerSecond()
    for s in range(50, 60):
        c.add(s + 0.5, n=s - 49)  # 1..10 per second over seconds 50..59
    v = rate_view(c, 60.2, window_s=20, recent_s=5)
    assert v["per_second"] == [0] * 10 + list(range(1, 11))
    assert v["decisions_per_s"] == (6 + 7 + 8 + 9 + 10) / 5 and v["window_s"] == 20


def test_hit_rate() -> None:
    assert hit_rate(0, 0) is None
    assert hit_rate(30, 120) == 0.25


def test_score_view_buckets_threshold_and_alerts() -> None:
    assert score_view(None, 0.0) is None
    mon = ScoreMonitor(ScoreMonitorConfig(window=10, refresh_every=10, persist=2, min_decisions=10))
    for k in range(10):
        mon.observe(15.0 if k < 9 else 150.0, float(k))  # buckets <=20 (9) and <=200 (1)
    v = score_view(mon, 10.0)
    assert v is not None
    assert v["count"] == 10 and v["p95"] == 150.0 and not v["alerting"]
    assert v["buckets"] == [
        {"le": 20.0, "count": 9},
        {"le": 50.0, "count": 0},
        {"le": 100.0, "count": 0},
        {"le": 200.0, "count": 1},
    ]
    for k in range(2):
        mon.observe(1e11, 20.0 + k)  # above every bound: the +Inf bucket; two in a row: an alert
    v = score_view(mon, 30.0)
    assert v is not None and v["alerting"] and v["alerts"] == 1
    assert v["buckets"][-1] == {"le": None, "count": 2}
    assert v["recent_alerts"] == [{"age_s": 9.0, "score": 1e11, "threshold": 150.0}]


def test_hotspot_view_lists_alarms_and_events() -> None:
    assert hotspot_view(None, 0.0) is None
    det = HotspotDetector(HotspotConfig(min_window_requests=1, rank_interval_s=0.0, streak_factor=0.0))
    det.observe(0x77, holders=1, instances=3, now=1.0)  # cached on 1 of 3, the only class: alarm
    det.routed(0x77, into_hot=True, now=1.0)  # streak 1 > 0 × 1: mitigation
    v = hotspot_view(det, 4.0)
    assert v is not None and v["alarms"] == 1 and v["mitigations"] == 1
    assert v["active"] == [{"key": "0x77", "share": 1.0, "holders": 1, "instances": 3, "mitigating": True}]
    assert [(e["kind"], e["age_s"]) for e in v["events"]] == [("mitigation", 3.0), ("alarm", 3.0)]


def test_static_files_are_package_data() -> None:
    static = resources.files("kvroute.server.observe").joinpath("static")
    for name in ("dashboard.html", *STATIC_FILES):
        assert static.joinpath(name).read_bytes(), name
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "server/observe/static/*" in data["kvroute"]
    page = static.joinpath("dashboard.html").read_text()
    for name in STATIC_FILES:  # the page names its assets relative to /dashboard
        assert f'"dashboard/static/{name}"' in page


# ---- over real sockets ----------------------------------------------------------------------------


async def test_no_admin_token_no_dashboard(tokenizer: Tokenizer) -> None:
    eng = HeaderEngine()
    await eng.start()
    router = await _router((BackendSpec(eng.url),), tokenizer)
    try:
        async with aiohttp.ClientSession() as s:
            for path in ("/dashboard", "/dashboard/static/dashboard.js", "/debug/dashboard"):
                async with s.get(router.url + path, headers=AUTH) as r:
                    assert r.status == 404, path
    finally:
        await router.stop()
        await eng.stop()


async def test_page_is_public_and_its_json_needs_the_token(tokenizer: Tokenizer) -> None:
    eng = HeaderEngine(cached=64)
    await eng.start()
    router = await _router((BackendSpec(eng.url),), tokenizer, admin_token=TOKEN, decisions_kept=5)
    url = router.url
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/dashboard") as r:
                assert r.status == 200 and r.content_type == "text/html"
                csp = r.headers["Content-Security-Policy"]
                assert "script-src 'self'" in csp and "unsafe-inline" not in csp
                assert "frame-ancestors 'none'" in csp
                assert "<title>kvroute dashboard</title>" in await r.text()
            async with s.get(url + "/dashboard/", allow_redirects=False) as r:
                assert r.status == 301
            async with s.get(url + "/dashboard/") as r:
                assert r.status == 200 and str(r.url).endswith("/dashboard")
            async with s.get(url + "/dashboard/static/dashboard.js") as r:
                assert r.status == 200 and r.content_type == "text/javascript"
            async with s.get(url + "/dashboard/static/nope.js") as r:
                assert r.status == 404
            async with s.get(url + "/debug/dashboard") as r:
                assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            async with s.get(url + "/debug/dashboard", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401 and (await r.json())["error"]["type"] == "unauthorized"
            for bad in ("0", "6", "x"):
                async with s.get(url + f"/debug/dashboard?limit={bad}", headers=AUTH) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "limit"
            for k in range(3):
                body = {"model": "m", "prompt": f"hello there number {k}", "max_tokens": 1}
                async with s.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
            async with s.get(url + "/debug/dashboard?limit=2", headers=AUTH) as r:
                assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
                state = await r.json()
            async with s.get(url + "/metrics") as r:
                text = await r.text()
    finally:
        await router.stop()
        await eng.stop()
    assert state["decisions_total"] == 3 and len(state["decisions"]) == 2
    assert state["requests_total"] == 3 and state["features"] == [] and state["policy"] == DEFAULT_POLICY
    assert state["score"] is None and state["hotspot"] is None
    assert len(state["rate"]["per_second"]) == 60 and all(n >= 0 for n in state["rate"]["per_second"])
    (b,) = state["backends"]
    assert b["requests_total"] == _metric(text, "kvroute_backend_routed_total", backend=eng.url) == 3
    assert b["cached_tokens"] == _metric(text, "kvroute_cached_tokens_real_total", backend=eng.url) == 3 * 64
    assert b["prompt_tokens"] == _metric(text, "kvroute_prompt_tokens_total", backend=eng.url) > 0
    assert b["hit_rate"] == pytest.approx(3 * 64 / b["prompt_tokens"])
    expected = _metric(text, "kvroute_cached_tokens_expected_total", backend=eng.url)
    assert b["cached_error_mean"] == pytest.approx((3 * 64 - expected) / 3)
    assert b["reported_requests"] == 3 and b["ttft_ms_mean"] > 0 and b["e2e_ms_mean"] >= b["ttft_ms_mean"]


def test_the_observability_guide_shows_the_screenshot() -> None:
    guide = (ROOT / "docs" / "guide" / "observability.md").read_text(encoding="utf-8")
    assert "](../dashboard.png)" in guide and "## Seeing decisions" in guide
    png = (ROOT / "docs" / "dashboard.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
