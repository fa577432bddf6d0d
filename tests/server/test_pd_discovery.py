"""Discovery in the router's P/D mode, over real sockets in front of emulated NIXL engines: a watched
file whose backends carry roles, a DNS source with a role (the resolver is the seam: no DNS server
here), instances joining and leaving their pool while the router serves, a URL listed in both roles,
and the flags' errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from kvroute.commands.settings import backends_from_text
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
FAST = TransferModel(KV_BYTES, 100e9)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture
async def engines(tokenizer: Tokenizer) -> AsyncIterator[Callable[[str], Any]]:
    started: list[EmulatorServer] = []

    async def make(role: str) -> str:
        cfg = EngineConfig(num_kv_blocks=512, max_model_len=8192, report_tokens=True)
        st = EmulatorSettings(
            MODEL, cfg, 20.0, 8, kv_transfer=KVTransferSettings(role=role), kv_bytes_per_token=KV_BYTES
        )
        e = EmulatorServer(st, COST, tokenizer)
        await e.start("127.0.0.1", 0)
        started.append(e)
        return f"http://127.0.0.1:{e.port}"

    yield make
    for e in started:
        await e.stop()


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)


async def post(port: int | None) -> tuple[int, Any, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r,
    ):
        return r.status, r.headers, await r.json()


async def test_file_source_with_roles_joins_and_leaves(engines, tokenizer, tmp_path, caplog):
    p1, p2, d1 = await engines("kv_producer"), await engines("kv_producer"), await engines("kv_consumer")
    listing = tmp_path / "fleet.yaml"
    listing.write_text(f"- {{url: '{p1}', role: prefill}}\n")
    cfg = PDConfig(
        (),
        (PDBackend(d1),),
        conditional=False,
        discover=((None, f"file://{listing}"),),
        discover_interval_s=0.05,
    )
    router = PDServer(cfg, tokenizer, COST, FAST, parse=backends_from_text)
    await router.start("127.0.0.1", 0)
    try:
        assert router.members.urls("prefill") == [p1]  # read once before serving
        status, h, _ = await post(router.port)
        assert status == 200 and h["x-kvroute-pd"] == "disaggregated" and h["x-kvroute-prefill"] == p1
        # p1 leaves, p2 joins; d1 is also listed as a prefill instance: it stays a decode instance
        listing.write_text(f"- {{url: '{p2}', role: prefill}}\n- {{url: '{d1}', role: prefill}}\n")
        await until(lambda: router.members.urls("prefill") == [p2])
        assert router.members.urls("decode") == [d1]
        assert any("listed as decode and as prefill" in r.getMessage() for r in caplog.records)
        indices = list(router.pools["prefill"])
        assert indices == [1]  # p2 got a new index: p1's (0) is never reused
        status, h, _ = await post(router.port)
        assert status == 200 and h["x-kvroute-prefill"] == p2
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{router.port}/health") as r,
        ):
            assert (await r.json())["prefill"] == [p2]
        # the file emptied: no prefill instance left, D prefills itself
        listing.write_text("[]\n")
        await until(lambda: not router.pools["prefill"])
        status, h, body = await post(router.port)
        assert status == 200 and h["x-kvroute-pd"] == "no_prefill_instance" and h["x-kvroute-prefill"] == ""
        assert body["usage"]["completion_tokens"] == 3
        # an unreadable file keeps the current list
        listing.write_text("- {url: 'not a url', role: prefill}\n")
        await asyncio.sleep(0.2)
        assert not router.pools["prefill"] and router.members.urls("decode") == [d1]
    finally:
        await router.stop()


async def test_dns_source_with_a_role_feeds_decode(engines, tokenizer):
    p1, d1, d2 = await engines("kv_producer"), await engines("kv_consumer"), await engines("kv_consumer")
    ports = {"d": [int(d1.rsplit(":", 1)[1])]}
    failing = [True]

    async def resolve(name: str, port: int) -> list[tuple[str, int]]:
        assert name == "decode.svc"
        if failing[0]:
            raise OSError("no such name")
        return [("127.0.0.1", p) for p in ports["d"]]

    cfg = PDConfig(
        (PDBackend(p1),),
        (),
        conditional=False,
        discover=(("decode", "dns://decode.svc:8000"),),
        discover_interval_s=0.05,
    )
    router = PDServer(cfg, tokenizer, COST, FAST, resolve=resolve)
    await router.start("127.0.0.1", 0)
    try:
        status, _h, body = await post(router.port)  # no decode instance yet: a JSON 503
        assert status == 503 and "no decode instance" in body["error"]["message"]
        failing[0] = False
        await until(lambda: router.members.urls("decode") == [d1])
        status, h, _ = await post(router.port)
        assert status == 200 and h["x-kvroute-decode"] == d1 and h["x-kvroute-prefill"] == p1
        ports["d"] = [int(d2.rsplit(":", 1)[1])]  # the Service's pod was replaced
        await until(lambda: router.members.urls("decode") == [d2])
        status, h, _ = await post(router.port)
        assert status == 200 and h["x-kvroute-decode"] == d2
        assert all(not i.inflight for pool in router.pools.values() for i in pool.values())
    finally:
        await router.stop()


def parse_serve(*argv: str) -> Any:
    from kvroute.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_discovery_flags_take_roles(tmp_path):
    from kvroute.commands.pdserve import pd_config, split_role, wants_pd

    assert split_role("prefill=dns://p.svc:8000") == ("prefill", "dns://p.svc:8000")
    assert split_role("file:///x/y=z.yaml") == (None, "file:///x/y=z.yaml")
    args = parse_serve("--discover", "decode=dns://d.svc:8000", "--discover", "prefill=dns://p.svc:8000")
    assert wants_pd(args, ())
    cfg, *_ = pd_config(args)
    assert cfg.discover == (("decode", "dns://d.svc:8000"), ("prefill", "dns://p.svc:8000"))
    assert cfg.decode == () and cfg.prefill == ()
    conf = tmp_path / "r.yaml"
    conf.write_text("discover: ['decode=dns://d.svc:8000']\ndiscover_kv_events: 'tcp://{host}:5557'\n")
    cfg, *_ = pd_config(parse_serve("--config", str(conf)))
    assert cfg.discover == (("decode", "dns://d.svc:8000"),) and cfg.discover_kv_events == "tcp://{host}:5557"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--decode", "http://127.0.0.1:9001", "--discover", "dns://p.svc:8000"], "needs a role"),
        (["--discover", "decoder=dns://d.svc:8000"], "must be prefill or decode"),
        (["--discover", "prefill=dns://p.svc:8000"], "at least one --decode"),
        (["--discover", "decode=ftp://x"], "expected dns://"),
    ],
)
def test_serve_bad_discovery_flags(argv, fragment):
    from kvroute.commands.pdserve import pd_config
    from kvroute.errors import UserError

    with pytest.raises(UserError, match=fragment):
        pd_config(parse_serve(*argv))
