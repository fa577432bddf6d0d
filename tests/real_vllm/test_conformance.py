"""The emulated engine (``kvroute engine``) against real vLLM 0.32: the same requests to both, the
answers compared field by field.

Compared: the shape of every SSE chunk of a streamed chat and completion (keys and value types, not
the sampled text), ``usage`` with ``prompt_tokens_details``, the error bodies and statuses for the
same bad requests, the ``/metrics`` families the router and dashboards read (name, type, label
names; ``vllm:cache_config_info`` with ``block_size``), what ``?name[]=`` does, the KV event
envelope ``[ts, events, dp_rank]`` and the fields of each event (``extra_keys`` carrying a
``cache_salt``, ``group_idx``, ``kv_cache_spec_kind``), and when ``AllBlocksCleared`` goes out after
``POST /reset_prefix_cache``. What differs on purpose is listed in :data:`DELIBERATE` (and in the
README's engine section).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from kvroute.emulator.server import EmulatorServer, EmulatorSettings, KVEventsSettings
from kvroute.engine import cost as costmod
from kvroute.engine.types import EngineConfig
from kvroute.integrations.vllm_launch import free_port
from kvroute.tokenizer import Tokenizer

from .harness import BLOCKS, POOL_TOKENS, SERVED, Fleet, real_vllm, words

pytestmark = real_vllm

BLOCK = BLOCKS[0]  # the emulator is compared with engine 0 (32-token blocks)

DELIBERATE = {
    # vLLM's chat message carries fields of features the emulator does not have
    "choices.message": {"annotations", "audio", "function_call", "refusal", "reasoning", "tool_calls"},
}
"""Keys vLLM sends that the emulator leaves out on purpose, by where they sit."""

EMULATOR_ONLY = {"choices.message": {"reasoning_content", "tool_calls"}}
"""Keys the emulator sends that vLLM 0.32 does not: the older ``reasoning_content`` (0.32 says
``reasoning``) and an empty ``tool_calls``, for clients written against earlier vLLM releases."""

SCHEMA_ERRORS = 3
"""The first BAD_REQUESTS whose error ``type`` differs on purpose: vLLM 0.32 answers a body that fails
its schema (a missing or mistyped field, broken JSON) with ``type`` "Bad Request" and ``param``
"body.<field>", its other 400s with "BadRequestError"; the emulator answers every 400 as
"BadRequestError" with the bare field name. Status, code and keys still match."""

OLDER_NAMES = {"vllm:gpu_cache_usage_perc", "vllm:time_per_output_token_seconds"}
"""Families the emulator also exports under older vLLM releases' names (for routers that read those);
vLLM 0.32 has only the newer ones (``kv_cache_usage_perc``, ``inter_token_latency_seconds``)."""

# the /metrics families kvroute's router, dashboard, Grafana board and benchmarks read
READ_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
)


@pytest.fixture
async def emulator(tokenizer: Tokenizer) -> AsyncIterator[tuple[str, str]]:
    """An emulated engine shaped like the fleet's engine 0: its URL and KV event endpoint."""
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    settings = EmulatorSettings(
        model_name=SERVED,
        engine=EngineConfig(
            num_kv_blocks=POOL_TOKENS // BLOCK, block_size=BLOCK, max_model_len=4096, report_tokens=True
        ),
        time_scale=50.0,
        kv_events=KVEventsSettings(pub, replay_endpoint=rep),
    )
    eng = EmulatorServer(settings, costmod.get_profile(costmod.DEFAULT_PROFILE).cost, tokenizer)
    port = await eng.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", pub
    finally:
        await eng.stop()


def shape(value: Any) -> Any:
    """The structure of a JSON value: dicts by key, lists by their first element, scalars by type
    (``int`` and ``float`` both ``number``; None as ``null``)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__


def differences(real: Any, emu: Any, where: str = "") -> list[str]:
    """Where the emulator's shape differs from vLLM's (``null`` matches anything, and a key vLLM sends
    as null may be absent: an optional field unset), minus :data:`DELIBERATE`."""
    if real == "null" or emu == "null":
        return []
    if isinstance(real, dict) and isinstance(emu, dict):
        out = []
        allowed = DELIBERATE.get(where.strip("."), set())
        for k in sorted(set(real) | set(emu)):
            here = f"{where}.{k}".lstrip(".")
            if k not in emu:
                if k not in allowed and real[k] != "null":  # an unset optional field: left out
                    out.append(f"{here}: only in vLLM")
            elif k not in real:
                if k not in EMULATOR_ONLY.get(where.strip("."), set()):
                    out.append(f"{here}: only in the emulator")
            else:
                out += differences(real[k], emu[k], here)
        return out
    if isinstance(real, list) and isinstance(emu, list):
        return differences(real[0], emu[0], where) if real and emu else []
    return [] if real == emu else [f"{where}: vLLM {real}, emulator {emu}"]


async def sse(http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]) -> list[Any]:
    async with http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln.decode().rstrip("\n") async for ln in r.content]
    data = [ln[6:] for ln in lines if ln.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [msgspec.json.decode(d) for d in data[:-1]]


def chunk_kinds(chunks: list[Any]) -> dict[str, Any]:
    """Chunks by role in the stream: first, middle, the one with finish_reason, the usage one."""
    kinds: dict[str, Any] = {}
    for i, c in enumerate(chunks):
        choices = c.get("choices") or []
        if not choices:
            kinds["usage"] = shape(c)
        elif choices[0].get("finish_reason"):
            kinds["finish"] = shape(c)
        elif i == 0:
            kinds["first"] = shape(c)
        else:
            kinds.setdefault("middle", shape(c))
    return kinds


async def test_streamed_chunks_usage_and_bodies_match(fleet: Fleet, emulator: tuple[str, str]) -> None:
    real, emu = fleet.urls[0], emulator[0]
    msgs = [{"role": "user", "content": words(3000, 200)}]
    chat = {"model": SERVED, "messages": msgs, "max_tokens": 5, "ignore_eos": True}
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    comp = {"model": SERVED, "prompt": words(3001, 200), "max_tokens": 5, "ignore_eos": True}
    diffs: list[str] = []
    async with aiohttp.ClientSession() as http:
        for path, body in (
            ("/v1/chat/completions", stream),
            ("/v1/completions", {**comp, **{k: stream[k] for k in ("stream", "stream_options")}}),
        ):
            a, b = await sse(http, real, path, body), await sse(http, emu, path, body)
            ka, kb = chunk_kinds(a), chunk_kinds(b)
            assert set(ka) == set(kb), (path, set(ka), set(kb))
            for kind in ka:
                diffs += [f"{path} {kind}: {d}" for d in differences(ka[kind], kb[kind])]
            ua, ub = a[-1]["usage"], b[-1]["usage"]
            assert set(ua) == set(ub) and set(ua["prompt_tokens_details"]) == set(ub["prompt_tokens_details"])
            assert (
                ua["prompt_tokens"] == ub["prompt_tokens"]
                and ua["completion_tokens"] == ub["completion_tokens"] == 5
            )
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
            bodies = []
            for url in (real, emu):
                async with http.post(url + path, json=body) as r:
                    assert r.status == 200
                    bodies.append(await r.json())
            diffs += [f"{path}: {d}" for d in differences(shape(bodies[0]), shape(bodies[1]))]
            # the repeat: both caches hit the same whole blocks, and say so the same way
            details = [b["usage"]["prompt_tokens_details"] for b in bodies]
            assert details[0]["cached_tokens"] == details[1]["cached_tokens"] > 0, details
            assert details[0].get("created_cache_tokens") == details[1].get("created_cache_tokens"), details
    assert not diffs, "\n".join(diffs)


BAD_REQUESTS: list[tuple[str, Any]] = [
    # schema failures first (see SCHEMA_ERRORS)
    ("/v1/chat/completions", {"model": SERVED}),  # no messages
    ("/v1/chat/completions", {"model": SERVED, "messages": "hi"}),
    ("/v1/completions", b"{not json"),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
    (
        "/v1/chat/completions",
        {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1},
    ),
    ("/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 100_000}),
]


async def test_error_bodies_match(fleet: Fleet, emulator: tuple[str, str]) -> None:
    real, emu = fleet.urls[0], emulator[0]
    out = []
    async with aiohttp.ClientSession() as http:
        for n, (path, body) in enumerate(BAD_REQUESTS):
            answers = []
            for url in (real, emu):
                kw: dict[str, Any] = (
                    {"data": body, "headers": {"content-type": "application/json"}}
                    if isinstance(body, bytes)
                    else {"json": body}
                )
                async with http.post(url + path, **kw) as r:
                    answers.append((r.status, await r.json(content_type=None)))
            (sa, ba), (sb, bb) = answers
            err_a, err_b = ba.get("error", {}), bb.get("error", {})
            types = (err_a.get("type"), err_b.get("type"))
            same_type = types[0] == types[1] or (
                n < SCHEMA_ERRORS and types == ("Bad Request", "BadRequestError")
            )
            if (
                sa != sb
                or set(err_a) != set(err_b)
                or not same_type
                or err_a.get("code") != err_b.get("code")
            ):
                out.append(f"{path} {body!r}: vLLM {sa} {ba} / emulator {sb} {bb}")
    assert not out, "\n".join(out)


def families(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Metric family → (type, label names) of a /metrics page."""
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created"):  # prometheus_client's creation-time gauges, not read
            continue
        labels = frozenset(k for s in fam.samples for k in s.labels if k not in ("le", "quantile"))
        out[fam.name] = (fam.type, labels)
    return out


async def test_metrics_names_types_labels_and_name_filter(fleet: Fleet, emulator: tuple[str, str]) -> None:
    real, emu = fleet.urls[0], emulator[0]
    async with aiohttp.ClientSession() as http:
        body = {"model": SERVED, "prompt": "hello", "max_tokens": 2}
        pages, filtered = [], []
        for url in (real, emu):
            async with http.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
            async with http.get(url + "/metrics") as r:
                pages.append(await r.text())
            async with http.get(url + "/metrics", params=[("name[]", "vllm:num_requests_running")]) as r:
                filtered.append(await r.text())
    fa, fb = families(pages[0]), families(pages[1])
    info = "vllm:cache_config_info"
    wrong = [
        (n, fa.get(n), fb.get(n))
        for n in READ_FAMILIES
        if n != info and (n not in fa or fa.get(n) != fb.get(n))
    ]
    assert not wrong, wrong
    # every family the emulator exports exists in vLLM with the same type and labels
    extra = {
        n: (fa.get(n), fb[n])
        for n in fb
        if n.startswith("vllm:") and n != info and n not in OLDER_NAMES and fa.get(n) != fb[n]
    }
    assert not extra, extra
    assert not OLDER_NAMES & set(fa)  # (else they are no longer "older" names)
    # cache_config_info: vLLM's carries every CacheConfig field; the emulator's the two routers read
    assert fa[info][0] == fb[info][0] == "gauge" and fb[info][1] <= fa[info][1], (fa[info], fb[info])
    for page in pages:
        sample = next(s for f in text_string_to_metric_families(page) if f.name == info for s in f.samples)
        assert sample.labels["block_size"] == str(BLOCK) and sample.labels["num_gpu_blocks"] == str(
            POOL_TOKENS // BLOCK
        )
    # name[]: vLLM 0.32 ignores it (its /metrics route is the instrumentator's, registered before the
    # app that filters) and renders the whole page; so does the emulator (by default)
    for page, whole in zip(filtered, (fa, fb), strict=True):
        assert set(families(page)) == set(whole), "name[] filtered on one side"


async def kv_events(endpoint: str, sink: list[tuple[float, list[Any], Any]], ready: asyncio.Event) -> None:
    """Subscribe to ``endpoint`` and append every batch, decoded as plain msgpack, to ``sink``."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    ready.set()
    try:
        while True:
            _topic, _seq, payload = await sock.recv_multipart()
            sink.append(tuple(msgspec.msgpack.decode(payload)))  # type: ignore[arg-type]
    finally:
        sock.close(0)
        ctx.term()


async def test_kv_event_envelope_fields_and_all_blocks_cleared(
    fleet: Fleet, emulator: tuple[str, str]
) -> None:
    real = fleet.procs[0]
    sides = {"vllm": (real.url, real.endpoint.kv_events), "emulator": emulator}
    seen: dict[str, list[Any]] = {k: [] for k in sides}
    tasks = []
    for name, (_, ep) in sides.items():
        ready = asyncio.Event()
        tasks.append(asyncio.create_task(kv_events(ep, seen[name], ready)))
        await ready.wait()
    await asyncio.sleep(1.0)  # the SUB sockets join
    try:
        async with aiohttp.ClientSession() as http:
            text = words(3100, 150)
            for name, (url, _) in sides.items():
                body = {"model": SERVED, "prompt": text, "max_tokens": 2, "cache_salt": "conf-salt"}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200, (name, await r.text())
            await asyncio.sleep(1.0)
            stored = {}
            for name in sides:
                batches = seen[name]
                assert batches, f"{name}: no KV events"
                ts, events, rank = batches[-1]
                assert isinstance(ts, float) and isinstance(events, list) and rank == 0, (name, batches[-1])
                evs = [
                    e for b in batches for e in b[1] if isinstance(e, dict) and e.get("type") == "BlockStored"
                ]
                assert evs, f"{name}: no BlockStored as a map (vLLM 0.32's encoding): {batches[-1]}"
                stored[name] = evs[0]
            a, b = stored["vllm"], stored["emulator"]
            assert set(a) == set(b), (sorted(a), sorted(b))
            for k in ("block_size", "group_idx", "kv_cache_spec_kind", "medium", "lora_name", "lora_id"):
                assert a.get(k) == b.get(k), (k, a.get(k), b.get(k))
            assert a["extra_keys"][0] == b["extra_keys"][0] == ["conf-salt"], (
                a["extra_keys"],
                b["extra_keys"],
            )
            assert a["token_ids"] == b["token_ids"]
            # AllBlocksCleared: not on the reset itself, only with the engine's next step
            for name, (url, _) in sides.items():
                mark = len(seen[name])
                async with http.post(url + "/reset_prefix_cache") as r:
                    assert r.status == 200, (name, r.status)
                await asyncio.sleep(1.0)
                cleared = [e for b in seen[name][mark:] for e in b[1] if e.get("type") == "AllBlocksCleared"]
                assert not cleared, f"{name}: AllBlocksCleared before the next step"
                body = {"model": SERVED, "prompt": "step", "max_tokens": 1}
                async with http.post(url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                await asyncio.sleep(1.0)
                cleared = [e for b in seen[name][mark:] for e in b[1] if e.get("type") == "AllBlocksCleared"]
                assert len(cleared) == 1, (name, seen[name][mark:])
    finally:
        for t in tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await t
