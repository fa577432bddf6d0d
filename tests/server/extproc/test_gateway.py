"""kvroute as an endpoint picker behind a real Envoy (the ``gateway`` extra): the openai client
through Envoy, the KV-aware second turn, the fallback list, a forged destination, a client that
leaves mid-stream, and the picker killed and restarted."""

from __future__ import annotations

import asyncio
import signal

import aiohttp
import openai
import pytest

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
pytest.importorskip(
    "envoy.service.ext_proc.v3.external_processor_pb2", reason="the gateway extra is not installed"
)

from tests.server.extproc.harness import Gateway, eventually, leases_zero

from kvroute.server.extproc.messages import DESTINATION
from kvroute.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "You are a meticulous assistant who answers briefly. " * 40}


def engine_prompts(g: Gateway) -> list[int]:
    """Prompt tokens each engine was asked to prefill (its own count)."""
    return [e.model.stats().prefix_query_tokens for e in g.engines]


async def test_openai_client_through_envoy(gateway: Gateway, tokenizer: Tokenizer) -> None:
    for _ in range(2):
        await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer)
    await gateway.start_envoy()
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    try:
        models = await client.models.list()  # not inference: passed to a healthy engine
        assert [m.id for m in models.data] == ["emu"]
        done = await client.completions.create(model="emu", prompt="The capital of France is", max_tokens=5)
        assert done.usage is not None and done.usage.completion_tokens == 5 and done.choices[0].text
        chat = await client.chat.completions.create(
            model="emu", messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
        assert chat.choices[0].message.content
        pieces, usage = [], None
        stream = await client.chat.completions.create(
            model="emu",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        assert len(pieces) >= 1 and usage is not None and usage.completion_tokens == 6
        texts = []
        cstream = await client.completions.create(
            model="emu", prompt="Once upon a time", max_tokens=5, stream=True
        )
        async for c in cstream:
            texts.extend(ch.text for ch in c.choices)
        assert "".join(texts)
    finally:
        await client.close()
    state = gateway.state
    assert await eventually(lambda: state.counters.ok == 4)
    assert leases_zero(state)
    records = gateway.epp.router.observer.log.latest() if gateway.epp else []
    assert len(records) == 4 and all(r.status == 200 and r.complete for r in records)


async def test_router_errors_are_immediate_openai_errors(gateway: Gateway, tokenizer: Tokenizer) -> None:
    await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer)
    await gateway.start_envoy()
    before = engine_prompts(gateway)
    async with aiohttp.ClientSession() as s:
        async with s.post(gateway.url + "/v1/completions", data=b'{"model": "emu", "prompt": ') as r:
            assert r.status == 400
            body = await r.json()
            assert "malformed JSON" in body["error"]["message"]
        async with s.post(gateway.url + "/v1/chat/completions", json={"model": "emu"}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
        async with s.post(gateway.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
    assert engine_prompts(gateway) == before  # none reached an engine
    assert gateway.state.counters.rejected == 3


async def test_second_turn_lands_on_its_holder_with_cached_tokens(
    gateway: Gateway, tokenizer: Tokenizer
) -> None:
    for _ in range(3):
        await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer)
    await gateway.start_envoy()
    client = openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key="x", max_retries=0, default_headers={"x-kvroute-explain": "1"}
    )
    try:
        for conv in range(2):
            msgs = [
                SYSTEM,
                {"role": "user", "content": f"Conversation {conv}: tell me about topic {conv}. " * 8},
            ]
            raw = await client.chat.completions.with_raw_response.create(
                model="emu", messages=msgs, max_tokens=8
            )  # type: ignore[arg-type]
            first = raw.parse()
            holder = raw.headers["x-kvroute-backend"]
            await asyncio.sleep(0.3)  # the engines' BlockStored events reach the picker
            msgs += [
                {"role": "assistant", "content": first.choices[0].message.content or ""},
                {"role": "user", "content": "And then?"},
            ]
            raw = await client.chat.completions.with_raw_response.create(
                model="emu", messages=msgs, max_tokens=8
            )  # type: ignore[arg-type]
            second = raw.parse()
            assert raw.headers["x-kvroute-backend"] == holder
            assert second.usage is not None and second.usage.prompt_tokens_details is not None
            cached = second.usage.prompt_tokens_details.cached_tokens or 0
            assert cached >= 400 and int(raw.headers["x-kvroute-cached-tokens"]) >= 400
    finally:
        await client.close()
    assert gateway.epp is not None
    recs = gateway.epp.router.observer.log.latest()
    assert [r.cached_real is not None and r.cached_real >= 400 for r in recs[0::2]] == [True, True]


async def test_fallback_list_on_a_dead_endpoint(gateway: Gateway, tokenizer: Tokenizer) -> None:
    for _ in range(2):
        await gateway.add_engine(tokenizer)
    # health checks rarely, so the picker still ranks the dead engine first when it is asked
    await gateway.start_picker(tokenizer, health_interval_s=60.0, max_retries=1)
    await gateway.start_envoy(retries=1)
    client = openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key="x", max_retries=0, default_headers={"x-kvroute-explain": "1"}
    )
    msgs = [SYSTEM, {"role": "user", "content": "Which one holds me? " * 20}]
    try:
        raw = await client.chat.completions.with_raw_response.create(model="emu", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
        holder = raw.headers["x-kvroute-backend"]
        dead = next(i for i, s in enumerate(gateway.specs) if s.url == holder)
        await asyncio.sleep(0.3)
        await gateway.engines[dead].stop()  # its port now refuses connections
        raw = await client.chat.completions.with_raw_response.create(model="emu", messages=msgs, max_tokens=4)  # type: ignore[arg-type]
        assert raw.http_response.status_code == 200 and raw.parse().choices[0].message.content
        assert raw.headers["x-kvroute-backend"] != holder  # Envoy went down the list
        assert raw.headers["x-kvroute-retries"] == "1"
    finally:
        await client.close()
    state = gateway.state
    assert state.counters.retries == 1 and not state.backends[dead].healthy  # ejected
    assert await eventually(lambda: leases_zero(state))


async def test_forged_destination_header_is_overwritten(gateway: Gateway, tokenizer: Tokenizer) -> None:
    for _ in range(2):
        await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer)
    await gateway.start_envoy()
    headers = {"x-kvroute-explain": "1"}
    msgs = [SYSTEM, {"role": "user", "content": "Pinned by the cache. " * 20}]
    async with aiohttp.ClientSession() as s:
        async with s.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "emu", "messages": msgs, "max_tokens": 3},
            headers=headers,
        ) as r:
            assert r.status == 200
            chosen = r.headers["x-kvroute-backend"]
        other = next(sp.url for sp in gateway.specs if sp.url != chosen)
        await asyncio.sleep(0.3)
        before = engine_prompts(gateway)
        forged = {**headers, DESTINATION: other.removeprefix("http://")}
        async with s.post(
            gateway.url + "/v1/chat/completions",
            json={"model": "emu", "messages": msgs, "max_tokens": 3},
            headers=forged,
        ) as r:
            assert r.status == 200 and r.headers["x-kvroute-backend"] == chosen
    after = engine_prompts(gateway)
    got = [a - b for a, b in zip(after, before, strict=True)]
    chosen_idx = next(i for i, sp in enumerate(gateway.specs) if sp.url == chosen)
    assert got[chosen_idx] > 0 and got[1 - chosen_idx] == 0  # the forged endpoint saw nothing
    assert gateway.state.counters.retries == 0


async def test_metadata_only_routes_by_metadata(gateway: Gateway, tokenizer: Tokenizer) -> None:
    for _ in range(2):
        await gateway.add_engine(tokenizer)
    await gateway.start_picker(tokenizer, metadata_only=True)
    await gateway.start_envoy(metadata_only=True)
    client = openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0)
    try:
        for i in range(4):
            done = await client.completions.create(
                model="emu",
                prompt=f"Number {i} " * 30,
                max_tokens=2,
                extra_headers={DESTINATION: "127.0.0.1:1"},
            )
            assert done.choices[0].text
    finally:
        await client.close()
    assert gateway.state.counters.ok == 4 and gateway.state.counters.retries == 0


async def test_client_leaving_mid_stream_releases_the_lease(gateway: Gateway, tokenizer: Tokenizer) -> None:
    await gateway.add_engine(tokenizer, time_scale=1.0)  # real time: the stream lasts seconds
    await gateway.start_picker(tokenizer)
    await gateway.start_envoy()
    state = gateway.state
    body = {"model": "emu", "prompt": "Tell me a long story. " * 10, "max_tokens": 2000, "stream": True}
    async with aiohttp.ClientSession() as s:
        resp = await s.post(gateway.url + "/v1/completions", json=body)
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token
        assert state.backends[0].running == 1  # the lease marked its first token
        resp.close()  # the client goes away mid-stream
    assert await eventually(lambda: leases_zero(state))
    assert await eventually(lambda: state.counters.cancelled == 1)
    assert gateway.engines[0].disconnects == 1 or await eventually(
        lambda: gateway.engines[0].disconnects == 1
    )


async def test_picker_killed_fails_closed_and_recovers(gateway: Gateway, tokenizer: Tokenizer) -> None:
    await gateway.add_engine(tokenizer)
    gateway.start_picker_process()
    await gateway.start_envoy()
    body = {"model": "emu", "prompt": "Are you there?", "max_tokens": 2}

    async def status(s: aiohttp.ClientSession) -> int:
        async with s.post(gateway.url + "/v1/completions", json=body) as r:
            await r.read()
            return r.status

    async with aiohttp.ClientSession() as s:
        assert await _eventually_status(s, status, 200, 60.0)
        before = engine_prompts(gateway)
        assert gateway.child is not None
        gateway.child.send_signal(signal.SIGKILL)
        gateway.child.wait()
        assert await status(s) >= 500  # fails closed: an error, never an unrouted request
        assert engine_prompts(gateway) == before
        gateway.start_picker_process()  # the same port again
        assert await _eventually_status(s, status, 200, 60.0)


async def _eventually_status(s: aiohttp.ClientSession, status, want: int, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if await status(s) == want:
            return True
        await asyncio.sleep(0.2)
    return False
