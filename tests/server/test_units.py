"""Unit tests of the router's parts: config, metrics parsing and merge, leases, KV view, event gaps."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.blocks import hash_blocks
from kvroute.commands.settings import config_from_mapping, load_config_file
from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.errors import UserError
from kvroute.kvevents import END_SEQ, encode_batch, encode_seq
from kvroute.prepare.events import EventSubscriber
from kvroute.routing.kvview import KVView
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.state.backends import BackendState, Lease, ScrapedMetrics, parse_vllm_metrics
from kvroute.server.wire.http import extract_cached_tokens

# ---- config --------------------------------------------------------------------------------------


def test_yaml_config_roundtrip(tmp_path: Path) -> None:
    f = tmp_path / "r.yaml"
    f.write_text(
        "backends:\n"
        "  - url: http://10.0.0.1:8000/v1/\n"
        "    kv_events: tcp://10.0.0.1:5557\n"
        "    kv_replay: tcp://10.0.0.1:5558\n"
        "  - http://10.0.0.2:8000\n"
        "policy: round-robin\nmax_body_bytes: 2048\nscrape_interval_s: 1\n"
    )
    cfg = load_config_file(f).validate()
    assert cfg.backends == (
        BackendSpec("http://10.0.0.1:8000", "tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
        BackendSpec("http://10.0.0.2:8000"),
    )
    assert cfg.policy == "round-robin" and cfg.max_body_bytes == 2048 and cfg.scrape_interval_s == 1.0


@pytest.mark.parametrize(
    ("data", "msg"),
    [
        ({"backends": ["http://a:1"], "polcy": "x"}, "unknown key 'polcy'"),
        ({"backends": ["ftp://a"]}, "must look like http"),
        ({"backends": [{"url": "http://a:1", "kv_events": "http://x"}]}, "kv_events must be"),
        ({"backends": ["http://a:1"], "port": "80"}, "port must be a int"),
        ({"backends": ["http://a:1"], "max_retries": True}, "max_retries must be a int"),
    ],
)
def test_bad_config_names_the_key(data: dict[str, object], msg: str) -> None:
    with pytest.raises(UserError, match=msg):
        config_from_mapping(data)


def test_config_validate_ranges() -> None:
    with pytest.raises(UserError, match="at least one backend"):
        RouterConfig(backends=()).validate()
    with pytest.raises(UserError, match="scrape_interval_s"):
        RouterConfig(backends=(BackendSpec("http://a:1"),), scrape_interval_s=0).validate()
    with pytest.raises(UserError, match="tokenize='fast' must be one of defer, exact"):
        RouterConfig(backends=(BackendSpec("http://a:1"),), tokenize="fast").validate()


# ---- metrics and load view ------------------------------------------------------------------------

VLLM_METRICS = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting_by_reason{reason="x"} 100.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",num_gpu_blocks="4096"} 1.0
"""


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(VLLM_METRICS, at=5.0)
    assert m == ScrapedMetrics(running=4, waiting=2, kv_usage=0.25, at=5.0, num_kv_blocks=4096, block_size=16)
    assert parse_vllm_metrics(b"other_metric 1\n", at=0.0) is None


def test_parse_vllm_metrics_line_boundaries() -> None:
    """Only whole lines (cut at \\n, \\r or \\r\\n, as bytes.splitlines does) that start with a
    known name count; a longer gauge name of the same stem does not."""
    text = (
        b"vllm:num_requests_running 2\r\n"
        b"x vllm:num_requests_running 50\n"
        b"vllm:num_requests_runningX 70\n"
        b'vllm:num_requests_waiting{a="1"} 1\rvllm:num_requests_waiting 4\n'
        b"vllm:gpu_cache_usage_perc 0.5\n"
        b"vllm:kv_cache_usage_perc_extra 0.75\n"
        b"# vllm:num_requests_waiting 99\n"
        b"vllm:num_requests_running 1"
    )
    m = parse_vllm_metrics(text, at=1.0)
    assert m == ScrapedMetrics(running=3, waiting=5, kv_usage=0.75, at=1.0, num_kv_blocks=0)


def test_merge_takes_larger_total_without_double_counting() -> None:
    b = BackendState(0, "http://a:1")
    Lease(b, 100)
    Lease(b, 50)  # router: 2 waiting, 150 queued prefill tokens
    b.scraped = ScrapedMetrics(running=1, waiting=0, kv_usage=0.5, at=10.0)
    v = b.view(now=10.01, stale_s=1.0)
    # The engine runs one of our two requests (prefilling): BS stays 2, split 1 running + 1 waiting.
    assert (v.running, v.waiting, v.queued_prefill_tokens, v.kv_usage) == (1, 1, 150, 0.5)
    b.scraped = ScrapedMetrics(running=5, waiting=3, kv_usage=0.9, at=10.0)  # other clients' traffic too
    v = b.view(now=10.01, stale_s=1.0)
    assert (v.running, v.waiting) == (5, 3)
    v = b.view(now=12.0, stale_s=1.0)  # stale scrape: router counters only
    assert (v.running, v.waiting, v.kv_usage) == (0, 2, 0.0)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 4), st.integers(0, 500), st.integers(0, 40)), max_size=40
    )
)
def test_leases_always_return_counters_to_zero(ops: list[tuple[int, int, int, int]]) -> None:
    """Any order of reservations, first bytes, releases (before the first byte: an error, a client
    disconnect or a cancellation while waiting), adjustments and completed scrapes: ``blocks`` counts
    the blocks of every unreleased lease, ``pending`` those of the unstarted, unreleased ones made
    since the last scrape began (a lease made at t, a scrape at t' settles it iff t < t'), the view
    sums the engine's blocks in use and ``pending`` (fresh scrape) or reads ``blocks`` (none), and
    everything returns to zero."""
    b = BackendState(0, "http://a:1")
    leases: list[Lease] = []
    made: list[float] = []
    ended: set[int] = set()
    settled: set[int] = set()
    last_scrape = None
    for step, (pick, action, tokens, blocks) in enumerate(ops):
        now = float(step)
        k = pick % len(leases) if leases else -1
        if action == 0 or not leases:
            leases.append(Lease(b, tokens, blocks, now))
            made.append(now)
        elif action == 1:
            leases[k].first_byte()
        elif action == 2:
            leases[k].release()
            ended.add(k)
        elif action == 3:  # a scrape that began half a step ago completes: 2 of 100 blocks in use
            last_scrape = ScrapedMetrics(running=1, waiting=0, kv_usage=0.02, at=now - 0.5, num_kv_blocks=100)
            b.scraped = last_scrape
            b.settle(last_scrape)
            settled |= {j for j, t in enumerate(made) if t < last_scrape.at}
        else:
            leases[k].adjust(tokens, blocks)
        assert b.waiting >= 0 and b.running >= 0 and b.queued_prefill >= 0
        alive = [j for j in range(len(leases)) if j not in ended]
        pending = [j for j in alive if not leases[j].started and j not in settled]
        assert b.blocks == sum(leases[j].blocks for j in alive)
        assert b.pending == sum(leases[j].blocks for j in pending)
        assert all(leases[j].pending == (j in pending) for j in range(len(leases)))
        fresh = b.view(now, 100.0).decode_blocks
        assert fresh == (b.blocks if last_scrape is None else 2 + b.pending)
        assert b.view(now + 200.0, 100.0).decode_blocks == b.blocks  # stale: the router's own
    for lease in leases:
        lease.release()
        lease.release()
    assert (b.waiting, b.running, b.queued_prefill, b.blocks, b.pending) == (0, 0, 0, 0, 0)
    assert not b._pending  # no lease left behind


def test_health_ejection_and_readmission() -> None:
    b = BackendState(0, "http://a:1")
    assert not b.check_failed(eject_after=2) and b.healthy
    assert b.check_failed(eject_after=2) and not b.healthy
    assert not b.check_passed(readmit_after=2) and not b.healthy
    assert b.check_passed(readmit_after=2) and b.healthy


def test_extract_cached_tokens_from_stream_tail_and_json() -> None:
    tail = (
        b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[],"usage":{"prompt_tokens":40,'
        b'"prompt_tokens_details":{"cached_tokens":32}}}\n\ndata: [DONE]\n\n'
    )
    assert extract_cached_tokens(tail) == 32
    assert extract_cached_tokens(b'{"usage": {"prompt_tokens_details": {"cached_tokens": 16}}}') == 16
    assert extract_cached_tokens(b'data: {"usage": null}\n\n') is None
    assert extract_cached_tokens(b'data: {"cached_tokens": 5, broken\n\n') is None


# ---- KV view ------------------------------------------------------------------------------------


def tokens(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def stored(engine_hashes: list[int], parent: int | None, toks: list[int]) -> BlockStored:
    return BlockStored(tuple(engine_hashes), parent, tuple(toks), 16)


@pytest.mark.parametrize("engine_block", [16, 32])
def test_a_hash_cached_twice_stays_until_its_last_copy_is_removed(engine_block: int) -> None:
    """vLLM's block pool can cache one hash in two blocks (two requests computed the same block at
    once): a BlockStored for each, then a BlockRemoved for each copy it evicts. The view keeps the
    prefix while a copy is left (seen on real vLLM: predicted 256 cached tokens, got 800)."""
    kv = KVView(1, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    toks = tokens(64)
    chain = hash_blocks(toks, 16)
    n = 64 // engine_block
    ev = BlockStored(tuple(range(100, 100 + n)), None, tuple(toks), engine_block)
    kv.apply_events(0, [ev, ev])  # the same blocks stored twice
    assert kv.match(chain, 1.0) == [4]
    kv.apply_events(0, [BlockRemoved((101,))])  # one copy of the second engine block evicted
    assert kv.match(chain, 1.0) == [4]
    kv.apply_events(0, [BlockRemoved((101,))])  # its last copy
    assert kv.match(chain, 1.0) == [engine_block // 16]  # the blocks before the removed one
    kv.apply_events(0, [ev, AllBlocksCleared(), ev, BlockRemoved((100,))])  # a clear forgets copies
    assert kv.match(chain, 1.0) == [0]


def test_exact_view_rebuilds_router_hashes_from_token_ids() -> None:
    kv = KVView(2, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[1])
    toks = tokens(64)
    chain = hash_blocks(toks, 16)
    # Engine 1 stores the prompt in two events with its own (private) hashes, the second chained.
    kv.apply_events(1, [stored([901, 902], None, toks[:32]), stored([903, 904], 902, toks[32:])])
    assert kv.match(chain, now=0.0) == [0, 4]
    kv.apply_events(1, [BlockRemoved((903,))])
    assert kv.match(chain, now=0.0) == [0, 2]
    kv.apply_events(1, [stored([999], 12345, toks[:16])])  # unknown parent: skipped
    assert kv.skipped_blocks == 1
    kv.apply_events(1, [AllBlocksCleared()])
    assert kv.match(chain, now=0.0) == [0, 0]


def test_gap_reset_falls_back_to_history_then_back_to_exact() -> None:
    kv = KVView(2, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0, 1])
    chain = hash_blocks(tokens(48), 16)
    kv.on_routed(0, chain, now=1.0)  # routing history says backend 0 holds it
    assert kv.match(chain, now=1.0) == [0, 0]  # exact mode: no events yet → nothing cached
    kv.reset(0, now=2.0)
    assert kv.mode(0, 3.0) == "recovering"
    assert kv.match(chain, now=3.0) == [3, 0]  # recovering: max(exact, approximate)
    assert kv.mode(0, 7.5) == "exact" and kv.match(chain, now=7.5) == [0, 0]


def test_usage_correction_shrinks_and_grows_capacity() -> None:
    kv = KVView(1, 16, capacity_blocks=1000, ttl_s=None, recovery_s=0.0)
    chains = [hash_blocks(tokens(160, base=1000 * i), 16) for i in range(10)]  # 10 blocks each
    for t, c in enumerate(chains):
        kv.on_routed(0, c, now=float(t))
    assert kv.approx.num_blocks(0) == 100
    # The engine had only 2 of the 10 blocks we predicted: shrink capacity, evicting the oldest chains.
    kv.on_usage(0, chains[-1], cached_tokens=32, predicted_blocks=10, now=11.0)
    assert kv.approx.capacity(0) == 90 and kv.approx.num_blocks(0) == 90
    assert kv.match(chains[0], now=11.0) == [0] and kv.match(chains[-1], now=11.0) == [10]
    kv.on_usage(0, chains[-1], cached_tokens=160, predicted_blocks=4, now=12.0)
    assert kv.approx.capacity(0) == 96
    kv.on_usage(0, chains[-1], cached_tokens=64, predicted_blocks=4, now=13.0)  # matches: no change
    assert kv.corrections == 2


# ---- event subscriber: gaps and replay -----------------------------------------------------------


def batch(events: list[BlockStored]) -> bytes:
    return encode_batch(1.0, events, fmt="map")


async def test_gap_without_replay_resets_backend() -> None:
    kv = KVView(1, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ctx = zmq.asyncio.Context()
    try:
        sub = EventSubscriber(ctx, 0, "tcp://127.0.0.1:1", None, kv, clock=lambda: 1.0)
        toks = tokens(32)
        await sub.handle(encode_seq(0), batch([stored([1, 2], None, toks)]))
        assert kv.match(hash_blocks(toks, 16), 1.0) == [2]
        await sub.handle(encode_seq(5), batch([]))  # batches 1..4 lost
        assert (sub.gaps, sub.resets, sub.last_seq) == (1, 1, 5)
        assert kv.mode(0, 1.0) == "recovering" and kv.match(hash_blocks(toks, 16), 1.0) == [0]
        await sub.handle(encode_seq(2), batch([]))  # numbering went back: engine restarted
        assert sub.resets == 2
    finally:
        ctx.term()


async def _replay_server(router: zmq.asyncio.Socket, history: dict[int, bytes]) -> None:
    """A vLLM-style replay socket: every buffered batch with ``seq >= start``, then ``END_SEQ``."""
    while True:
        ident, _empty, start = await router.recv_multipart()
        s = int.from_bytes(start, "big")
        for seq in sorted(history):
            if seq >= s:
                await router.send_multipart([ident, b"", encode_seq(seq), history[seq]])
        await router.send_multipart([ident, b"", END_SEQ, b""])


async def test_gap_is_filled_from_replay_socket() -> None:
    kv = KVView(1, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    toks = tokens(48)
    history = {1: batch([stored([11], None, toks[:16])]), 2: batch([stored([12], 11, toks[16:32])])}

    server = asyncio.create_task(_replay_server(router, history))
    try:
        sub = EventSubscriber(ctx, 0, "tcp://127.0.0.1:1", f"tcp://127.0.0.1:{port}", kv, clock=lambda: 1.0)
        await sub.handle(encode_seq(0), batch([]))
        await sub.handle(encode_seq(3), batch([stored([13], 12, toks[32:])]))
        assert (sub.gaps, sub.replayed, sub.resets) == (1, 2, 0)
        assert kv.mode(0, 1.0) == "exact" and kv.match(hash_blocks(toks, 16), 1.0) == [3]
    finally:
        server.cancel()
        router.close(0)
        ctx.term()


@pytest.mark.parametrize("first", [0, 4], ids=["whole-buffer", "buffer-trimmed"])
async def test_replay_on_subscribe_before_any_live_batch(first: int) -> None:
    """Fix 5: a subscriber asks for the replay as soon as it subscribes (no live batch has come). A
    buffer starting at 0 makes the view exact at once; one that no longer starts at 0 (vLLM keeps its
    last ``buffer_steps`` batches) is applied from its first batch on, counted as partial, and the
    backend stays recovering (approximate help) for ``recovery_s``."""
    kv = KVView(1, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pub = ctx.socket(zmq.PUB)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    toks = tokens(48)
    history = {
        first: batch([stored([11], None, toks[:16])]),
        first + 1: batch([stored([12], 11, toks[16:32])]),
        first + 2: batch([stored([13], 12, toks[32:])]),
    }
    server = asyncio.create_task(_replay_server(router, history))
    sub = EventSubscriber(
        ctx, 0, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{port}", kv, clock=lambda: 1.0
    )
    assert kv.mode(0, 1.0) == "exact"
    task = asyncio.create_task(sub.run())
    try:
        async with asyncio.timeout(5):
            await sub.synced.wait()
        assert sub.replayed == 3 and sub.last_seq == first + 2 and sub.batches == 3
        assert kv.match(hash_blocks(toks, 16), 1.0) == [3]
        await sub.handle(encode_seq(first + 1), batch([]))  # a live batch the replay had: late, dropped
        assert sub.resets == 0 and sub.last_seq == first + 2
        if first == 0:
            assert (sub.partial, sub.resets, kv.mode(0, 1.0)) == (0, 0, "exact")
        else:
            assert sub.partial == 1 and kv.mode(0, 1.0) == "recovering" and kv.mode(0, 6.5) == "exact"
    finally:
        task.cancel()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close(0)
        pub.close(0)
        ctx.term()


async def test_replay_on_subscribe_that_gets_no_answer_leaves_the_view_recovering() -> None:
    kv = KVView(1, 16, capacity_blocks=100, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ctx = zmq.asyncio.Context()
    sub = EventSubscriber(
        ctx, 0, "tcp://127.0.0.1:1", "tcp://127.0.0.1:1", kv, clock=lambda: 1.0, replay_timeout_s=0.2
    )
    task = asyncio.create_task(sub.run())
    try:
        assert kv.mode(0, 1.0) == "exact"
        await asyncio.sleep(0)
        assert kv.mode(0, 1.0) == "recovering"  # syncing: approximate help while the replay runs
        async with asyncio.timeout(5):
            await sub.synced.wait()
        assert sub.last_seq is None and kv.mode(0, 1.0) == "recovering" and kv.mode(0, 6.5) == "exact"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.term()


# ---- segmented tokenization ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.sampled_from(
            [
                "the",
                " cat",
                "  ",
                "\n",
                "é",
                "e\u0301",
                "'s",
                "12",
                "--",
                " ",
                "Über",
                "x.",
                "\t",
                "日本",
                " a",
                "!",
                "don't",
                "  x",
            ]
        ),
        min_size=50,
        max_size=600,
    )
)
def test_segmented_prompt_tokens_equal_whole_prompt_tokens(tokenizer: object, parts: list[str]) -> None:
    from kvroute.prepare.tokenize import RequestTokenizer

    rt = RequestTokenizer(tokenizer, cache_entries=100)  # type: ignore[arg-type]
    text = "".join(parts) * 3
    assert list(rt.prompt(text)) == rt.tokenizer.encode(text)


def test_segments_are_shared_by_equal_prefixes(tokenizer: object) -> None:
    from kvroute.prepare.tokenize import RequestTokenizer, split_points

    rt = RequestTokenizer(tokenizer, cache_entries=100)  # type: ignore[arg-type]
    base = "alpha beta gamma delta " * 200
    a, b = base + "first question here", base + "another one entirely"
    assert split_points(a)[:-1] == split_points(b)[:-1]
    rt.prompt(a)
    misses = rt.misses
    assert list(rt.prompt(b)) == rt.tokenizer.encode(b)
    assert rt.misses == misses + 1 and rt.hits >= len(split_points(b)) - 1


def test_split_then_finish_equals_tokenizing_at_once(tokenizer: object) -> None:
    """Chats and prompts, partly cached: ``known`` is the cached leading part, ``finish`` the whole."""
    from kvroute.prepare.tokenize import RequestTokenizer

    rt = RequestTokenizer(tokenizer, cache_entries=1000)  # type: ignore[arg-type]
    tok = rt.tokenizer
    history = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Explain KV caches " * 30},
    ]
    rt.chat(history)
    chat = [
        *history,
        {"role": "assistant", "content": "They store keys."},
        {"role": "user", "content": "More?"},
    ]
    pending = rt.split_chat(chat)
    cached_part = tok.encode_chat(history, add_generation_prompt=False)
    assert pending.known == cached_part
    assert pending.tail_chars == sum(len(t) for t in pending.texts) > 0
    assert rt.finish(pending) == tok.encode_chat(chat)
    base = "lorem ipsum dolor sit amet " * 100
    rt.prompt(base)
    prompt = base + "and then something else entirely " * 40
    pending = rt.split_prompt(prompt)
    assert 0 < len(pending.known) <= len(tok.encode(base))
    assert pending.known == tok.encode(prompt)[: len(pending.known)]
    assert rt.finish(pending) == tok.encode(prompt)
    assert rt.split_prompt([1, 2, 3]).known == [1, 2, 3]


def test_tail_estimate_is_close_for_english_text(tokenizer: object) -> None:
    from kvroute.prepare.tokenize import RequestTokenizer

    rt = RequestTokenizer(tokenizer, cache_entries=1000)  # type: ignore[arg-type]
    for i in range(5):  # the ratio is learned from what was tokenized
        rt.prompt(f"request {i}: the router sends each request to the instance with the lowest score " * 20)
    text = "a new question about prefill tokens, batch sizes and cache hits in a cluster " * 30
    pending = rt.split_prompt(text)
    assert pending.known == []
    true = len(rt.tokenizer.encode(text))
    assert 0.8 * true <= rt.estimate_tail(pending) <= 1.25 * true


async def test_subscriber_drains_a_burst_in_order() -> None:
    """Batches queued while the router was busy are all applied, in order, without gaps; a
    malformed message in the burst is counted and skipped."""
    kv = KVView(1, 16, capacity_blocks=1000, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(ctx, 0, f"tcp://127.0.0.1:{port}", None, kv, clock=lambda: 1.0)
    task = asyncio.create_task(sub.run())
    try:
        toks = tokens(16 * 40)
        await asyncio.sleep(0.3)  # the SUB connects
        parent = None
        for seq in range(40):
            if seq == 20:
                await pub.send_multipart([b"only-one-frame"])
            await pub.send_multipart(
                [b"kv", encode_seq(seq), batch([stored([seq + 1], parent, toks[16 * seq : 16 * seq + 16])])]
            )
            parent = seq + 1
        for _ in range(200):
            if sub.batches == 40:
                break
            await asyncio.sleep(0.01)
        assert (sub.batches, sub.gaps, sub.resets, sub.bad, sub.last_seq) == (40, 0, 0, 1, 39)
        assert kv.match(hash_blocks(toks, 16), 1.0) == [40]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close(0)
        ctx.term()


def test_a_routed_requests_blocks_count_until_the_next_scrape_or_its_first_byte() -> None:
    """``decode_blocks`` (views.py) as the simulator builds it: the engine's blocks in use at the last
    scrape plus the blocks of the requests routed since that scrape began (pending) until their first
    byte or the next completed scrape, which covers them (in use once the engine schedules them, none
    while they wait in its queue). A sum, not a max: the two sets are disjoint. Regression: a max of
    the engine's blocks and the router's started ones let a burst routed inside one scrape interval
    add nothing, so it herded onto one instance."""
    b = BackendState(0, "http://x:1")
    b.scraped = ScrapedMetrics(running=1, waiting=0, kv_usage=0.05, at=9.98, num_kv_blocks=100)
    first = Lease(b, 100, blocks=7, at=10.0)
    second = Lease(b, 50, blocks=3, at=10.01)
    v = b.view(now=10.02, stale_s=1.0)  # routed since the scrape began: 5 in use + 7 + 3 pending
    assert (v.running, v.waiting, v.queued_prefill_tokens, v.decode_blocks) == (1, 1, 150, 15)
    # A scrape begun at 10.005 completes: the engine runs another client's request and queues both
    # of ours (holding no block); it covers the first (routed before it began), not the second.
    b.scraped = ScrapedMetrics(running=1, waiting=2, kv_usage=0.05, at=10.005, num_kv_blocks=100)
    v = b.view(now=10.03, stale_s=1.0)
    assert (v.waiting, v.queued_prefill_tokens, v.decode_blocks) == (2, 150, 8)
    assert (first.pending, second.pending, b.pending) == (False, True, 3)
    second.first_byte()  # started: the engine's next copy holds its blocks; none pending
    assert b.view(now=10.04, stale_s=1.0).decode_blocks == 5
    b.scraped = ScrapedMetrics(running=2, waiting=1, kv_usage=0.08, at=10.05, num_kv_blocks=100)
    assert b.view(now=10.06, stale_s=1.0).decode_blocks == 8
    assert b.view(now=11.5, stale_s=1.0).decode_blocks == 10  # stale scrape: every lease's blocks
    first.release()
    second.release()
    second.release()
    assert (b.blocks, b.pending) == (0, 0) and b.view(now=11.5, stale_s=1.0).decode_blocks == 0


def test_adjusting_a_lease_corrects_its_blocks_and_its_pending_ones() -> None:
    """A deferred tokenization learns the prompt's real length late: the corrected blocks replace
    the estimate's in ``blocks`` until the release, and in ``pending`` while the lease is pending;
    after the release nothing moves."""
    b = BackendState(0, "http://x:1")
    lease = Lease(b, 100, blocks=7, at=1.0)
    lease.adjust(150, 10)
    assert (b.queued_prefill, b.blocks, b.pending) == (150, 10, 10)
    lease.first_byte()
    assert (b.queued_prefill, b.blocks, b.pending) == (0, 10, 0)
    lease.adjust(160, 12)  # the prefill is done: only the blocks change
    assert (b.queued_prefill, b.blocks, b.pending) == (0, 12, 0)
    lease.adjust(160)
    assert b.blocks == 12
    settled = Lease(b, 10, blocks=4, at=2.0)
    b.settle(ScrapedMetrics(running=1, waiting=1, kv_usage=0.0, at=2.5))
    settled.adjust(10, 6)  # settled: the blocks move, nothing pending
    assert (b.blocks, b.pending) == (18, 0)
    lease.release()
    settled.release()
    lease.adjust(170, 20)
    assert (b.waiting, b.running, b.queued_prefill, b.blocks, b.pending) == (0, 0, 0, 0, 0)


def test_the_view_counts_an_engines_pool_in_the_routers_blocks() -> None:
    """vLLM's CPU build has 128-token blocks, the router 16-token ones: the engine's pool and blocks
    in use come into the view in the router's blocks, the unit of its leases' blocks and of the
    policies' Q / block size. Regression: the engine's 100 blocks of 128 tokens were read as 100 of
    16 (K saw an eighth of the pool) and merged with the leases' 16-token blocks."""
    b = BackendState(0, "http://x:1")
    lease = Lease(b, 0, blocks=300, at=1.0)
    b.scraped = ScrapedMetrics(running=1, waiting=0, kv_usage=0.5, at=0.5, num_kv_blocks=100, block_size=128)
    v = b.view(1.0, 1.0, block_size=16)
    assert (v.kv_capacity_blocks, v.decode_blocks) == (800, 400 + 300)
    assert b.view(1.0, 1.0, block_size=128).kv_capacity_blocks == 100
    legacy = ScrapedMetrics(running=1, waiting=0, kv_usage=0.5, at=0.0, num_kv_blocks=100)  # no block_size
    assert legacy.pool(16) == (100, 50)
    lease.release()


def test_a_lease_released_before_its_first_byte_takes_its_pending_blocks_off() -> None:
    """An attempt that ends before its first byte (connect error, break, client gone, cancelled)
    takes its blocks and its pending ones off, once; the started requests' blocks stay."""
    b = BackendState(0, "http://x:1")
    started = Lease(b, 50, blocks=4, at=1.0)
    started.first_byte()
    failed = Lease(b, 80, blocks=6, at=2.0)
    assert (b.blocks, b.pending) == (10, 6)
    failed.release()
    failed.first_byte()  # too late: released is final
    assert (b.waiting, b.running, b.queued_prefill, b.blocks, b.pending) == (0, 1, 0, 4, 0)
    started.release()
    assert (b.waiting, b.running, b.queued_prefill, b.blocks, b.pending) == (0, 0, 0, 0, 0)


def test_token_cache_is_bounded_by_tokens_not_only_entries(tokenizer: object) -> None:
    """Regression: the piece cache was bounded by entries only, so huge messages grew it without
    bound; now it never holds more than ``cache_tokens`` token ids, and stays exact."""
    from kvroute.prepare.tokenize import RequestTokenizer

    rt = RequestTokenizer(tokenizer, cache_entries=10_000, cache_tokens=3000)  # type: ignore[arg-type]
    for i in range(30):
        chat = [{"role": "system", "content": "sys"}, {"role": "user", "content": f"question {i} " * 300}]
        assert rt.chat(chat) == rt.tokenizer.encode_chat(chat)  # type: ignore[attr-defined]
        assert rt.cached_tokens <= 3000
        assert rt.cached_tokens == sum(len(v) for v in rt._cache.values())
    huge = [{"role": "user", "content": "word " * 5000}]  # one piece over the bound: not cached
    rt.chat(huge)
    assert rt.cached_tokens <= 3000
