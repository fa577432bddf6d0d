"""The router's P/D mode over real sockets, in front of emulated NIXL prefill and decode engines:
both legs with one request id, streamed and not, cached tokens from P, the conditional skip, P or D
dying before the handover / first byte, client disconnects on either leg, decision records."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvroute.emulator.pd import KVTransferSettings
from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine.cost import LinearCostModel
from kvroute.engine.transfer import TransferModel
from kvroute.engine.types import EngineConfig
from kvroute.server.pd import PDBackend, PDConfig, PDServer
from kvroute.tokenizer import Tokenizer, load_tokenizer

MODEL = "test-model"
COST = LinearCostModel("test-linear", decode_s_per_seq=0.01, prefill_s_per_token=2e-5)
KV_BYTES = 100_000.0
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
FAST = TransferModel(KV_BYTES, 100e9)  # the router's link: a transfer always beats D's prefill
SLOW = TransferModel(KV_BYTES, 1e6)  # ... never does


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def dead_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def fleet(tokenizer: Tokenizer) -> AsyncIterator[Callable[..., Any]]:
    engines: list[EmulatorServer] = []
    routers: list[PDServer] = []

    async def make(
        prefill: int = 2,
        decode: int = 2,
        link: TransferModel = FAST,
        dead_prefill: bool = False,
        dead_decode: bool = False,
        p_time_scale: float = 20.0,
        conditional: bool = True,
    ) -> tuple[PDServer, list[EmulatorServer], list[EmulatorServer]]:
        async def engine(role: str, scale: float) -> EmulatorServer:
            cfg = EngineConfig(num_kv_blocks=512, max_model_len=8192, report_tokens=True)
            st = EmulatorSettings(
                MODEL, cfg, scale, 8, kv_transfer=KVTransferSettings(role=role), kv_bytes_per_token=KV_BYTES
            )
            e = EmulatorServer(st, COST, tokenizer)
            await e.start("127.0.0.1", 0)
            engines.append(e)
            return e

        ps = [await engine("kv_producer", p_time_scale) for _ in range(prefill)]
        ds = [await engine("kv_consumer", 20.0) for _ in range(decode)]
        p_urls = [f"http://127.0.0.1:{e.port}" for e in ps]
        d_urls = [f"http://127.0.0.1:{e.port}" for e in ds]
        if dead_prefill:
            p_urls.insert(0, dead_url())
        if dead_decode:
            d_urls.insert(0, dead_url())
        cfg = PDConfig(
            tuple(PDBackend(u) for u in p_urls), tuple(PDBackend(u) for u in d_urls), conditional=conditional
        )
        r = PDServer(cfg, tokenizer, COST, link)
        await r.start("127.0.0.1", 0)
        routers.append(r)
        return r, ps, ds

    yield make
    for r in routers:
        await r.stop()
    for e in engines:
        await e.stop()


def url(port: int | None, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{port}{path}"


def port_of(u: str) -> int:
    return int(u.rsplit(":", 1)[1])


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)


def engine_at(engines: list[EmulatorServer], u: str) -> EmulatorServer:
    return next(e for e in engines if e.port == port_of(u))


async def test_disaggregated_non_streaming_one_request_id_and_cached_from_p(fleet, tokenizer):
    router, ps, ds = await fleet()
    n = len(tokenizer.encode(PROMPT))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}
    async with aiohttp.ClientSession() as http:
        async with http.post(url(router.port), json=body, headers={"x-request-id": "req-1"}) as r:
            assert r.status == 200
            h, first = r.headers, await r.json()
        assert h["x-kvroute-pd"] == "disaggregated" and h["x-request-id"] == "req-1"
        p, d = engine_at(ps, h["x-kvroute-prefill"]), engine_at(ds, h["x-kvroute-decode"])
        assert first["id"] == "cmpl-req-1"  # D ran it under the router's request id
        assert first["usage"]["completion_tokens"] == 5
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's hit: none yet
        assert d.model.stats().external_hit_tokens == n  # D read the prompt from P
        assert p.model.stats().prefix_query_tokens == n  # P prefilled it
        await until(lambda: p.model.stats().held_requests == 0)  # D notified P
        # the same prompt again: P (its cache now warm) reports the hit; D's own count would be n - 1
        async with http.post(url(router.port), json=body) as r:
            h2, second = r.headers, await r.json()
    assert h2["x-kvroute-prefill"] == h["x-kvroute-prefill"]  # the policy follows P's cache
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 16 * ((n - 1) // 16) > 0 and cached != n - 1
    assert int(h2["x-kvroute-cached-tokens"]) == cached  # predicted from P's KV view (history)


async def test_disaggregated_streaming_chat_rewrites_usage_with_p_cached(fleet, tokenizer):
    # always disaggregate: D holds the whole prompt after the first request, so the conditional
    # skip would have D compute the second's last token itself
    router, _ps, _ds = await fleet(conditional=False)
    msgs = [{"role": "user", "content": PROMPT}]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as http:
        for _ in range(2):
            async with http.post(url(router.port, "/v1/chat/completions"), json=body) as r:
                assert r.status == 200 and r.headers["x-kvroute-pd"] == "disaggregated"
                text = await r.text()
    chunks = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
    assert text.rstrip().endswith("data: [DONE]")
    assert sum(len(c["choices"]) and bool(c["choices"][0]["delta"].get("content")) for c in chunks) == 6
    n = len(tokenizer.encode_chat(msgs))
    use = chunks[-1]["usage"]
    assert use["completion_tokens"] == 6 and use["prompt_tokens"] == n
    assert use["prompt_tokens_details"]["cached_tokens"] == 16 * ((n - 1) // 16)  # P's, not D's n - 1


async def test_conditional_skip_prefills_on_decode(fleet, tokenizer):
    router, ps, ds = await fleet(link=SLOW)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 200
        h, out = r.headers, await r.json()
    assert h["x-kvroute-pd"] == "local_prefill" and h["x-kvroute-prefill"] == ""
    assert float(h["x-kvroute-local-prefill-ms"]) < float(h["x-kvroute-transfer-ms"])
    assert all(p.model.stats().prefix_query_tokens == 0 for p in ps)  # no P saw it
    d = engine_at(ds, h["x-kvroute-decode"])
    assert d.model.stats().external_hit_tokens == 0 and out["usage"]["completion_tokens"] == 3
    rec = router.decisions[-1]
    assert rec["reason"] == "local_prefill" and rec["explain"]["prefill"] is None


async def test_dead_prefill_before_handover_retries_next_prefill(fleet):
    router, ps, _ds = await fleet(prefill=1, dead_prefill=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 200
        h = r.headers
    assert h["x-kvroute-pd"] == "disaggregated" and h["x-kvroute-retries"] == "1"
    assert port_of(h["x-kvroute-prefill"]) == ps[0].port  # the live P, after the dead one
    assert (
        router.decisions[-1]["explain"]["prefill"]["instance"] == 0
    )  # the policy's first choice was the dead one


async def test_every_prefill_dead_falls_back_to_decode_prefill(fleet):
    router, _ps, ds = await fleet(prefill=0, decode=1, dead_prefill=True, conditional=False)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 200
        h, out = r.headers, await r.json()
    assert h["x-kvroute-pd"] == "prefill_failed" and h["x-kvroute-prefill"] == ""
    assert out["usage"]["completion_tokens"] == 2 and ds[0].model.stats().external_hit_tokens == 0
    assert router.decisions[-1]["retries"] == 1


async def test_dead_decode_before_first_byte_retries_next_decode(fleet):
    router, ps, ds = await fleet(decode=1, dead_decode=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 200
        h = r.headers
        await r.read()
    assert port_of(h["x-kvroute-decode"]) == ds[0].port and h["x-kvroute-retries"] == "1"
    await until(lambda: all(p.model.stats().held_requests == 0 for p in ps))  # the live D read P's blocks


async def test_client_disconnect_on_prefill_leg_aborts_prefill(fleet):
    router, ps, ds = await fleet(prefill=1, decode=1, p_time_scale=0.005)  # P: 200x slower than real time
    body = {"model": MODEL, "prompt": PROMPT * 4, "max_tokens": 2}
    async with aiohttp.ClientSession() as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(url(router.port), json=body, timeout=aiohttp.ClientTimeout(total=0.3)) as r:
                await r.read()
    p, d = ps[0], ds[0]
    await until(lambda: p.driver.active == 0)
    await until(lambda: p.model.stats().used_blocks == 0)  # aborted, freed at once (not leased)
    assert d.model.stats().prefix_query_tokens == 0 and d.driver.active == 0  # D never got it
    await until(lambda: not router.pools["prefill"][0].inflight)


async def test_client_disconnect_on_decode_leg_aborts_decode(fleet):
    router, ps, ds = await fleet(prefill=1, decode=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 200
        await r.content.readany()  # the stream started
        # leaving the block closes the connection mid-stream
    p, d = ps[0], ds[0]
    await until(lambda: d.driver.active == 0)  # D aborted the request
    await until(lambda: d.model.stats().used_blocks == 0)
    await until(lambda: p.model.stats().held_requests == 0)  # P was notified when D read
    await until(lambda: not router.pools["decode"][0].inflight)


async def test_decisions_dashboard_metrics_and_bad_input(fleet):
    router, ps, ds = await fleet(prefill=1, decode=1)
    async with aiohttp.ClientSession() as http:
        async with http.post(
            url(router.port), json={"model": MODEL, "prompt": "hello there", "max_tokens": 1}
        ) as r:
            assert r.status == 200
        async with http.post(
            url(router.port), data=b"{nope", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
            err = (await r.json())["error"]
            assert err["message"] and "x-request-id" in r.headers
        async with http.get(url(router.port, "/debug/decisions")) as r:
            recs = await r.json()
        async with http.get(url(router.port, "/dashboard")) as r:
            page = await r.text()
        async with http.get(url(router.port, "/metrics")) as r:
            metrics = await r.text()
        async with http.get(url(router.port, "/v1/models")) as r:
            models = await r.json()
    assert len(recs) == 1 and recs[0]["prefill"].endswith(str(ps[0].port))
    assert recs[0]["decode"].endswith(str(ds[0].port)) and recs[0]["explain"]["decode"]["candidates"]
    assert recs[0]["request_id"] in page and "disaggregated" in page
    assert 'kvroute_pd_requests_total{reason="disaggregated"} 1.0' in metrics
    assert models["data"][0]["id"] == MODEL


def parse_serve(*argv: str) -> Any:
    from kvroute.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_flags_and_config_roles(tmp_path):
    from kvroute.commands.pdserve import pd_config, wants_pd

    args = parse_serve(
        "--prefill", "http://127.0.0.1:9001", "--decode", "http://127.0.0.1:9002", "--decode", "http://127.0.0.1:9003",
        "--kv-events", "http://127.0.0.1:9001=tcp://127.0.0.1:5557", "--policy", "lmetric",
    )  # fmt: skip
    assert wants_pd(args, ())
    cfg, _tok, _cost, transfer = pd_config(args)
    assert [b.url for b in cfg.prefill] == ["http://127.0.0.1:9001"] and len(cfg.decode) == 2
    assert cfg.prefill[0].kv_events == "tcp://127.0.0.1:5557" and cfg.conditional
    assert transfer.bandwidth_bytes_per_s == 25e9
    conf = tmp_path / "r.yaml"
    conf.write_text(
        "backends:\n"
        "  - {url: 'http://127.0.0.1:9101', role: prefill, kv_events: 'tcp://127.0.0.1:6001'}\n"
        "  - {url: 'http://127.0.0.1:9102', role: decode}\n"
    )
    cfg, *_ = pd_config(parse_serve("--config", str(conf), "--no-conditional"))
    assert [b.url for b in cfg.prefill] == ["http://127.0.0.1:9101"] and cfg.prefill[0].kv_events
    assert [b.url for b in cfg.decode] == ["http://127.0.0.1:9102"] and not cfg.conditional


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--prefill", "http://127.0.0.1:9001"], "at least one --decode"),
        (["--decode", "http://127.0.0.1:9001", "--backend", "http://127.0.0.1:9002"], "--backend is for"),
        (["--decode", "http://127.0.0.1:9001", "--prefill", "http://127.0.0.1:9001"], "listed once"),
        (["--decode", "http://127.0.0.1:9001", "--kv-transfer-bandwidth", "0"], "positive"),
        (["--decode", "http://127.0.0.1:9001", "--kv-events", "http://127.0.0.1:7=tcp://x:1"], "neither"),
        (["--decode", "http://127.0.0.1:9001", "--policy", "nope"], "nope"),
        (["--decode", "http://127.0.0.1:9001", "--router-queue"], "P/D mode runs without it"),
        (["--decode", "http://127.0.0.1:9001", "--queue-ttl", "5"], "P/D mode runs without it"),
    ],
)
def test_serve_bad_pd_flags(argv, fragment):
    from kvroute.commands.pdserve import pd_config
    from kvroute.errors import UserError

    with pytest.raises(UserError, match=fragment):
        pd_config(parse_serve(*argv))


def test_config_role_must_be_known(tmp_path):
    from kvroute.commands.settings import load_config_file
    from kvroute.errors import UserError

    conf = tmp_path / "r.yaml"
    conf.write_text("backends:\n  - {url: 'http://127.0.0.1:9101', role: prefil}\n")
    with pytest.raises(UserError, match="role must be prefill or decode"):
        load_config_file(conf)


def test_pd_flags_without_pd_mode_are_refused():
    from kvroute.cli import main

    assert main(["serve", "--backend", "http://127.0.0.1:9", "--kv-transfer-bandwidth", "5"]) == 2


@pytest.mark.parametrize("link", [FAST, SLOW])  # the error comes from P, or from D (P skipped)
async def test_engine_errors_are_relayed_as_json(fleet, link):
    router, _ps, _ds = await fleet(prefill=1, decode=1, link=link)
    body = {"model": "no-such-model", "prompt": PROMPT, "max_tokens": 2}
    async with aiohttp.ClientSession() as http, http.post(url(router.port), json=body) as r:
        assert r.status == 404
        err = (await r.json())["error"]
    assert "no-such-model" in err["message"]
    assert router.decisions[-1]["reason"] == ("prefill_error" if link is FAST else "local_prefill")


async def test_repeated_client_request_ids_keep_the_bookkeeping_straight(fleet):
    router, _ps, _ds = await fleet(prefill=1, decode=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "stream": True}
    async with aiohttp.ClientSession() as http:

        async def one() -> int:
            async with http.post(url(router.port), json=body, headers={"x-request-id": "same"}) as r:
                await r.read()
                return r.status

        assert [await one() for _ in range(3)] == [200, 200, 200]  # one after another: each served
        together = await asyncio.gather(one(), one(), one())  # at once: the id is in flight, a 409
        assert 200 in together and set(together) <= {200, 409}, together
    assert all(not i.inflight and not i.started for pool in router.pools.values() for i in pool.values())
    assert len({d["key"] for d in router.decisions}) == 3 + together.count(200)
