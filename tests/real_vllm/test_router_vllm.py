"""kvroute's router in front of two real vLLM 0.32 servers (CPU build, tiny Qwen3; see conftest).

Engine 0 caches in 32-token blocks, engine 1 in 128-token blocks; the router keeps its own 16-token
blocks. vLLM hits whole engine blocks only, so a router that predicts in its own blocks is off by up
to one engine block; the predictions checked here must equal vLLM's ``cached_tokens`` exactly.
(The issue asked for engine block size 16 as on GPUs: vLLM's CPU attention refuses block sizes that
are not multiples of 32, so 32 is the smallest this build runs.)
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from kvroute.server.app import RouterServer

from .harness import ADMIN, BLOCKS, SERVED, Fleet, Routed, post, real_vllm, words

pytestmark = real_vllm

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates"


async def settle(router: RouterServer, timeout_s: float = 30.0) -> None:
    """Wait until every backend is healthy, its KV event replay done and its live subscription on."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(b.healthy for b in router.state.backends):
            break
        await asyncio.sleep(0.1)
    # the replay asked for on subscribe: the engines' earlier events (the session's servers keep
    # thousands of batches; under load the replay takes longer than the router's start waits)
    await router.fleet.wait_synced(max(1.0, deadline - time.monotonic()))
    await asyncio.sleep(0.5)  # ZMQ SUB joins late: give the live subscription a moment


async def quiet(router: RouterServer, idle_s: float = 0.3, timeout_s: float = 5.0) -> None:
    """Wait until no KV event batch arrived for ``idle_s`` seconds: the engines' events so far are in."""
    deadline = time.monotonic() + timeout_s
    last = sum(s.batches for s in router.subscribers)
    calm_since = time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = sum(s.batches for s in router.subscribers)
        if now != last:
            last, calm_since = now, time.monotonic()
        elif time.monotonic() - calm_since >= idle_s:
            return


def chat(messages: list[dict[str, Any]], max_tokens: int = 4, **kw: Any) -> dict[str, Any]:
    return {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


def engine_index(fleet: Fleet, r: Routed) -> int:
    return fleet.urls.index(r.backend)


async def test_exact_view_from_real_events(fleet: Fleet, router_factory: Any) -> None:
    """A prompt sent to an engine directly (not through the router) reaches the router's exact view
    by the engine's KV events alone: the router sends the repeat to that engine and predicts vLLM's
    own count of cached tokens."""
    router = await router_factory(fleet.specs(), policy="lmetric-kv")
    await settle(router)
    assert all(router.state.kv.mode(i, router.state.clock()) == "exact" for i in range(2))
    async with aiohttp.ClientSession() as http:
        for i, url in enumerate(fleet.urls):
            msgs = [{"role": "user", "content": words(100 + i, 300)}]
            direct = await post(http, url, "/v1/chat/completions", chat(msgs))
            assert direct.status == 200 and direct.cached == 0
            await quiet(router)
            r = await post(http, router.url, "/v1/chat/completions", chat(msgs))
            assert r.status == 200, r.body
            assert r.backend == url  # the holder, known from its events only
            assert r.cached == BLOCKS[i] * ((r.prompt_tokens - 1) // BLOCKS[i]) > 0
            assert r.predicted == r.cached, (BLOCKS[i], r.predicted, r.cached)


async def run_conversations(
    router: RouterServer, convs: int, turns: int, seed: int, salted: set[int], user_words: int = 40
) -> list[tuple[int, int, Routed]]:
    """``convs`` conversations of ``turns`` turns, sent one request at a time (turn by turn, the
    conversations interleaved in waves of 4), each turn carrying the replies as vLLM gave them;
    conversations in ``salted`` send a ``cache_salt`` of their own. Returns (conversation, turn,
    response) in send order."""
    out: list[tuple[int, int, Routed]] = []
    history: dict[int, list[dict[str, Any]]] = {
        c: [{"role": "system", "content": words(seed * 1000 + c % 3, 60)}] for c in range(convs)
    }
    async with aiohttp.ClientSession() as http:
        for wave in range(0, convs, 4):
            members = range(wave, min(wave + 4, convs))
            for t in range(turns):
                for c in members:
                    history[c].append(
                        {"role": "user", "content": words(seed * 1000 + 100 + c * 50 + t, user_words)}
                    )
                    extra = {"cache_salt": f"salt-{seed}-{c}"} if c in salted else {}
                    stream = (c + t) % 2 == 0
                    if stream:
                        extra |= {"stream": True, "stream_options": {"include_usage": True}}
                    r = await post(http, router.url, "/v1/chat/completions", chat(history[c], **extra))
                    assert r.status == 200, r.body
                    out.append((c, t, r))
                    reply = "" if stream else r.body["choices"][0]["message"]["content"]
                    history[c].append({"role": "assistant", "content": reply or "ok"})
                    await quiet(router, idle_s=0.2)  # its KV events in (they may trail the response)
    return out


async def test_multiturn_predicted_equals_real_cached_tokens(fleet: Fleet, router_factory: Any) -> None:
    """200 multi-turn chat requests, half the conversations salted (``cache_salt``), over engines at
    block sizes 32 and 128 with pools small enough to evict: every prediction equals vLLM's
    ``cached_tokens``."""
    # round-robin: every conversation alternates between the engines, so both block sizes serve
    # (sequential lmetric-kv requests all tie onto engine 0); the prediction is policy-independent
    router = await router_factory(fleet.specs(), policy="round-robin")
    await settle(router)
    salted = set(range(1, 20, 2))
    results = await run_conversations(router, convs=20, turns=10, seed=7, salted=salted)
    assert len(results) == 200
    per_engine = Counter(engine_index(fleet, r) for _, _, r in results)
    assert set(per_engine) == {0, 1}, per_engine  # both block sizes served some
    hits = [r for _, _, r in results if r.cached > 0]
    assert len(hits) > 50  # the conversations did come back to their cache
    diag = [(s.backend, s.batches, s.gaps) for s in router.subscribers], router.state.kv.skipped_blocks
    wrong = [
        (c, t, BLOCKS[engine_index(fleet, r)], r.predicted, r.cached)
        for c, t, r in results
        if r.predicted != r.cached
    ]
    assert not wrong, (
        f"{len(wrong)} of 200 predictions off (conversation, turn, engine block, predicted, real): {wrong[:10]}; subscribers (backend, batches, gaps), skipped blocks: {diag}"
    )


async def test_salted_repeat_and_unsalted_text(fleet: Fleet, router_factory: Any) -> None:
    """A salted prompt's repeat is a predicted hit on its holder; the same text unsalted, or with
    another salt, is a predicted miss, as vLLM makes it (the salt keys the first block)."""
    router = await router_factory(fleet.specs(), policy="lmetric-kv")
    await settle(router)
    msgs = [{"role": "user", "content": words(300, 400)}]
    async with aiohttp.ClientSession() as http:
        first = await post(http, router.url, "/v1/chat/completions", chat(msgs, cache_salt="s1"))
        await quiet(router)
        again = await post(http, router.url, "/v1/chat/completions", chat(msgs, cache_salt="s1"))
        assert again.backend == first.backend and again.cached > 0
        assert again.predicted == again.cached
        await quiet(router)
        plain = await post(http, router.url, "/v1/chat/completions", chat(msgs))
        assert plain.cached == 0  # vLLM: the unsalted text does not hit the salted blocks
        assert plain.predicted == 0, f"predicted {plain.predicted} for the unsalted text on {plain.backend}"
        await quiet(router)
        other = await post(http, router.url, "/v1/chat/completions", chat(msgs, cache_salt="s2"))
        assert other.predicted == other.cached == 0
        await quiet(router)
        # the unsalted text again: now a hit where the unsalted request went
        r = await post(http, router.url, "/v1/chat/completions", chat(msgs))
        assert r.backend == plain.backend and r.predicted == r.cached > 0


async def test_prompt_tokens_equal_vllm(fleet: Fleet, router_factory: Any, tokenizer: Any) -> None:
    """The router's prompt token count equals vLLM's for chat, completions, content parts and tools."""
    router = await router_factory(fleet.specs(), policy="round-robin")
    await settle(router)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather at a place",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", chat([{"role": "user", "content": words(400, 50)}])),
        (
            "/v1/chat/completions",
            chat(
                [
                    {"role": "system", "content": "Be brief."},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": words(401, 20)},
                            {"type": "text", "text": "and?"},
                        ],
                    },
                ]
            ),
        ),
        (
            "/v1/chat/completions",
            chat(
                [
                    {"role": "user", "content": "Weather in Paris?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                ],
                tools=tools,
                tool_choice="none",  # vLLM needs a tool parser for "auto"
            ),
        ),
        ("/v1/completions", {"model": SERVED, "prompt": words(402, 80), "max_tokens": 3}),
        (
            "/v1/completions",
            {"model": SERVED, "prompt": "Hello, world! " * 5, "max_tokens": 3, "stream": True},
        ),
    ]
    async with aiohttp.ClientSession() as http:
        for path, body in bodies:
            r = await post(http, router.url, path, body)
            assert r.status == 200, r.body
            if body.get("stream") and not r.usage:
                continue  # a stream without include_usage carries no usage
            assert r.prompt_tokens_router == r.prompt_tokens, (
                path,
                body,
                r.prompt_tokens_router,
                r.prompt_tokens,
            )


async def test_prompt_tokens_with_another_template(fleet: Fleet, router_factory: Any) -> None:
    """With Llama 3.2's chat template (given to kvroute as ``chat_template`` and to vLLM in the
    request), the router's prompt token count still equals vLLM's."""
    template = TEMPLATES / "llama-3.2-instruct.jinja"
    router = await router_factory(fleet.specs(), policy="round-robin", chat_template=str(template))
    await settle(router)
    text = template.read_text()
    async with aiohttp.ClientSession() as http:
        for seed in (500, 501):
            msgs = [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": words(seed, 40)},
            ]
            r = await post(http, router.url, "/v1/chat/completions", chat(msgs, chat_template=text))
            assert r.status == 200, r.body
            assert r.prompt_tokens_router == r.prompt_tokens > 0


async def test_reset_prefix_cache(fleet: Fleet, router_factory: Any) -> None:
    """After ``POST /reset_prefix_cache`` on the holder, the damage is bounded: at most the first
    request after it is predicted from the stale view, and the next one is predicted right."""
    router = await router_factory(fleet.specs(), policy="lmetric-kv")
    await settle(router)
    msgs = [{"role": "user", "content": words(600, 400)}]
    async with aiohttp.ClientSession() as http:
        first = await post(http, router.url, "/v1/chat/completions", chat(msgs))
        await quiet(router)
        holder = first.backend
        async with http.post(holder + "/reset_prefix_cache") as r:
            assert r.status == 200, await r.text()
        await quiet(router)
        after = [await post(http, router.url, "/v1/chat/completions", chat(msgs))]
        await quiet(router)
        after.append(await post(http, router.url, "/v1/chat/completions", chat(msgs)))
    assert after[0].cached == 0  # vLLM really dropped it
    assert after[1].predicted == after[1].cached > 0  # and the router knows again


async def test_router_started_after_engines(fleet: Fleet, router_factory: Any) -> None:
    """Engines that served traffic before the router existed: the router's first request is predicted
    from their replayed events, not from an empty view."""
    msgs = [{"role": "user", "content": words(700, 400)}]
    async with aiohttp.ClientSession() as http:
        direct = await post(http, fleet.urls[1], "/v1/chat/completions", chat(msgs))
        assert direct.status == 200
        router = await router_factory(fleet.specs(), policy="lmetric-kv")
        await settle(router)
        assert all(s.synced.is_set() for s in router.subscribers)
        r = await post(http, router.url, "/v1/chat/completions", chat(msgs))
    assert r.backend == fleet.urls[1], [(s.backend, s.replayed, s.partial) for s in router.subscribers]
    assert r.predicted == r.cached > 0


async def test_evictions(fleet: Fleet, router_factory: Any) -> None:
    """More distinct prompts than engine 0's pool holds: vLLM evicts the oldest, the router sees the
    removals, and predicts the evicted prompt's repeat as the miss (or partial hit) vLLM makes."""
    router = await router_factory(fleet.specs()[:1], policy="lmetric-kv")
    await settle(router)
    async with aiohttp.ClientSession() as http:
        old = [{"role": "user", "content": words(800, 600)}]
        await post(http, router.url, "/v1/chat/completions", chat(old))
        for k in range(12):  # ~12 x 1,000 tokens through an 8,192-token pool
            r = await post(
                http,
                router.url,
                "/v1/chat/completions",
                chat([{"role": "user", "content": words(801 + k, 600)}]),
            )
            assert r.status == 200
        await quiet(router)
        again = await post(http, router.url, "/v1/chat/completions", chat(old))
    assert again.cached < again.prompt_tokens // 2  # it was evicted (at least mostly)
    assert again.predicted == again.cached


async def test_drain_backend(fleet: Fleet, router_factory: Any) -> None:
    """A backend drained through the admin API finishes its stream in flight and gets no new
    request; undrained, it takes requests again."""
    router = await router_factory(fleet.specs(), policy="round-robin")
    await settle(router)
    auth = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession() as http:
        body = chat(
            [{"role": "user", "content": words(900, 30)}], max_tokens=64, stream=True, ignore_eos=True
        )
        body["stream_options"] = {"include_usage": True}
        slow = asyncio.create_task(post(http, router.url, "/v1/chat/completions", body))
        await asyncio.sleep(0.3)
        async with http.get(router.url + "/admin/backends", headers=auth) as r:
            listing = (await r.json())["data"]
        busy = next(b for b in listing if b["url"] == router.state.backends[0].url)
        async with http.post(f"{router.url}/admin/backends/{busy['id']}/drain", headers=auth) as r:
            assert r.status == 202, await r.text()
        quick = [
            await post(http, router.url, "/v1/chat/completions", chat([{"role": "user", "content": f"q{i}"}]))
            for i in range(4)
        ]
        long = await slow
        assert long.status == 200 and long.usage["completion_tokens"] == 64
        assert {q.backend for q in quick} == {router.state.backends[1].url}
        async with http.post(f"{router.url}/admin/backends/{busy['id']}/undrain", headers=auth) as r:
            assert r.status == 202
        back = [
            await post(http, router.url, "/v1/chat/completions", chat([{"role": "user", "content": f"u{i}"}]))
            for i in range(4)
        ]
        assert router.state.backends[0].url in {b.backend for b in back}


async def test_engine_killed_mid_traffic(fleet: Fleet, router_factory: Any) -> None:
    """SIGKILL one engine while requests flow: no client sees an error before its first byte (the
    router retries those on the other engine), and traffic goes on on the survivor. The conftest
    restarts the killed engine for later tests."""
    router = await router_factory(fleet.specs(), policy="round-robin")
    await settle(router)
    victim = fleet.procs[1]
    errors: list[str] = []
    ok = 0

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        nonlocal ok
        body = chat([{"role": "user", "content": words(1000 + i, 30)}], max_tokens=8, stream=True)
        try:
            async with http.post(router.url + "/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    errors.append(f"{i}: status {r.status} {await r.text()}")
                    return
                first = await r.content.readline()  # the first byte came: later breaks are allowed
                assert first
                async for _ in r.content:
                    pass
            ok += 1
        except (aiohttp.ClientError, AssertionError) as exc:
            if "first" not in locals():
                errors.append(f"{i}: {exc!r} before the first byte")

    async with aiohttp.ClientSession() as http:
        tasks = []
        for i in range(40):
            tasks.append(asyncio.create_task(one(http, i)))
            if i == 15:
                victim.kill()
            await asyncio.sleep(0.05)
        await asyncio.gather(*tasks)
    assert not errors, errors
    assert ok >= 30
    assert not router.state.backends[1].healthy or not victim.alive()
