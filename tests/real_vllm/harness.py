"""Fixtures and helpers for the real-vLLM suite (``make test-vllm``; pytest marker ``real_vllm``).

The suite runs kvroute in front of real ``vllm serve`` processes: vLLM 0.32's CPU build in
``.venv-vllm`` (``make vllm-venv``) serving the tiny random-weight Qwen3 model that
``scripts/build_tiny_model.py`` builds. ``KVROUTE_VLLM_VENV`` and ``KVROUTE_VLLM_MODEL`` point
elsewhere; without a venv holding ``bin/vllm`` and a model folder every test is skipped with that
reason.

One session-scoped :class:`Fleet` of two servers serves every test (a start costs ~45 s and ~2.5 GiB
each on this machine): engine 0 with 32-token blocks (the smallest vLLM's CPU attention takes; GPUs
default to 16), engine 1 with 128-token blocks (the CPU platform's default), both with prefix caching,
KV events with replay, prompt token details, a request-given chat template allowed, and a small KV
pool (8,192 tokens each) so that evictions happen. Tests keep their texts apart (:func:`words` with a
test's own seed), so one test's cached blocks never count in another's predictions. A test that kills
an engine leaves it dead; :func:`fleet` starts a fresh one before the next test.
"""

from __future__ import annotations

import os
import random
import tempfile
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvroute.integrations.vllm_launch import VllmProcess, VllmSettings, find_vllm, start_fleet, stop_all
from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("KVROUTE_VLLM_VENV") or ROOT / ".venv-vllm").absolute()
MODEL = Path(os.environ.get("KVROUTE_VLLM_MODEL") or VENV / "tiny-qwen3").absolute()
VLLM = find_vllm(VENV)
SERVED = "tiny"
BLOCKS = (32, 128)  # engine 0's and engine 1's block sizes, tokens
POOL_TOKENS = 8192  # KV pool per engine, tokens
ADMIN = "real-vllm-admin"

available = VLLM is not None and (MODEL / "config.json").is_file()
needs_vllm = pytest.mark.skipif(
    not available,
    reason=f"no vLLM virtualenv at {VENV} (bin/vllm) or no model at {MODEL}: run `make vllm-venv`, "
    "or set KVROUTE_VLLM_VENV and KVROUTE_VLLM_MODEL",
)
real_vllm = [pytest.mark.real_vllm, needs_vllm]


def engine_settings(block_size: int, **kw: Any) -> VllmSettings:
    """The suite's server settings at ``block_size`` (see the module docstring)."""
    assert VLLM is not None
    base: dict[str, Any] = {
        "vllm": VLLM,
        "model": str(MODEL),
        "served_model_name": SERVED,
        "block_size": block_size,
        "num_blocks": POOL_TOKENS // block_size,
        "max_model_len": 4096,
        "extra_args": ("--trust-request-chat-template",),
    }
    base.update(kw)
    return VllmSettings(**base)


class Fleet:
    """The session's real vLLM servers; :meth:`ensure` restarts one that a test killed."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.procs: list[VllmProcess] = start_fleet([engine_settings(b) for b in BLOCKS], log_dir)

    def ensure(self) -> None:
        for i, p in enumerate(self.procs):
            if not p.alive() or not p.healthy():
                p.stop()
                self.procs[i] = start_fleet([p.settings], self.log_dir)[0]

    def specs(self) -> tuple[BackendSpec, ...]:
        return tuple(BackendSpec(p.url, p.endpoint.kv_events, p.endpoint.kv_replay) for p in self.procs)

    @property
    def urls(self) -> list[str]:
        return [p.url for p in self.procs]

    def stop(self) -> None:
        stop_all(self.procs)


@pytest.fixture(scope="session")
def _fleet() -> Iterator[Fleet]:
    if not available:
        pytest.skip("no vLLM virtualenv (make vllm-venv)")
    fleet = Fleet(tempfile.mkdtemp(prefix="kvroute-real-vllm-"))
    try:
        yield fleet
    finally:
        fleet.stop()


@pytest.fixture
def fleet(_fleet: Fleet) -> Fleet:
    _fleet.ensure()
    return _fleet


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """The model folder's tokenizer and chat template: what vLLM loads."""
    return load_tokenizer(str(MODEL))


@dataclass
class Routed:
    """One response through the router: the body (the last SSE chunk's usage when streamed), the
    backend that answered, and the router's prediction and prompt token count."""

    status: int
    body: dict[str, Any]
    backend: str
    predicted: int
    prompt_tokens_router: int

    @property
    def usage(self) -> dict[str, Any]:
        return dict(self.body.get("usage") or {})

    @property
    def cached(self) -> int:
        return int((self.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    @property
    def prompt_tokens(self) -> int:
        return int(self.usage.get("prompt_tokens") or 0)


async def post(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> Routed:
    """POST ``body`` to ``url + path`` with explanations on; a streamed body is read to its end."""
    async with http.post(url + path, json=body, headers={"x-kvroute-explain": "1"}) as r:
        h = r.headers
        if body.get("stream"):
            import orjson

            last: dict[str, Any] = {}
            async for line in r.content:
                if line.startswith(b"data: {"):
                    chunk = orjson.loads(line[6:])
                    if chunk.get("usage"):
                        last = chunk
            data = last
        else:
            data = await r.json(content_type=None)
        return Routed(
            r.status,
            data,
            h.get("x-kvroute-backend", ""),
            int(h.get("x-kvroute-cached-tokens") or -1),
            int(h.get("x-kvroute-prompt-tokens") or -1),
        )


@pytest.fixture
async def router_factory(tokenizer: Tokenizer) -> AsyncIterator[Any]:
    """``await make(specs, **config)`` starts a router in front of ``specs``; all stop at the end."""
    started: list[RouterServer] = []

    async def make(specs: Sequence[BackendSpec], **kw: Any) -> RouterServer:
        cfg = RouterConfig(
            backends=tuple(specs),
            port=0,
            tokenizer=str(MODEL),
            health_interval_s=0.2,
            admin_token=ADMIN,
            **kw,
        )
        tok = tokenizer if "chat_template" not in kw else None
        server = RouterServer(cfg, tokenizer=tok)
        await server.start()
        started.append(server)
        return server

    yield make
    for s in started:
        await s.stop()


def words(seed: int, n: int) -> str:
    """``n`` words of text that no other seed's text shares a block with (the suite's tests each use
    their own seeds)."""
    rng = random.Random(seed)
    vocab = _VOCAB
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(1000)}" for _ in range(n))


_VOCAB = [
    "alpha",
    "bravo",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "grove",
    "harbor",
    "island",
    "jasper",
    "kettle",
    "lumen",
    "maple",
    "nectar",
    "orbit",
    "pepper",
    "quartz",
    "raven",
    "sierra",
    "timber",
    "umber",
    "velvet",
    "willow",
    "xenon",
    "yonder",
    "zephyr",
]
