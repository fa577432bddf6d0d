"""The emulated engine's P/D roles over real sockets: vLLM's NIXL flow (P leg, D leg, side channel,
lease), the per-role metrics, aborts on either side, and bad input."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvroute.emulator.pd import KVTransferSettings
from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine.types import EngineConfig
from kvroute.tokenizer import Tokenizer

from .conftest import COST, MODEL

PROMPT = "The quick brown fox jumps over the lazy dog. " * 12
KV_BYTES = 100_000.0  # per token


@pytest.fixture
async def start_role(tokenizer: Tokenizer) -> AsyncIterator[Callable[..., Any]]:
    servers: list[EmulatorServer] = []

    async def start(role: str, scale: float = 20.0, **kw: Any) -> EmulatorServer:
        kt = KVTransferSettings(role=role, **kw)
        cfg = EngineConfig(num_kv_blocks=256, max_model_len=4096, report_tokens=True)
        settings = EmulatorSettings(MODEL, cfg, scale, 8, kv_transfer=kt, kv_bytes_per_token=KV_BYTES)
        server = EmulatorServer(settings, COST, tokenizer)
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    yield start
    for s in servers:
        await s.stop()


def url(s: EmulatorServer, path: str = "/v1/completions") -> str:
    return f"http://127.0.0.1:{s.port}{path}"


P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


async def prefill(http: aiohttp.ClientSession, p: EmulatorServer, rid: str = "r1") -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": P_PARAMS,
    }
    async with http.post(url(p), json=body, headers={"X-Request-Id": rid}) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)


def metric(text: str, series: str) -> float:
    """The value of one series (a name, or a name with its labels as rendered)."""
    for line in text.splitlines():
        if line.startswith(series + " ") or (line.startswith(series + "{") and "{" not in series):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in /metrics")


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_then_decode_nixl_flow(start_role, tokenizer, stream):
    p = await start_role("kv_producer")
    d = await start_role("kv_consumer")
    n = len(tokenizer.encode(PROMPT))
    async with aiohttp.ClientSession() as http:
        pr = await prefill(http, p)
        kv = pr["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == p.kv_transfer.engine_id  # type: ignore[union-attr]
        assert (kv["remote_host"], kv["remote_port"]) == ("127.0.0.1", p.side.port)  # type: ignore[union-attr]
        assert kv["remote_request_id"] == pr["id"] == "cmpl-r1" and kv["tp_size"] == 1
        assert [len(g) for g in kv["remote_block_ids"]] == [-(-n // 16)]  # one KV cache group: the prompt
        assert kv["transfer_mode"] == "pull" and kv["remote_num_tokens"] == n
        assert kv["remote_prefill_cached_tokens"] == 0
        assert pr["usage"]["completion_tokens"] == 1
        assert p.model.stats().held_requests == 1  # pinned under the lease
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "stream": stream, "kv_transfer_params": kv}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with http.post(url(d), json=body, headers={"X-Request-Id": "r1"}) as r:
            assert r.status == 200
            if stream:
                lines = [ln for ln in (await r.text()).splitlines() if ln.startswith("data: {")]
                chunks = [json.loads(ln[6:]) for ln in lines]
                use = chunks[-1]["usage"]
                assert sum(1 for c in chunks if c["choices"]) == 6
            else:
                use = (await r.json())["usage"]
        assert use["completion_tokens"] == 6
        assert use["prompt_tokens_details"]["cached_tokens"] == 0  # D reports its local hit (as vLLM 0.32)
        await until(lambda: p.model.stats().held_requests == 0)  # D's "done" freed P's blocks
        assert p.model.stats().used_blocks == 0 and len(p.leases) == 0  # type: ignore[arg-type]
        async with http.get(url(d, "/metrics")) as r:
            dm = await r.text()
        async with http.get(url(p, "/metrics")) as r:
            pm = await r.text()
    ext = (
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="test-model",source="external_kv_transfer"}'
    )
    loc = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="test-model",source="local_compute"}'
    assert metric(dm, ext) == n and metric(dm, loc) == 0  # as vLLM 0.32's D counts them
    assert metric(pm, ext) == 0 and metric(pm, loc) == n
    assert metric(dm, "vllm:external_prefix_cache_hits_total") == n
    assert metric(dm, "vllm:external_prefix_cache_queries_total") == n
    # D cached the read blocks: its KV view now holds the prompt's full blocks
    assert d.model.stats().cached_blocks == n // 16


async def test_kv_both_serves_both_legs_and_transfer_time_is_modelled(start_role, tokenizer):
    slow = 0.002  # GB/s: 100 kB per token takes 50 ms of model time
    p = await start_role("kv_both")
    d = await start_role("kv_both", bandwidth_gbps=slow)
    n = len(tokenizer.encode(PROMPT))
    want = n * KV_BYTES / (slow * 1e9) / 20.0  # wall seconds at time scale 20
    async with aiohttp.ClientSession() as http:
        kv = (await prefill(http, p))["kv_transfer_params"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv}
        t0 = time.monotonic()
        async with http.post(url(d), json=body) as r:
            assert r.status == 200
        took = time.monotonic() - t0
    assert took >= want * 0.95


async def test_lease_expires_when_no_decoder_reads(start_role):
    p = await start_role("kv_producer", lease_timeout_s=0.2)
    async with aiohttp.ClientSession() as http:
        await prefill(http, p)
        assert p.model.stats().held_requests == 1
        await until(lambda: p.model.stats().held_requests == 0)
    assert p.leases.expired == 1 and p.model.stats().used_blocks == 0  # type: ignore[union-attr]


async def test_decode_abort_mid_transfer_still_notifies_prefill(start_role):
    p = await start_role("kv_producer")
    d = await start_role("kv_consumer", bandwidth_gbps=1e-6)  # a transfer of hours
    async with aiohttp.ClientSession() as http:
        kv = (await prefill(http, p))["kv_transfer_params"]
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv}
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(url(d), json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
        await until(lambda: p.model.stats().held_requests == 0)
    assert d.driver.active == 0 and p.model.stats().used_blocks == 0


async def test_decode_recomputes_when_prefill_lost_the_blocks(start_role, tokenizer):
    p = await start_role("kv_producer", lease_timeout_s=0.05)
    d = await start_role("kv_consumer")
    n = len(tokenizer.encode(PROMPT))
    async with aiohttp.ClientSession() as http:
        kv = (await prefill(http, p))["kv_transfer_params"]
        await until(lambda: p.model.stats().held_requests == 0)  # expired
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "kv_transfer_params": kv}
        async with http.post(url(d), json=body) as r:
            use = (await r.json())["usage"]
    assert use["prompt_tokens_details"]["cached_tokens"] == 0
    assert d.model.stats().external_hit_tokens == 0 and d.model.stats().prefix_query_tokens == n


async def test_prefill_client_disconnect_frees_at_once(start_role):
    p = await start_role("kv_producer", scale=0.005)  # the prefill takes seconds of wall time
    body = {"model": MODEL, "prompt": PROMPT * 8, "max_tokens": 1, "kv_transfer_params": P_PARAMS}
    async with aiohttp.ClientSession() as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(url(p), json=body, timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                await r.read()
    assert p.model.stats().held_requests == 0  # it never finished: nothing leased
    await until(lambda: p.driver.active == 0)
    await until(lambda: p.model.stats().used_blocks == 0)


@pytest.mark.parametrize(
    ("role", "params", "fragment"),
    [
        ("kv_both", "yes", "must be an object"),
        ("kv_both", {"do_remote_decode": 1}, "must be a boolean"),
        ("kv_both", {"do_remote_prefill": True, "remote_block_ids": [1]}, "remote_port"),
        ("kv_both", {"do_remote_prefill": True, "do_remote_decode": True}, "cannot ask"),
        ("kv_consumer", {"do_remote_decode": True}, "kv_role is kv_consumer"),
        (
            "kv_producer",
            {
                "do_remote_prefill": True,
                "remote_block_ids": [0],
                "remote_engine_id": "x",
                "remote_host": "127.0.0.1",
                "remote_port": 9,
            },
            "kv_role is kv_producer",
        ),
    ],
)
async def test_bad_kv_transfer_params_get_400(start_role, role, params, fragment):
    s = await start_role(role)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "kv_transfer_params": params}
    async with aiohttp.ClientSession() as http, http.post(url(s), json=body) as r:
        assert r.status == 400
        err = (await r.json())["error"]
    assert fragment in err["message"] and err["param"] == "kv_transfer_params"
    assert s.driver.active == 0


def parse(*argv: str) -> Any:
    from kvroute.cli import build_parser

    return build_parser().parse_args(["engine", "--kv-blocks", "100", *argv])


def test_cli_flags_and_env(monkeypatch):
    from kvroute.commands.engine import build

    cfg = '{"kv_connector":"NixlConnector","kv_role":"kv_producer","engine_id":"p0"}'
    settings, profile, _ = build(parse("--kv-transfer-config", cfg, "--kv-side-channel-port", "5601"))
    kt = settings.kv_transfer
    assert kt is not None and (kt.role, kt.engine_id, kt.side_port) == ("kv_producer", "p0", 5601)
    assert kt.lease_timeout_s == 30.0 and kt.bandwidth_gbps == 25.0  # vLLM 0.32's kv_lease_duration
    monkeypatch.setenv("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", "480")  # older vLLM's name
    kt = build(parse("--kv-transfer-config", cfg))[0].kv_transfer
    assert kt is not None and kt.lease_timeout_s == 480.0
    lease = '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"kv_lease_duration":12}}'
    kt = build(parse("--kv-transfer-config", lease))[0].kv_transfer
    assert kt is not None and kt.lease_timeout_s == 12.0 and kt.role == "kv_both"
    assert settings.kv_bytes_per_token == profile.model.kv_bytes_per_token > 0
    assert build(parse())[0].kv_transfer is None


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--kv-transfer-config", "{nope"], "not JSON"),
        (["--kv-transfer-config", '{"kv_connector":"P2pNcclConnector"}'], "not emulated"),
        (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"both"}'], "kv_role must be"),
        (["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_rol":"kv_both"}'], "unknown field"),
        (["--kv-lease-timeout", "3"], "goes with --kv-transfer-config"),
        (
            [
                "--kv-transfer-config",
                '{"kv_connector":"NixlConnector","kv_connector_extra_config":{"kv_lease_duration":0}}',
            ],
            "kv_lease_duration",
        ),
        (
            ["--kv-transfer-config", '{"kv_connector":"NixlConnector"}', "--kv-transfer-bandwidth", "0"],
            "positive",
        ),
    ],
)
def test_cli_bad_kv_transfer_flags(argv, fragment):
    from kvroute.commands.engine import build
    from kvroute.errors import UserError

    with pytest.raises(UserError, match=fragment):
        build(parse(*argv))
