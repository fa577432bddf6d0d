"""Fixtures: emulated engines on free loopback ports, with a cheap linear cost model."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine.cost import LinearCostModel
from kvroute.engine.types import EngineConfig
from kvroute.tokenizer import Tokenizer, load_tokenizer

MODEL = "test-model"
# 10 ms per decoding sequence, 20 µs per prefill token (model seconds)
COST = LinearCostModel("test-linear", decode_s_per_seq=0.01, prefill_s_per_token=2e-5)


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_settings(
    *,
    blocks: int = 512,
    max_model_len: int = 4096,
    time_scale: float = 20.0,
    kv: KVEventsSettings | None = None,
    metrics_name_filter: bool = False,
    **engine: Any,
) -> EmulatorSettings:
    cfg = EngineConfig(num_kv_blocks=blocks, max_model_len=max_model_len, report_tokens=True, **engine)
    return EmulatorSettings(
        MODEL, cfg, time_scale, default_max_tokens=8, kv_events=kv, metrics_name_filter=metrics_name_filter
    )


@pytest.fixture
async def start_server(tokenizer: Tokenizer) -> AsyncIterator[Callable[..., Any]]:
    """``await start_server(**settings)`` → a started EmulatorServer; all are stopped at teardown."""
    servers: list[EmulatorServer] = []

    async def start(**kw: Any) -> EmulatorServer:
        server = EmulatorServer(make_settings(**kw), COST, tokenizer)
        await server.start("127.0.0.1", 0)
        servers.append(server)
        return server

    yield start
    for s in servers:
        await s.stop()


@pytest.fixture
async def server(start_server: Callable[..., Any]) -> EmulatorServer:
    return await start_server()  # type: ignore[no-any-return]
