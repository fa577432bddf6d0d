"""The features in the live router, over real HTTP to the router (backends behind a recording
transport): 429 quota path with Retry-After and an OpenAI error body, class header, spot tags, /metrics
exports, cold-start preloads on re-admission and on AllBlocksCleared, config and flags."""

from __future__ import annotations

import math
from pathlib import Path

import aiohttp
import orjson
import pytest

from kvroute.cli import main
from kvroute.commands.settings import load_config_file
from kvroute.engine.types import AllBlocksCleared
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.limits import LimitsConfig, QuotaConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

from ._fakes import RecordingTransport

A, B = "http://a:1", "http://b:1"
BODY = {"model": "m", "prompt": "hello world " * 20, "max_tokens": 2}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


async def start(
    tokenizer: Tokenizer, features: FeatureConfig, *backends: BackendSpec, clock: Clock | None = None
) -> tuple[RouterServer, RecordingTransport]:
    t = RecordingTransport()
    cfg = RouterConfig(backends=backends or (BackendSpec(A), BackendSpec(B)), port=0, features=features)
    server = RouterServer(cfg, transport=t, tokenizer=tokenizer, clock=clock or Clock(), background=False)
    await server.start()
    return server, t


async def post(
    url: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s:
        h = {"Content-Type": "application/json", **(headers or {})}
        async with s.post(url + "/v1/completions", data=orjson.dumps(body), headers=h) as r:
            return r.status, dict(r.headers), await r.read()


async def metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def test_over_quota_is_429_with_retry_after_and_an_openai_error(tokenizer: Tokenizer) -> None:
    clock = Clock()
    server, t = await start(
        tokenizer, FeatureConfig(quota=QuotaConfig(tokens_per_s=10.0, burst=60.0)), clock=clock
    )
    try:
        cost = len(tokenizer.encode(BODY["prompt"])) + 2  # type: ignore[attr-defined]
        assert 30 < cost <= 60  # one fits in the burst, two do not
        status, _, _ = await post(server.url, {**BODY, "user": "alice"})
        assert status == 200
        status, headers, raw = await post(server.url, {**BODY, "user": "alice"})
        assert status == 429
        wait = (cost - (60 - cost)) / 10.0
        assert headers["Retry-After"] == str(max(1, math.ceil(wait)))
        err = orjson.loads(raw)["error"]
        assert err["type"] == "rate_limit_exceeded" and err["code"] == 429 and err["param"] is None
        assert "quota" in err["message"]
        assert len(t.posts()) == 1  # the rejected request never reached a backend
        status, _, _ = await post(server.url, {**BODY, "user": "bob"})  # another user's bucket
        assert status == 200
        clock.t += wait  # the bucket refills at 10 tokens/s
        status, _, _ = await post(server.url, {**BODY, "user": "alice"})
        assert status == 200
        text = await metrics(server.url)
        assert "kvroute_quota_rejected_total 1.0" in text
        assert 'kvroute_requests_total{outcome="client_errors"} 1.0' in text
    finally:
        await server.stop()


async def test_quota_by_api_key(tokenizer: Tokenizer) -> None:
    server, _ = await start(tokenizer, FeatureConfig(quota=QuotaConfig(10.0, 60.0, key="api_key")))
    try:
        key = {"Authorization": "Bearer sk-one"}
        assert (await post(server.url, {**BODY, "user": "x"}, key))[0] == 200
        assert (await post(server.url, {**BODY, "user": "y"}, key))[0] == 429  # same key, other user
        assert (await post(server.url, BODY, {"Authorization": "Bearer sk-two"}))[0] == 200
    finally:
        await server.stop()


async def test_class_header_and_unknown_class(tokenizer: Tokenizer) -> None:
    from kvroute.features.classes import ClassConfig

    server, _ = await start(tokenizer, FeatureConfig(classes=ClassConfig(users=(("nightly", "tpot"),))))
    try:
        assert (await post(server.url, BODY, {"x-kvroute-class": "ttft"}))[0] == 200
        assert (await post(server.url, {**BODY, "user": "nightly"}))[0] == 200
        guard = server.state.guard
        assert guard is not None and guard.counts["class:ttft"] == 1 and guard.counts["class:tpot"] == 1
        status, _, raw = await post(server.url, BODY, {"x-kvroute-class": "urgent"})
        assert status == 400
        err = orjson.loads(raw)["error"]
        assert err["type"] == "invalid_request_error" and "urgent" in err["message"]
    finally:
        await server.stop()


async def test_spot_backends_are_kept_out_of_long_requests(tokenizer: Tokenizer) -> None:
    feats = FeatureConfig(limits=LimitsConfig(spot_max_tokens=1000))
    server, t = await start(tokenizer, feats, BackendSpec(A, tags=("spot",)), BackendSpec(B))
    try:
        await post(server.url, BODY)  # short: idle tie → the lower index, the spot backend
        await post(server.url, {**BODY, "prompt": "hello world " * 600})  # > 1000 tokens
        assert [u for u, _ in t.posts()] == [A, B]
    finally:
        await server.stop()


async def test_metrics_export_alarms_mitigations_and_score_histogram(tokenizer: Tokenizer) -> None:
    feats = FeatureConfig(
        # spread="all": idle backends are never "saturated", so the default replica mode would defer
        hotspot=HotspotConfig(min_window_requests=1, rank_interval_s=0.0, streak_factor=0.0, spread="all"),
        monitor=ScoreMonitorConfig(),
    )
    server, t = await start(tokenizer, feats)
    try:
        shared = "You are a careful assistant for the kvroute test suite. " * 20
        for i in range(4):
            assert (await post(server.url, {**BODY, "prompt": shared + f"question {i}"}))[0] == 200
        text = await metrics(server.url)
        assert "kvroute_decision_score_count 4.0" in text
        assert "kvroute_hotspot_alarms_total 1.0" in text  # one backend caches the class of two
        assert "kvroute_hotspot_mitigations_total 1.0" in text
        assert "kvroute_hotspot_mitigated_requests_total" in text
        assert 'kvroute_feature_decisions_total{kind="mitigated"}' in text
        # mitigation spread the class: both backends got some of it
        assert {u for u, _ in t.posts()} == {A, B}
    finally:
        await server.stop()


async def test_readmitted_backend_warms_up_and_gets_preloads(tokenizer: Tokenizer) -> None:
    server, t = await start(tokenizer, FeatureConfig(cold_start=ColdStartConfig()))
    try:
        shared = "System: answer in French, cite sources, be brief. " * 20
        for i in range(2):
            assert (await post(server.url, {**BODY, "prompt": shared + f"q{i}"}))[0] == 200
        b = server.state.backends[1]
        b.eject()
        assert await server.monitor.check_health(b)  # passes: re-admitted → warming + preloads
        guard = server.state.guard
        assert (
            guard is not None and guard.warmup is not None and guard.warmup.warming(1, server.state.clock())
        )
        todo = server.state.take_preloads()
        assert len(todo) == 1 and todo[0][0] == 1
        assert await server.monitor.preload(*todo[0])
        url, body = t.posts()[-1]
        sent = orjson.loads(body or b"{}")
        assert url == B and sent["max_tokens"] == 1 and sent["model"] == "m"
        ids = tokenizer.encode(shared)  # type: ignore[attr-defined]
        assert sent["prompt"] == list(todo[0][1].tokens or ()) and len(sent["prompt"]) % 16 == 0
        assert sent["prompt"] == ids[: len(sent["prompt"])] and len(sent["prompt"]) >= len(ids) - 32
        assert all(x.waiting == 0 and x.running == 0 for x in server.state.backends)
        assert "kvroute_cold_start_preloads_total 1.0" in await metrics(server.url)
    finally:
        await server.stop()


async def test_all_blocks_cleared_starts_a_warm_up(tokenizer: Tokenizer) -> None:
    server, _ = await start(tokenizer, FeatureConfig(cold_start=ColdStartConfig()))
    try:
        server.state.kv.apply_events(0, [AllBlocksCleared()])
        guard = server.state.guard
        assert (
            guard is not None and guard.warmup is not None and guard.warmup.warming(0, server.state.clock())
        )
        assert 'kvroute_cold_start_warming{backend="http://a:1"} 1.0' in await metrics(server.url)
    finally:
        await server.stop()


def test_config_file_features_and_tags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "router.yaml"
    cfg_file.write_text(
        "backends:\n  - {url: 'http://a:1', tags: [spot]}\n  - http://b:1\n"
        "features:\n  hotspot: true\n  quota: {tokens_per_s: 100, burst: 1000}\n"
    )
    cfg = load_config_file(cfg_file)
    assert cfg.backends[0].tags == ("spot",) and cfg.backends[1].tags == ()
    assert cfg.features is not None and cfg.features.names() == ["hotspot", "quota"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--classes", "--policy", "vllm"], "need policy lmetric"),
        (["--quota", "fast"], "--quota"),
    ],
)
def test_serve_rejects_bad_feature_flags(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--backend", A, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
