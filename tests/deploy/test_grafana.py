"""deploy/grafana/kvroute.json: a Grafana dashboard over the router's metrics.

The file parses as a dashboard (unique panel ids, every query on the ``$datasource`` variable, the
panels the issue asks for), and every metric name in every PromQL expression is one the router
exports: a router with hot-spot detection, the score monitor and a shadow policy, in front of two
emulated engines on loopback, serves a few requests, and its /metrics text gives the series names
(the histograms' ``_bucket``/``_sum``/``_count`` and the counters' ``_total`` as really exported; the
signed cached-token error histogram has no ``_sum``/``_count``). ``le`` values a query names must be
bucket bounds the router writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.server.app import RouterServer
from kvroute.server.cluster import free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvroute.json"


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # panels inside a collapsed row
    return out


def expressions(dash: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in all_panels(dash) for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def test_dashboard_is_well_formed() -> None:
    dash = load()
    assert dash["uid"] == "kvroute" and dash["title"] and isinstance(dash["schemaVersion"], int)
    panels = all_panels(dash)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for p in panels:
        assert {"h", "w", "x", "y"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    titles = " | ".join(p["title"].lower() for p in panels)
    for wanted in ("first token", "end to end", "hit rate", "prediction error", "score distribution",
                   "rolling p95", "hot-spot alarms", "decisions per second", "backend health"):  # fmt: skip
        assert wanted in titles, wanted


def test_every_query_is_balanced_promql_text() -> None:
    for e in expressions(load()):
        assert (
            e.count("(") == e.count(")") and e.count("{") == e.count("}") and e.count("[") == e.count("]")
        ), e
        assert e.count('"') % 2 == 0, e


async def _engine(tokenizer: Tokenizer) -> tuple[EmulatorServer, BackendSpec]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    settings = EmulatorSettings(
        model_name="emu",
        engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
        time_scale=20.0,
        kv_events=KVEventsSettings(pub, replay_endpoint=rep),
    )
    eng = EmulatorServer(settings, costmod.get_profile(costmod.DEFAULT_PROFILE).cost, tokenizer)
    port = await eng.start("127.0.0.1", 0)
    return eng, BackendSpec(f"http://127.0.0.1:{port}", pub, rep)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


async def exported_text(tokenizer: Tokenizer) -> str:
    """/metrics of a router with the dashboard's features on, after a few requests."""
    engines = [await _engine(tokenizer) for _ in range(2)]
    features = FeatureConfig(hotspot=HotspotConfig(), monitor=ScoreMonitorConfig())
    cfg = RouterConfig(
        backends=tuple(spec for _, spec in engines),
        port=0,
        health_interval_s=0.2,
        features=features,
        shadow=("vllm",),
    )
    router = RouterServer(cfg, tokenizer=tokenizer)
    url = await router.start()
    try:
        system = "You are a careful assistant. " * 30
        async with aiohttp.ClientSession() as s:
            for k in range(6):
                msgs = [{"role": "system", "content": system}, {"role": "user", "content": f"question {k}"}]
                body = {"model": "emu", "messages": msgs, "max_tokens": 2}
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
            async with s.get(url + "/metrics") as r:
                return await r.text()
    finally:
        await router.stop()
        for eng, _ in engines:
            await eng.stop()


async def test_every_query_names_a_metric_the_router_exports(tokenizer: Tokenizer) -> None:
    text = await exported_text(tokenizer)
    exported = set(re.findall(r"^(kvroute_\w+)[{ ]", text, re.M))
    assert {"kvroute_request_ttft_seconds_bucket", "kvroute_cached_tokens_error_bucket"} <= exported
    assert "kvroute_cached_tokens_error_sum" not in exported  # signed buckets: no _sum/_count
    exprs = expressions(load())
    used = {n for e in exprs for n in re.findall(r"\bkvroute_\w+", e)}
    assert len(used) >= 20
    assert used <= exported, sorted(used - exported)
    # the bucket bounds a query picks by name exist
    for e in exprs:
        for name, le in re.findall(r'(kvroute_\w+_bucket)\{[^}]*le="([^"]+)"', e):
            assert re.search(rf'^{name}\{{[^}}]*le="{re.escape(le)}"', text, re.M), (name, le)
