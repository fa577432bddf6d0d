"""HTTP end to end with a model's own chat template (Llama 3.2): router and emulated engines on
loopback, KV events over ZMQ (see tests/test_chat_template.py for the template tests)."""

from __future__ import annotations

import asyncio
import datetime
import json
from pathlib import Path

import aiohttp
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from kvroute.chat_template import ChatTemplate
from kvroute.tokenizer import Tokenizer, default_tokenizer_path, load_tokenizer

from .test_e2e import Cluster, eventually

FIX = Path(__file__).parent.parent / "fixtures" / "chat_templates"
SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MARKERS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama_tokenizer(tmp: Path) -> Tokenizer:
    """The bundled Qwen3 tokenizer with Llama 3's markers as special tokens, in a folder holding the
    Llama 3.2 template (``chat_template.jinja``); ``strftime_now`` at a fixed date."""
    hf = HFTokenizer.from_file(str(default_tokenizer_path()))
    hf.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    hf.save(str(tmp / "tokenizer.json"))
    (tmp / "chat_template.jinja").write_text((FIX / "llama-3.2-instruct.jinja").read_text())
    (tmp / "tokenizer_config.json").write_text(json.dumps(SPECIAL))
    tok = load_tokenizer(tmp)
    assert tok.template is not None
    tok.template = ChatTemplate(tok.template.source, "llama", SPECIAL, lambda: datetime.datetime(2025, 1, 15))
    return tok


def turns(n: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You answer briefly and precisely. " * 6}]
    for i in range(n):
        msgs.append({"role": "user", "content": f"Question {i}: what about item {i}? " * 5})
        msgs.append({"role": "assistant", "content": f"Item {i} is fine. " * 4})
    msgs.append({"role": "user", "content": "Summarise."})
    return msgs


async def test_http_second_turn_exact_hit_with_a_non_chatml_template(tmp_path: Path) -> None:
    """Router and emulated engines all render the Llama 3.2 template (KV events on): the second
    turn goes to the engine holding the first and its ``cached_tokens`` is the common prefix of the
    two prompts' tokens, in full blocks; a conversation the template rejects is a 400 with its
    message."""
    tok = llama_tokenizer(tmp_path)
    cluster = Cluster()
    try:
        for _ in range(3):
            await cluster.add_engine(tok, events=True)
        url = await cluster.start_router(tok, policy="lmetric")
        assert cluster.router is not None
        async with aiohttp.ClientSession() as http:

            async def chat(msgs: list[dict[str, str]], max_tokens: int) -> dict:  # type: ignore[type-arg]
                body = {"model": "emu", "messages": msgs, "max_tokens": max_tokens}
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    return {"status": r.status, **(await r.json())}

            msgs = turns(1)[:2]
            first = await chat(msgs, 8)
            assert first["status"] == 200
            subs = cluster.router.subscribers
            await eventually(lambda: any(s.batches for s in subs))
            await asyncio.sleep(0.2)
            before = [e.model.stats().prefix_query_tokens for e in cluster.engines]
            msgs2 = [
                *msgs,
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And more?"},
            ]
            second = await chat(msgs2, 4)
            assert second["status"] == 200
            after = [e.model.stats().prefix_query_tokens for e in cluster.engines]
            grew = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if b > a]
            assert len(grew) == 1
            ids1 = tok.encode(tok.render_chat(msgs))
            ids2 = tok.encode(tok.render_chat(msgs2))
            common = next((i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b), len(ids1))
            assert common > 64
            assert second["usage"]["prompt_tokens"] == len(ids2)
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == common // 16 * 16
            rejected = await chat([{"role": "user", "content": "x"}, {"role": "ipython", "content": "y"}], 4)
            tools_bad = await chat([{"role": "assistant", "content": "x", "tool_calls": [{}, {}]}], 4)
            assert tools_bad["status"] == 400 and "single tool-calls" in tools_bad["error"]["message"]
            assert rejected["status"] == 200  # the Llama template accepts ipython turns
    finally:
        await cluster.close()


async def test_kvroute_up_with_a_non_chatml_template_gives_exact_hits(tmp_path: Path) -> None:
    """The command itself: ``kvroute up --tokenizer DIR`` (a folder with the Llama 3.2 template) starts
    engines and the router that all render it; the second turn lands on the backend holding the first
    (``x-kvroute-backend``) with ``cached_tokens`` as predicted (``x-kvroute-cached-tokens``)."""
    import os
    import signal
    import sys

    from kvroute.server.cluster import free_port

    from .test_shutdown import SRC

    tok = llama_tokenizer(tmp_path)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    argv = [sys.executable, "-m", "kvroute.cli", "up", "--instances", "2", "--port", str(port)]
    argv += ["--tokenizer", str(tmp_path), "--explain", "--drain-grace", "0"]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(600):
                assert proc.returncode is None, "kvroute up exited early"
                try:
                    async with http.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)

            async def chat(msgs: list[dict[str, str]], max_tokens: int) -> tuple[dict, dict]:  # type: ignore[type-arg]
                body = {"model": "kvroute-emulated", "messages": msgs, "max_tokens": max_tokens}
                async with http.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return dict(r.headers), await r.json()

            msgs = turns(1)[:2]
            h1, first = await chat(msgs, 8)
            await asyncio.sleep(0.5)  # the engine's KV events reach the router
            msgs2 = [
                *msgs,
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And more?"},
            ]
            h2, second = await chat(msgs2, 4)
            assert h2["x-kvroute-backend"] == h1["x-kvroute-backend"]
            ids1, ids2 = tok.encode(tok.render_chat(msgs)), tok.encode(tok.render_chat(msgs2))
            common = next((i for i, (a, b) in enumerate(zip(ids1, ids2, strict=False)) if a != b), len(ids1))
            cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert second["usage"]["prompt_tokens"] == len(ids2)
            assert cached == common // 16 * 16 > 64
            assert int(h2["x-kvroute-cached-tokens"]) == cached  # the router predicted it exactly
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
