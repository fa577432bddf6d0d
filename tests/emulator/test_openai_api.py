"""The OpenAI API as vLLM serves it, through the official `openai` client and raw HTTP."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from kvroute.emulator.server import FILLER_WORDS, EmulatorServer

from .conftest import MODEL


def client(server: EmulatorServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


def filler(n: int) -> str:
    return "".join(" " + FILLER_WORDS[i % len(FILLER_WORDS)] for i in range(n))


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant. " * 10},
    {"role": "user", "content": "Name three prime numbers, please."},
]


async def test_models(server: EmulatorServer):
    async with client(server) as c:
        models = await c.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].owned_by == "vllm"


async def test_chat_non_streaming_and_prefix_cache_hit(server: EmulatorServer, tokenizer):
    prompt_len = len(tokenizer.encode_chat(MESSAGES))
    async with client(server) as c:
        first = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
        second = await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=7)  # type: ignore[arg-type]
    assert first.object == "chat.completion" and first.model == MODEL
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == filler(5)
    assert first.choices[0].finish_reason == "length"
    assert first.usage is not None and second.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens) == (prompt_len, 5)
    assert first.usage.total_tokens == prompt_len + 5
    assert (
        first.usage.prompt_tokens_details is not None and first.usage.prompt_tokens_details.cached_tokens == 0
    )
    # the same prompt again: every full block but the one holding the last prompt token is a hit
    assert second.usage.completion_tokens == 7
    assert second.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details.cached_tokens == 16 * ((prompt_len - 1) // 16) > 0
    assert server.model.stats().prefix_hit_tokens == second.usage.prompt_tokens_details.cached_tokens


async def test_chat_streaming_with_usage(server: EmulatorServer, tokenizer):
    async with client(server) as c:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=6,
            stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
        chunks = [ch async for ch in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch.choices[0].delta.content for ch in chunks[1:] if ch.choices]
    assert "".join(x or "" for x in content) == filler(6)
    assert len(content) == 6  # one chunk per modelled decode step
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert len({ch.id for ch in chunks}) == 1


async def test_chat_stream_without_usage_and_default_max_tokens(server: EmulatorServer):
    async with client(server) as c:
        stream = await c.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        chunks = [ch async for ch in stream]
    assert all(ch.usage is None for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == filler(8)  # the fixture's default_max_tokens


async def test_completions_text_and_token_ids(server: EmulatorServer, tokenizer):
    async with client(server) as c:
        out = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
        ids = tokenizer.encode("Once upon a time, far away")
        out_ids = await c.completions.create(model=MODEL, prompt=ids, max_tokens=3)
        default = await c.completions.create(model=MODEL, prompt=[ids])
        stream = await c.completions.create(
            model=MODEL, prompt=ids, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        chunks = [ch async for ch in stream]
    assert out.object == "text_completion"
    assert out.choices[0].text == filler(4) and out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.prompt_tokens == len(tokenizer.encode("Once upon a time"))
    assert out_ids.usage is not None and out_ids.usage.prompt_tokens == len(ids)
    assert default.usage is not None and default.usage.completion_tokens == 16  # vLLM's completions default
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == filler(3) and len(texts) == 3
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_raw_sse_framing(server: EmulatorServer):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert len(events[:-2]) == 3  # role chunk + two tokens


async def test_tokenize_detokenize_health_version(server: EmulatorServer, tokenizer):
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/tokenize", json={"model": MODEL, "prompt": "hello world"}) as r:
            tok = await r.json()
        async with s.post(f"{base}/tokenize", json={"messages": MESSAGES}) as r:
            chat_tok = await r.json()
        async with s.post(f"{base}/detokenize", json={"tokens": tok["tokens"]}) as r:
            detok = await r.json()
        async with s.get(f"{base}/health") as r:
            health = r.status
        async with s.get(f"{base}/version") as r:
            version = await r.json()
    assert tok["tokens"] == tokenizer.encode("hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 4096
    assert chat_tok["tokens"] == tokenizer.encode_chat(MESSAGES)
    assert detok == {"prompt": "hello world"}
    assert health == 200
    assert isinstance(version["version"], str)


async def test_render_endpoints_return_token_ids_and_run_nothing(server: EmulatorServer, tokenizer):
    """vLLM's ``/v1/chat/completions/render`` and ``/v1/completions/render`` (vllm-router's
    kv_aware policy reads their ``token_ids``): the prompt's ids as the engine would run them, the
    resolved ``max_tokens``, 400/404 for what generation refuses, and nothing enters the engine."""
    base = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{base}/v1/chat/completions/render", json={"model": MODEL, "messages": MESSAGES}
        ) as r:
            chat = (r.status, await r.json())
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "cache_salt": "s1"}
        async with s.post(f"{base}/v1/completions/render", json=body) as r:
            comp = (r.status, await r.json())
        async with s.post(
            f"{base}/v1/chat/completions/render", json={"model": "other", "messages": MESSAGES}
        ) as r:
            missing = (r.status, await r.json())
        async with s.post(f"{base}/v1/completions/render", json={"model": MODEL}) as r:
            bad_body = (r.status, await r.json())
    assert chat[0] == 200 and chat[1]["token_ids"] == tokenizer.encode_chat(MESSAGES)
    assert chat[1]["model"] == MODEL and chat[1]["request_id"].startswith("chatcmpl-")
    assert chat[1]["sampling_params"]["max_tokens"] == 8  # the settings' default_max_tokens
    assert comp[0] == 200 and comp[1]["token_ids"] == tokenizer.encode("Once upon a time")
    assert comp[1]["sampling_params"]["max_tokens"] == 3 and comp[1]["cache_salt"] == "s1"
    assert missing[0] == 404 and missing[1]["error"]["code"] == 404
    assert bad_body[0] == 400 and bad_body[1]["error"]["param"] == "prompt"
    stats = server.model.stats()
    assert (stats.prefix_query_tokens, stats.running, stats.waiting) == (0, 0, 0)


async def test_openai_client_raises_on_errors(server: EmulatorServer):
    async with client(server) as c:
        with pytest.raises(openai.NotFoundError):
            await c.chat.completions.create(model="other", messages=MESSAGES)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5000)  # type: ignore[arg-type]
    assert "maximum context length is 4096 tokens" in str(info.value)
