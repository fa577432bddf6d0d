"""The load generator: prompt text whose token blocks follow the block ids; a small open-loop run
through the router against a real emulated engine (in-process, loopback)."""

from __future__ import annotations

import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.loadgen import BlockText, run_bench
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer
from kvroute.workloads import make_workload


@pytest.fixture(scope="module")
def block_text(tokenizer: Tokenizer) -> BlockText:
    return BlockText(tokenizer)


@pytest.mark.parametrize("block_size", [16, 512])
def test_equal_leading_block_ids_give_equal_leading_token_blocks(
    block_text: BlockText, tokenizer: Tokenizer, block_size: int
) -> None:
    a = tokenizer.encode(block_text.prompt([7, 8, 9], block_size, 3 * block_size + 5, salt=1))
    b = tokenizer.encode(block_text.prompt([7, 8, 10, 11], block_size, 4 * block_size, salt=2))
    assert len(a) == 3 * block_size + 5 and len(b) == 4 * block_size
    assert a[: 2 * block_size] == b[: 2 * block_size]
    assert a[2 * block_size : 3 * block_size] != b[2 * block_size : 3 * block_size]
    # A block's tokens do not depend on what precedes it.
    c = tokenizer.encode(block_text.prompt([9], block_size, block_size, salt=3))
    assert a[2 * block_size : 3 * block_size] == c


def test_block_text_is_deterministic(tokenizer: Tokenizer, block_text: BlockText) -> None:
    assert BlockText(tokenizer).block(12345, 16) == block_text.block(12345, 16)
    assert block_text.block(1, 16) != block_text.block(2, 16)


async def test_bench_through_router_reports_sim_fields(tokenizer: Tokenizer, block_text: BlockText) -> None:
    settings = EmulatorSettings(
        model_name="emu",
        engine=EngineConfig(num_kv_blocks=4096, report_tokens=True, max_model_len=32768),
        time_scale=50.0,
    )
    engines = [EmulatorServer(settings, costmod.get_profile().cost, tokenizer) for _ in range(2)]
    ports = [await e.start("127.0.0.1", 0) for e in engines]
    cfg = RouterConfig(backends=tuple(BackendSpec(f"http://127.0.0.1:{p}") for p in ports), port=0)
    router = RouterServer(cfg, tokenizer=tokenizer)
    url = await router.start()
    try:
        reqs = list(make_workload("chatbot", seed=1, rate_scale=4.0, duration=3.0))
        result = await run_bench(url, reqs, block_text)
        out = result.summary("lmetric", 2)
    finally:
        await router.stop()
        for e in engines:
            await e.stop()
    assert out["requests"] == len(reqs) > 5 and out["unfinished"] == 0
    assert set(out) >= {"policy", "instances", "ttft_ms", "tpot_ms", "e2e_ms", "kv_hit_rate"}
    assert 0 < out["ttft_ms"]["p50"] <= out["ttft_ms"]["p99"] <= out["e2e_ms"]["p99"]
    # Chat turns share system prompts and earlier turns: the engines report cache hits.
    assert out["kv_hit_rate"] > 0.2
    assert all(b.waiting == 0 and b.running == 0 for b in router.state.backends)
