"""Salted chats in front of real vLLM with 128-token engine blocks and 16-token router blocks: the
router's predicted ``cached_tokens`` equals vLLM's after the engine evicted a block that shared only
its leading router blocks with a block it still holds.

The scenario (one engine, so the prediction is the holder's): two chats under one ``cache_salt`` (a
tenant's) with the same system prompt and different questions, so that their first engine blocks (X
and Y) share the router blocks of the system prompt only; then filler prompts sent to the engine
directly, each followed by the second chat again, until the engine has cycled its whole pool: X,
never touched again, is evicted; Y, touched every round, stays. Before the router counted how many
engine blocks hold each router block, X's ``BlockRemoved`` dropped the shared router blocks and the
repeated chat was predicted 0 cached tokens while vLLM served all of its whole blocks.

With ``KVROUTE_CAPTURE_EVENTS=PATH`` the engine's KV event batches of the run (the raw msgpack,
base64), the repeated chat's token ids and what vLLM served each round are written to PATH:
``tests/fixtures/vllm_events/salted_chats.json``
was made so, and ``tests/routing/test_kvview_vllm_events.py`` replays it without vLLM.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

from kvroute.server.app import RouterServer
from kvroute.server.stages.prepare import prepare_inline
from kvroute.server.wire.validate import parse_request

from .harness import BLOCKS, POOL_TOKENS, SERVED, Fleet, post, real_vllm, words
from .test_router_vllm import chat, quiet, settle

pytestmark = real_vllm

SALT = "tenant-7"


class Capture:
    """The raw KV event batches one engine publishes, in order, from a SUB socket of our own."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)
        self.frames: list[tuple[int, bytes]] = []
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            parts = await self._sock.recv_multipart()
            if len(parts) >= 2:
                self.frames.append((int.from_bytes(parts[-2], "big"), parts[-1]))

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._sock.close(0)
        self._ctx.term()


async def test_salted_chat_after_a_shared_block_is_evicted(fleet: Fleet, router_factory: Any) -> None:
    """Every round's prediction equals vLLM's ``cached_tokens`` (block 128 engine, block 16 router),
    before and after the engine evicts the other chat's first block."""
    eng = BLOCKS.index(128)
    proc = fleet.procs[eng]
    cap = Capture(proc.endpoint.kv_events)
    await asyncio.sleep(0.5)  # the SUB socket joins
    router: RouterServer = await router_factory(fleet.specs()[eng : eng + 1], policy="round-robin")
    await settle(router)
    system = {"role": "system", "content": words(700, 12)}
    rounds: list[dict[str, int]] = []
    async with aiohttp.ClientSession() as http:
        other = chat([system, {"role": "user", "content": words(701, 60)}], 1, cache_salt=SALT)
        a = await post(http, router.url, "/v1/chat/completions", other)
        assert a.status == 200, a.body
        assert a.prompt_tokens > 128  # its first engine block is full: X
        convo = [system, {"role": "user", "content": words(702, 150)}]
        body = chat(convo, 1, cache_salt=SALT)
        b = await post(http, router.url, "/v1/chat/completions", body)
        assert b.status == 200, b.body
        await quiet(router)
        # fillers straight to the engine (unsalted, each its own text), the chat again after each
        filler_tokens = 0
        for i in range(40):
            r = await post(http, router.url, "/v1/chat/completions", body)
            assert r.status == 200, r.body
            rounds.append(
                {"round": i, "predicted": r.predicted, "cached": r.cached, "prompt": r.prompt_tokens}
            )
            if filler_tokens > 2 * POOL_TOKENS:
                break
            f = await post(
                http,
                proc.url,
                "/v1/completions",
                {"model": SERVED, "prompt": words(710 + i, 220), "max_tokens": 1},
            )
            assert f.status == 200, f.body
            filler_tokens += f.prompt_tokens
            await quiet(router)
    await cap.close()
    out = os.environ.get("KVROUTE_CAPTURE_EVENTS")
    if out:
        ids = list(prepare_inline(router.state, parse_request(orjson.dumps(body), chat=True)).ids)
        fixture = {
            "source": "vLLM 0.32.0 (CPU build), tiny Qwen3, --block-size 128, 64 KV blocks; "
            "tests/real_vllm/test_salted_view.py with KVROUTE_CAPTURE_EVENTS",
            "engine_block_size": 128,
            "cache_salt": SALT,
            "prompt_ids": ids,
            "served_cached_tokens": [r["cached"] for r in rounds],
            "batches": [[seq, base64.b64encode(p).decode()] for seq, p in cap.frames],
        }
        Path(out).write_text(json.dumps(fixture, separators=(",", ":")) + "\n")
    wrong = [r for r in rounds if r["predicted"] != r["cached"]]
    assert not wrong, f"{len(wrong)} of {len(rounds)} rounds mispredicted: {wrong[:5]}"
    assert rounds[-1]["cached"] >= 640  # the continued chat stayed cached through the fillers
