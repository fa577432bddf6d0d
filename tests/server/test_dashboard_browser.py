"""The live dashboard in a real browser: Debian's ``chromium`` driven by Playwright's Python package
(the system browser; Playwright downloads nothing). Three emulated engines and a router with the
admin token, hot-spot detection, the score monitor and a shadow policy, all on free loopback ports.

The page loads with no console error, asks for the token, shows data, its numbers change under
traffic and then equal the router's /metrics; a decision's breakdown opens on a click; the token
survives a reload (sessionStorage) and arrives through ``#token=`` too. A screenshot is taken every
run; with ``KVROUTE_SCREENSHOT=1`` it is written to docs/dashboard.png (the observability guide's picture).

Skipped, with the reason, only when chromium or playwright is missing (CI installs both).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.features.hotspot import HotspotConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.server.config import RouterConfig
from kvroute.tokenizer import Tokenizer

from .test_e2e import Cluster, eventually

DEFAULT_POLICY = RouterConfig(backends=()).policy  # what serve/up route with by default

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "dash-s3cret"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

playwright_api = pytest.importorskip(
    "playwright.async_api", reason="the playwright Python package is not installed (pip install '.[dev]')"
)
if not os.access(CHROMIUM, os.X_OK):
    pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)", allow_module_level=True)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples ``name{...}`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        head = line.split(" ")[0]
        if head != name and not head.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture
async def cluster(tokenizer: Tokenizer) -> AsyncIterator[Cluster]:
    c = Cluster()
    try:
        for _ in range(3):
            await c.add_engine(tokenizer, events=True)
        features = FeatureConfig(
            hotspot=HotspotConfig(min_window_requests=5, rank_interval_s=0.0),
            monitor=ScoreMonitorConfig(window=200, refresh_every=5, persist=3, min_decisions=5),
        )
        await c.start_router(tokenizer, admin_token=TOKEN, features=features, shadow=("vllm",))
        router = c.router
        assert router is not None
        assert await eventually(lambda: all(b.healthy for b in router.state.backends))
        yield c
    finally:
        await c.close()


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh user-data-dir
            executable_path=CHROMIUM,
            headless=True,
            args=ARGS,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            yield context
        finally:
            await context.close()


async def send_traffic(url: str, n: int) -> None:
    """``n`` chat requests in 3 conversations sharing a long system prompt, 4 at a time."""
    system = "You are a careful assistant who answers in full sentences. " * 40
    sem = asyncio.Semaphore(4)

    async def one(s: aiohttp.ClientSession, k: int) -> None:
        msgs = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Conversation {k % 3}: tell me about topic {k % 3}. " * 6},
        ]
        async with (
            sem,
            s.post(
                url + "/v1/chat/completions", json={"model": "emu", "messages": msgs, "max_tokens": 4}
            ) as r,
        ):
            assert r.status == 200, await r.text()
            await r.read()

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(one(s, k) for k in range(n)))


async def texts(page: Any, selector: str) -> list[str]:
    return [t.strip() for t in await page.locator(selector).all_inner_texts()]


def number(text: str) -> float:
    return float(text.replace(",", "").rstrip("%"))


async def test_dashboard_in_chromium(cluster: Cluster, browser: Any, tmp_path: Path) -> None:
    router = cluster.router
    assert router is not None
    url = router.url
    errors: list[str] = []
    page = await browser.new_page()
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"page error: {e}"))

    # the page is static and public; it asks for the token before reading anything
    resp = await page.goto(url + "/dashboard")
    assert resp is not None and resp.status == 200
    await page.locator("#login").wait_for(state="visible")
    assert await page.locator("#main").is_hidden()
    await page.fill("#token", TOKEN)
    await page.click("#login button")
    await page.locator("#main").wait_for(state="visible")
    expect = playwright_api.expect  # polls through the DOM (the page's CSP forbids string eval)
    await expect(page.locator("#backends tbody tr")).to_have_count(3)
    assert await page.inner_text("#policy") == f"{DEFAULT_POLICY}+hotspot+monitor"
    assert await page.inner_text("#decisions-total") == "0"
    assert await texts(page, "#backends td.routed") == ["0", "0", "0"]

    # under traffic the numbers move
    await send_traffic(url, 30)
    await expect(page.locator("#decisions-total")).to_have_text("30", timeout=10_000)
    await expect(page.locator("#rate")).not_to_have_text("0.0", timeout=10_000)

    # ... and then equal /metrics (no traffic now, so both are stable)
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        text = await r.text()
    urls = await page.locator("#backends tbody tr").evaluate_all("rows => rows.map(r => r.dataset.backend)")
    assert sorted(urls) == sorted(spec.url for spec in cluster.specs)
    routed = [number(t) for t in await texts(page, "#backends td.routed")]
    assert routed == [metric(text, "kvroute_backend_routed_total", backend=u) for u in urls]
    assert sum(routed) == 30
    assert number(await page.inner_text("#requests-total")) == metric(text, "kvroute_requests_total") == 30
    assert number(await page.inner_text("#requests-ok")) == metric(
        text, "kvroute_requests_total", outcome="ok"
    )
    for u, shown in zip(urls, await texts(page, "#backends td.hit-rate"), strict=True):
        prompt = metric(text, "kvroute_prompt_tokens_total", backend=u)
        real = metric(text, "kvroute_cached_tokens_real_total", backend=u)
        assert shown == (f"{100 * real / prompt:.1f}%" if prompt else "–")
    assert any(t != "–" and number(t) > 0 for t in await texts(page, "#backends td.hit-rate"))
    p95 = metric(text, "kvroute_decision_score_rolling_p95")
    assert p95 > 0 and number(await page.inner_text("#score-p95")) == pytest.approx(p95, rel=0.01, abs=1)
    assert await page.locator("#score-chart rect").count() >= 1
    assert number(await page.inner_text("#hotspot-active")) == metric(text, "kvroute_hotspot_active_alarms")

    # the latest decisions, with every candidate's terms one click away
    rows = page.locator("#decisions tr.decision")
    assert await rows.count() == 20
    await rows.first.click()
    cand = page.locator("#decisions tr.breakdown table.candidates tbody tr")
    await cand.first.wait_for()
    assert await cand.count() == 3
    assert await page.locator("#decisions tr.breakdown tr.chosen").count() == 1
    assert "shadow vllm" in await page.inner_text("#decisions tr.breakdown")
    await page.wait_for_timeout(1600)  # one more poll: the opened breakdown stays open
    assert await page.locator("#decisions tr.breakdown").count() == 1

    shot = tmp_path / "dashboard.png"
    await page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("KVROUTE_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")

    # the token stays for this tab (sessionStorage) across a reload ...
    await page.reload()
    await page.locator("#main").wait_for(state="visible")
    assert await page.locator("#login").is_hidden()
    # ... and a new tab given #token= opens directly, the fragment leaving the address bar
    other = await browser.new_page()
    other.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    await other.goto(url + "/dashboard#token=" + TOKEN)
    await other.locator("#main").wait_for(state="visible")
    assert not re.search("token", other.url)
    assert errors == []
