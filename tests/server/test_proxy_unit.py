"""Proxy logic through the transport seam: backends are a FakeTransport (no backend sockets); the
client talks to the router over loopback."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from kvroute.server.app import RouterServer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.tokenizer import Tokenizer

from .fakes import FakeTransport, Scripted

A, B, C = "http://a:1", "http://b:1", "http://c:1"
BODY = {"model": "m", "prompt": "hello world " * 20, "max_tokens": 2, "stream": True}


def make_config(*urls: str, **kw: object) -> RouterConfig:
    return RouterConfig(backends=tuple(BackendSpec(u) for u in urls), port=0, **kw)  # type: ignore[arg-type]


async def start(transport: FakeTransport, tokenizer: Tokenizer, *urls: str, **kw: object) -> RouterServer:
    server = RouterServer(
        make_config(*urls, **kw), transport=transport, tokenizer=tokenizer, background=False
    )
    await server.start()
    return server


def counters_zero(server: RouterServer) -> bool:
    return all(
        b.waiting == 0 and b.running == 0 and b.queued_prefill == 0 and b.blocks == 0 and b.pending == 0
        for b in server.state.backends
    )


async def post(url: str, body: object, raw: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else orjson.dumps(body)
        async with s.post(
            url + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        ) as r:
            return r.status, dict(r.headers), await r.read()


async def test_connect_error_retries_next_best_and_ejects(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted(connect_error=True)], B: [Scripted()]})
    server = await start(t, tokenizer, A, B, policy="round-robin")
    try:
        status, _, body = await post(server.url, BODY)
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert [c[0] for c in t.calls] == [A, B]
        assert not server.state.backends[0].healthy and server.state.backends[1].healthy
        assert server.state.counters.retries == 1
        assert counters_zero(server)
    finally:
        await server.stop()


async def test_break_before_first_byte_is_retried(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted(break_after=0)], B: [Scripted()]})
    server = await start(t, tokenizer, A, B, policy="round-robin")
    try:
        status, _, body = await post(server.url, BODY)
        assert status == 200 and b"error" not in body
        assert t.responses[0].aborted
        assert counters_zero(server)
    finally:
        await server.stop()


async def test_break_after_first_byte_ends_with_error_event(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted(chunks=[b'data: {"x":1}\n\n', b"data: [DONE]\n\n"], break_after=1)]})
    server = await start(t, tokenizer, A)
    try:
        status, _, body = await post(server.url, BODY)
        assert status == 200
        events = [e for e in body.split(b"\n\n") if e]
        assert events[0] == b'data: {"x":1}'
        assert orjson.loads(events[1][len(b"data: ") :])["error"]["type"] == "upstream_error"
        assert events[-1] == b"data: [DONE]"
        assert len(t.calls) == 1  # no retry after the first byte
        assert server.state.counters.upstream_errors == 1
        assert counters_zero(server)
    finally:
        await server.stop()


async def test_all_backends_down_is_503_with_retry_after(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted(connect_error=True)], B: [Scripted(connect_error=True)]})
    server = await start(t, tokenizer, A, B)
    try:
        status, headers, body = await post(server.url, BODY)
        assert status == 503 and headers["Retry-After"] == "1"
        assert orjson.loads(body)["error"]["code"] == 503
        # Both are ejected now: the next request is refused without any backend call.
        calls = len(t.calls)
        status, headers, _ = await post(server.url, BODY)
        assert status == 503 and "Retry-After" in headers and len(t.calls) == calls
        assert counters_zero(server)
    finally:
        await server.stop()


async def test_retryable_status_goes_to_next_backend(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted(status=503, chunks=[b"{}"])], B: [Scripted()]})
    server = await start(t, tokenizer, A, B, policy="round-robin")
    try:
        status, _, _ = await post(server.url, BODY)
        assert status == 200 and [c[0] for c in t.calls] == [A, B]
        assert server.state.backends[0].healthy  # a 503 answer is not a dead backend
    finally:
        await server.stop()


async def test_client_error_from_backend_passes_through(tokenizer: Tokenizer) -> None:
    err = b'{"error": {"message": "bad", "type": "BadRequestError", "code": 400}}'
    t = FakeTransport({A: [Scripted(status=400, chunks=[err])]})
    server = await start(t, tokenizer, A)
    try:
        status, _, body = await post(server.url, BODY)
        assert status == 400 and body == err
        assert counters_zero(server)
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (orjson.dumps({"prompt": 5}), "prompt"),
        (orjson.dumps({"prompt": "x", "stream": "yes"}), "stream"),
        (orjson.dumps({"prompt": "x", "max_tokens": "10"}), "max_tokens"),
        (orjson.dumps({"prompt": "x", "max_tokens": -1}), "max_tokens"),
        (orjson.dumps({"model": "m"}), "prompt"),
        (orjson.dumps({"prompt": [1, -2]}), "prompt"),
    ],
)
async def test_bad_bodies_are_openai_400s(tokenizer: Tokenizer, raw: bytes, param: str | None) -> None:
    t = FakeTransport({A: [Scripted()]})
    server = await start(t, tokenizer, A)
    try:
        status, _, body = await post(server.url, None, raw=raw)
        err = orjson.loads(body)["error"]
        assert status == 400 and err["type"] == "invalid_request_error" and err["param"] == param
        assert "Traceback" not in err["message"]
        assert t.calls == []
    finally:
        await server.stop()


async def test_chat_validation(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted()]})
    server = await start(t, tokenizer, A)
    try:
        async with aiohttp.ClientSession() as s:
            for bad in (
                {"messages": []},
                {"messages": [{"role": 1, "content": "x"}]},
                {"messages": [{"role": "user", "content": 5}]},
                {"messages": "hi"},
            ):
                async with s.post(server.url + "/v1/chat/completions", json=bad) as r:
                    assert r.status == 400, bad
                    assert (await r.json())["error"]["param"] == "messages"
    finally:
        await server.stop()


async def test_body_over_limit_is_413(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted()]})
    server = await start(t, tokenizer, A, max_body_bytes=4096)
    try:
        status, _, body = await post(server.url, {"prompt": "x" * 5000})
        assert status == 413 and orjson.loads(body)["error"]["code"] == 413

        # Chunked upload without Content-Length is cut off as well.
        async def gen():  # type: ignore[no-untyped-def]
            for _ in range(10):
                yield b"x" * 1000

        async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/completions", data=gen()) as r:
            assert r.status == 413
        assert t.calls == []
    finally:
        await server.stop()


async def test_client_disconnect_aborts_upstream(tokenizer: Tokenizer) -> None:
    gate = asyncio.Event()
    t = FakeTransport({A: [Scripted(gate=gate)]})
    server = await start(t, tokenizer, A)
    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(server.url + "/v1/completions", json=BODY))
            for _ in range(200):
                if server.state.backends[0].waiting == 1:
                    break
                await asyncio.sleep(0.01)
            assert server.state.backends[0].waiting == 1
            # routed, no first byte: its new prefill is queued, its blocks held by the router's lease
            assert server.state.backends[0].queued_prefill > 0 and server.state.backends[0].blocks > 0
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        for _ in range(200):
            if t.responses and t.responses[0].aborted:
                break
            await asyncio.sleep(0.01)
        assert t.responses[0].aborted
        assert counters_zero(server)
    finally:
        gate.set()
        await server.stop()


async def test_health_and_metrics_endpoints(tokenizer: Tokenizer) -> None:
    t = FakeTransport({A: [Scripted()]})
    server = await start(t, tokenizer, A)
    try:
        await post(server.url, BODY)
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/health") as r:
                assert r.status == 200 and (await r.json())["healthy_backends"] == 1
            async with s.get(server.url + "/metrics") as r:
                text = await r.text()
            assert 'kvroute_requests_total{outcome="ok"} 1.0' in text
            assert f'kvroute_backend_waiting{{backend="{A}"}} 0.0' in text
            stages = {
                line.split('"')[1]: float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("kvroute_routing_stage_seconds_total{")
            }
            total = next(
                float(line.split()[-1])
                for line in text.splitlines()
                if line.startswith("kvroute_routing_seconds_total ")
            )
            assert set(stages) == {"parse", "split", "tokenize", "hash", "plan"}
            assert all(v > 0 for v in stages.values())
            assert sum(stages.values()) == pytest.approx(total, rel=1e-6)
            server.state.backends[0].eject()
            async with s.get(server.url + "/health") as r:
                assert r.status == 503
    finally:
        await server.stop()


async def test_long_prompt_tokenized_off_loop_routes_like_inline(tokenizer: Tokenizer) -> None:
    """A prompt over OFFLOAD_CHARS goes through the tokenizer thread; the routing state it leaves
    (the approximate KV view of the chosen backend) equals what the inline path computes."""
    from kvroute.server.stages.decide import decide
    from kvroute.server.stages.prepare import OFFLOAD_CHARS, prepare_inline
    from kvroute.server.wire.validate import parse_request

    long_body = {**BODY, "prompt": "the quick brown fox jumps " * (OFFLOAD_CHARS // 20)}
    assert len(long_body["prompt"]) >= OFFLOAD_CHARS
    t = FakeTransport({A: [Scripted(), Scripted()]})
    server = await start(t, tokenizer, A, tokenize="exact")
    try:
        status, _, _ = await post(server.url, long_body)
        assert status == 200
        parsed = parse_request(orjson.dumps(long_body), chat=False)
        inline = decide(server.state, parsed, prepare_inline(server.state, parsed))
        assert server.state.kv.match(inline.chain, server.state.clock())[0] == len(inline.chain) > 0
        assert counters_zero(server)
    finally:
        await server.stop()


async def _until(cond: object, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_deferred_tokenization_corrects_view_and_counters_in_flight(tokenizer: Tokenizer) -> None:
    """tokenize=defer: a long new prompt is sent before its text is tokenized; when the request is
    still waiting for its first byte after TAIL_GRACE_S, the tail's tokenization puts the whole chain
    in the chosen backend's KV view and sets its queued prefill to the exact count; counters end at
    zero."""
    from kvroute.blocks import hash_blocks
    from kvroute.server.stages.prepare import DEFER_CHARS, defers

    prompt = "a completely new document about routing and caches " * (2 * DEFER_CHARS // 50)
    ids = tokenizer.encode(prompt)
    chain = hash_blocks(ids, 16)
    gate = asyncio.Event()
    t = FakeTransport({A: [Scripted(gate=gate)]})
    server = await start(t, tokenizer, A, tokenize="defer")
    assert defers(server.state)
    try:
        req = asyncio.create_task(post(server.url, {**BODY, "prompt": prompt}))
        backend = server.state.backends[0]
        await _until(lambda: backend.waiting == 1)
        await _until(lambda: server.state.kv.match(chain, server.state.clock())[0] == len(chain))
        assert backend.queued_prefill == len(ids)  # nothing was cached: the whole prompt is new
        gate.set()
        status, _, body = await req
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        assert counters_zero(server)
        # the second time, the text is known: routed on exact blocks, no estimate
        pending = server.state.tokenizer.split_prompt(prompt)
        assert pending.tail_chars < DEFER_CHARS and len(pending.known) >= len(ids) - 200
    finally:
        gate.set()  # never leave the handler hanging (the server would wait for it on stop)
        await server.stop()


async def test_exact_tokenization_records_whole_chain_before_sending(tokenizer: Tokenizer) -> None:
    from kvroute.blocks import hash_blocks
    from kvroute.server.stages.prepare import DEFER_CHARS

    prompt = "another brand new text for the exact mode " * (2 * DEFER_CHARS // 40)
    chain = hash_blocks(tokenizer.encode(prompt), 16)
    gate = asyncio.Event()
    t = FakeTransport({A: [Scripted(gate=gate)]})
    server = await start(t, tokenizer, A, tokenize="exact")
    try:
        req = asyncio.create_task(post(server.url, {**BODY, "prompt": prompt}))
        await _until(lambda: len(t.calls) == 1)  # sent: the chain was already recorded
        assert server.state.kv.match(chain, server.state.clock())[0] == len(chain)
        gate.set()
        assert (await req)[0] == 200
        assert counters_zero(server)
    finally:
        gate.set()
        await server.stop()


async def test_exact_backend_keeps_routing_history_for_a_later_event_gap(tokenizer: Tokenizer) -> None:
    """With KV events the exact view routes; the routing history (recorded once the request is on its
    way) is what a backend falls back to after an unrecoverable event gap."""
    from kvroute.blocks import hash_blocks

    prompt = "history for the exact backend " * 40
    chain = hash_blocks(tokenizer.encode(prompt), 16)
    t = FakeTransport({A: [Scripted()]})
    config = RouterConfig(backends=(BackendSpec(A, kv_events="tcp://127.0.0.1:1"),), port=0)
    server = RouterServer(config, transport=t, tokenizer=tokenizer, background=False)
    await server.start()
    try:
        assert (await post(server.url, {**BODY, "prompt": prompt}))[0] == 200
        kv, now = server.state.kv, server.state.clock()
        assert kv.mode(0, now) == "exact" and kv.match(chain, now)[0] == 0  # no events came: nothing exact
        kv.reset(0, now)  # an event gap that could not be replayed
        assert kv.mode(0, now) == "recovering" and kv.match(chain, now)[0] == len(chain)
    finally:
        await server.stop()


async def test_deferred_tail_waits_for_the_first_byte(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tokenize=defer with a first byte sooner than TAIL_GRACE_S: the new text is tokenized only
    once the first byte was relayed (the router's work does not hold up the first token), then the
    view has the whole chain and the text is in the token cache."""
    from kvroute.blocks import hash_blocks
    from kvroute.server.stages import prepare
    from kvroute.server.stages.prepare import DEFER_CHARS

    monkeypatch.setattr(prepare, "TAIL_GRACE_S", 60.0)
    prompt = "a first byte comes before the tail is tokenized " * (2 * DEFER_CHARS // 45)
    chain = hash_blocks(tokenizer.encode(prompt), 16)
    gate = asyncio.Event()
    t = FakeTransport({A: [Scripted(gate=gate)]})
    server = await start(t, tokenizer, A, tokenize="defer")
    try:
        req = asyncio.create_task(post(server.url, {**BODY, "prompt": prompt}))
        await _until(lambda: len(t.calls) == 1)
        await asyncio.sleep(0.05)
        assert server.state.kv.match(chain, server.state.clock())[0] < len(chain)  # not tokenized yet
        assert server.state.tokenizer.split_prompt(prompt).tail_chars >= DEFER_CHARS
        gate.set()
        assert (await req)[0] == 200
        await _until(lambda: server.state.kv.match(chain, server.state.clock())[0] == len(chain))
        assert server.state.tokenizer.split_prompt(prompt).tail_chars < DEFER_CHARS
        assert counters_zero(server)
    finally:
        gate.set()
        await server.stop()


async def test_deferred_tail_after_shutdown_is_dropped_quietly(tokenizer: Tokenizer) -> None:
    """A deferred tail whose timer fires while the router stops (its tokenizer thread pool already
    shut down) is dropped without raising out of the event loop's callback."""
    from concurrent.futures import ThreadPoolExecutor

    from kvroute.server.stages.decide import decide
    from kvroute.server.stages.prepare import OFFLOAD_CHARS, Tail, prepare_inline
    from kvroute.server.wire.validate import parse_request

    server = await start(FakeTransport({A: []}), tokenizer, A, tokenize="defer")
    try:
        prompt = "text for a stopping router " * (OFFLOAD_CHARS // 20)
        pending = server.state.tokenizer.split_prompt(prompt)
        assert pending.tail_chars >= OFFLOAD_CHARS
        parsed = parse_request(orjson.dumps({**BODY, "prompt": "short"}), chat=False)
        plan = decide(server.state, parsed, prepare_inline(server.state, parsed))
        pool = ThreadPoolExecutor(max_workers=1)
        pool.shutdown()
        tail = Tail(server.state, plan.cached_blocks, pool, pending, None)
        tail.run()
        tail.run()  # once only
        assert tail.chain is None
    finally:
        await server.stop()


async def test_client_gone_at_the_final_end_of_a_stream_is_a_disconnect(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's connection is gone when the stream's end (with its last chunk) is written:
    counted as a disconnect like one mid-stream, no traceback (regression: write_eof was uncovered)."""
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    real_eof = web.StreamResponse.write_eof

    async def gone_at_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if self.chunked:  # the relayed stream (plain answers are not chunked)
            raise ClientConnectionResetError("Cannot write to closing transport")
        await real_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", gone_at_eof)
    t = FakeTransport({A: [Scripted()]})
    server = await start(t, tokenizer, A)
    caplog.set_level("DEBUG")
    try:
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientError):
                async with s.post(server.url + "/v1/completions", json=BODY) as r:
                    await r.read()
        for _ in range(200):
            if server.state.counters.cancelled:
                break
            await asyncio.sleep(0.01)
        assert server.state.counters.cancelled == 1 and server.state.counters.ok == 0
        assert counters_zero(server)
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    finally:
        await server.stop()


async def test_peer_lmetric_bookkeeping_follows_the_live_requests(tokenizer: Tokenizer) -> None:
    """aibrix-lmetric keeps its own pending counters in the live router: a request in flight counts
    on its backend until it ends (retries included), and the same prompt again goes to the other
    backend while the first is still pending, then back once it finished."""
    t = FakeTransport({A: [Scripted(connect_error=True), Scripted()], B: [Scripted(), Scripted()]})
    server = await start(t, tokenizer, A, B, policy="aibrix-lmetric")
    try:
        pol = server.state.routing.policy
        status, _, _ = await post(server.url, BODY)
        assert status == 200
        first = t.calls[-1][0]
        assert all(pol.pending(i) == (0, 0) for i in range(2))  # ended: released (the failed try too)
        status, _, _ = await post(server.url, BODY)
        assert status == 200 and t.calls[-1][0] == first  # its own table: the prompt's backend
        assert counters_zero(server)
    finally:
        await server.stop()


async def test_stream_end_goes_out_with_the_last_chunk(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk after which the upstream has ended (``UpstreamResponse.ended``) is written together
    with the end of the stream (one write); one that is not known to be the last is written alone,
    then the end. The client gets the same bytes either way."""
    from aiohttp import web

    calls: list[tuple[str, bytes]] = []
    real_write, real_eof = web.StreamResponse.write, web.StreamResponse.write_eof

    async def write(self: web.StreamResponse, data: bytes) -> None:
        calls.append(("write", bytes(data)))
        await real_write(self, data)

    async def write_eof(self: web.StreamResponse, data: bytes = b"") -> None:
        if self.chunked and not self._eof_sent:  # a second write_eof is a no-op
            calls.append(("eof", bytes(data)))
        await real_eof(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(web.StreamResponse, "write_eof", write_eof)
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    t = FakeTransport({A: [Scripted(chunks=chunks), Scripted(chunks=chunks, tells_end=False)]})
    server = await start(t, tokenizer, A)
    try:
        status, _, body = await post(server.url, BODY)
        assert status == 200 and body == b"".join(chunks)
        assert calls == [("write", chunks[0]), ("write", chunks[1]), ("eof", chunks[2])]

        calls.clear()
        status, _, body = await post(server.url, BODY)
        assert status == 200 and body == b"".join(chunks)
        assert calls == [*(("write", c) for c in chunks), ("eof", b"")]
        assert counters_zero(server) and server.state.counters.ok == 2
    finally:
        await server.stop()
