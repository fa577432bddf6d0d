"""Units of model pools, SGLang metrics and events, LoRA keys and re-blocking in the KV view."""

from __future__ import annotations

import msgspec
import pytest

from kvroute.blocks import extra_key, hash_blocks
from kvroute.commands.settings import config_from_mapping
from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.errors import UserError
from kvroute.kvevents import decode_batch, encode_batch, page_hashes
from kvroute.routing.kvview import KVView
from kvroute.server.state.backends import BackendState
from kvroute.server.state.pools import ModelPools, ServedModels, parse_model_list
from kvroute.server.sync.engines import parse_metrics, parse_sglang_metrics
from kvroute.server.wire.validate import ApiError

SGLANG_PAGE = b"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 2.0
sglang:num_queue_reqs{model_name="m"} 4.0
sglang:token_usage{model_name="m"} 0.25
sglang:max_total_num_tokens{model_name="m"} 65536.0
sglang:cache_hit_rate{model_name="m"} 0.5
"""


def test_sglang_metrics_and_detection() -> None:
    m = parse_sglang_metrics(SGLANG_PAGE, 2.0, 16)
    assert m is not None
    assert (m.running, m.waiting, m.kv_usage, m.at, m.num_kv_blocks) == (5, 4, 0.25, 2.0, 4096)
    assert parse_metrics(SGLANG_PAGE, 2.0, None, 16) == (m, "sglang")
    assert parse_metrics(SGLANG_PAGE, 2.0, "vllm", 16) == (None, "vllm")  # declared: not guessed
    vllm = b'vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting{model_name="m"} 0\n'
    parsed, seen = parse_metrics(vllm, 1.0, None, 16)
    assert seen == "vllm" and parsed is not None and parsed.running == 1
    assert parse_metrics(b"other 1\n", 1.0, None, 16) == (None, None)


def test_sglang_event_layout_roundtrip() -> None:
    tokens = tuple(range(32))
    stored = BlockStored((11, 22), None, tokens, 16)
    raw = encode_batch(5.0, [stored, BlockRemoved((22,))], fmt="sglang", pages_per_block=4)
    obj = msgspec.msgpack.decode(raw)
    assert len(obj) == 2 and obj[0] == 5.0  # [ts, events]: no rank
    first = obj[1][0]
    assert first[0] == "BlockStored" and len(first[1]) == 1 and first[4] == 4 and first[2] is None
    ts, events, rank = decode_batch(raw)
    assert ts == 5.0
    assert rank is None and len(events) == 8 + 4
    pages = [e for e in events if isinstance(e, BlockStored)]
    assert [p.token_ids for p in pages] == [tokens[i : i + 4] for i in range(0, 32, 4)]
    assert pages[3].block_hashes == (11,) and pages[4].parent_block_hash == 11
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    assert removed == list(reversed(page_hashes(22, 4)))


@pytest.mark.parametrize("page", [1, 3, 16, 32], ids=["1-token", "3-token", "aligned", "32-token"])
def test_kv_view_reblocks_engine_pages(page: int) -> None:
    """Engine blocks of any size are re-blocked into the router's 16-token blocks; removing the page
    that completed blocks removes those blocks, and only them."""
    tokens = list(range(1000, 1096))  # 6 router blocks
    kv = KVView(1, 16, 1024, None, 0.0, exact_backends=[0])
    events, parent = [], None
    for i in range(0, len(tokens) // page * page, page):
        h = 10_000 + i
        events.append(BlockStored((h,), parent, tuple(tokens[i : i + page]), page))
        parent = h
    kv.apply_events(0, events)
    chain = hash_blocks(tokens, 16)
    stored = len(tokens) // page * page // 16
    assert kv.match(chain, 0.0) == [stored]
    assert kv.skipped_blocks == 0
    # Evict the last page that completed a router block (leaf first, as engines evict).
    last = max(e.block_hashes[0] for e in events if (e.block_hashes[0] - 10_000 + page) % 16 < page)
    kv.apply_events(0, [BlockRemoved(tuple(h for h in range(last, parent + 1, page)))])  # type: ignore[operator]
    # the blocks that end after that page's first token are gone, those before stay
    assert kv.match(chain, 0.0) == [(last - 10_000) // 16] and (last - 10_000) // 16 < stored


def test_kv_view_keys_adapter_blocks() -> None:
    tokens = tuple(range(64))
    kv = KVView(2, 16, 1024, None, 0.0, exact_backends=[0, 1])
    kv.apply_events(0, [BlockStored((1, 2, 3, 4), None, tokens, 16, lora_id=1, lora_name="sql")])
    kv.apply_events(1, [BlockStored((5, 6, 7, 8), None, tokens, 16, lora_id=2)])  # no name: skipped
    assert kv.match(hash_blocks(tokens, 16, extra_key("sql")), 0.0) == [4, 0]
    assert kv.match(hash_blocks(tokens, 16), 0.0) == [0, 0]
    assert kv.skipped_blocks == 4
    assert extra_key(None, "salt") != extra_key(None) and extra_key("a", "b") != extra_key("a")


def _state(i: int) -> BackendState:
    return BackendState(i, f"http://h:{i}")


def test_pools_select() -> None:
    pools = ModelPools()
    a, b, c = _state(0), _state(1), _state(2)
    assert pools.select("x", [a, b], [a, b]) == [a, b]  # nothing known: any backend
    pools.declare(0, ["alpha"], [])
    listed = parse_model_list(
        {"data": [{"id": "beta", "parent": None}, {"id": "sql", "parent": "beta"}, {"nope": 1}]}
    )
    assert listed == ServedModels(frozenset({"beta", "sql"}), frozenset({"sql"}))
    assert pools.listed(1, listed) and not pools.listed(1, listed)
    assert not pools.listed(0, listed)  # declared: a listing does not replace it
    assert pools.is_adapter("sql") and not pools.is_adapter("beta")
    assert pools.select("alpha", [a, b], [a, b]) == [a]
    assert pools.select("sql", [a, b], [a, b]) == [b]
    assert pools.select(None, [a, b], [a, b]) == [a, b]
    with pytest.raises(ApiError) as exc:
        pools.select("gamma", [a, b], [a, b])
    assert exc.value.status == 404 and exc.value.code == "model_not_found"
    assert "alpha, beta, sql" in exc.value.message
    with pytest.raises(ApiError) as exc:
        pools.select("alpha", [a, b], [b])
    assert exc.value.status == 503
    assert pools.select("gamma", [a, b, c], [a, b, c]) == [c]  # c's models are not known yet
    pools.forget(1)
    assert not pools.is_adapter("sql")
    assert parse_model_list({"object": "list"}) is None


def test_config_backend_models_and_engine() -> None:
    cfg = config_from_mapping(
        {
            "backends": [
                {"url": "http://a:1", "models": ["m"], "lora_adapters": ["sql"], "engine": "sglang"},
                "http://b:2",
            ]
        },
        "f.yaml",
    )
    a, b = cfg.backends
    assert (a.models, a.lora_adapters, a.engine) == (("m",), ("sql",), "sglang")
    assert (b.models, b.engine) == ((), None)
    with pytest.raises(UserError, match="engine"):
        config_from_mapping({"backends": [{"url": "http://a:1", "engine": "tgi"}]}, "f.yaml")
    with pytest.raises(UserError, match="models"):
        config_from_mapping({"backends": [{"url": "http://a:1", "models": "m"}]}, "f.yaml")


def test_kv_view_records_a_salted_prefix_as_salted() -> None:
    """vLLM 0.32 events carry a salted request's ``cache_salt`` in its first block's ``extra_keys``:
    the exact view records the salt's chain, so the salted repeat matches and the same text unsalted
    (or under another salt) does not; a later event continuing that prompt (no salt in its keys)
    extends the salted chain. Engine blocks of 64 tokens (re-blocked) carry the salt the same way."""
    tokens = tuple(range(96))
    salted = hash_blocks(tokens, 16, extra_key(None, "t1"))
    for ebs in (16, 32):
        kv = KVView(1, 16, 1024, None, 0.0, exact_backends=[0])
        n = 64 // ebs
        first = BlockStored(
            tuple(range(1, n + 1)), None, tokens[:64], ebs, extra_keys=(("t1",), *([None] * (n - 1)))
        )
        m = 32 // ebs
        more = BlockStored(tuple(range(90, 90 + m)), n, tokens[64:96], ebs, extra_keys=(None,) * m)
        kv.apply_events(0, [first])
        assert kv.match(salted, 0.0) == [4]
        assert kv.match(hash_blocks(tokens, 16), 0.0) == [0]
        assert kv.match(hash_blocks(tokens, 16, extra_key(None, "t2")), 0.0) == [0]
        kv.apply_events(0, [more])
        assert kv.match(salted, 0.0) == [6]


def test_kv_view_shortfall_drops_the_backend_s_history_and_leaves_the_exact_view_to_events() -> None:
    """A real ``cached_tokens`` below half the prediction and short by at least one engine block is
    counted; on a backend with KV events it drops that backend's routing history (used while it
    recovers) but the request's own prompt, and leaves its exact entries to the events (the late
    ``AllBlocksCleared`` clears them when it comes). A small shortfall changes nothing."""
    tokens = tuple(range(128))
    chain = hash_blocks(tokens, 16)
    other = hash_blocks(tuple(range(500, 564)), 16)
    kv = KVView(2, 16, 1024, None, 0.0, exact_backends=[0, 1])
    for b in (0, 1):
        kv.apply_events(b, [BlockStored(tuple(range(10 * b, 10 * b + 8)), None, tokens, 16)])
        kv.on_routed(b, chain, 0.0)
        kv.on_routed(b, other, 0.0)
    kv.on_usage(0, chain, 96, 7, 0.0)  # 96 of 112: not below half
    assert kv.approx.match(other, 2) == [4, 4] and kv.shortfalls == {}
    kv.on_usage(0, chain, 32, 7, 0.0)
    assert kv.shortfalls == {0: 1} and kv.approx.match(other, 2) == [0, 4]
    assert kv.approx.match(chain, 2) == [8, 8] and kv.match(chain, 0.0) == [8, 8]  # exact: left to events
    kv.apply_events(0, [AllBlocksCleared()])
    assert kv.match(chain, 0.0) == [0, 8]
    kv.set_engine_block_size(1, 128)
    kv.on_usage(1, chain, 0, 7, 0.0)  # short by 112 < one engine block of 128: no evidence
    assert kv.shortfalls == {0: 1} and kv.approx.match(other, 2) == [0, 4]


def test_pd_instance_view_sums_the_engines_blocks_in_use_and_the_pending_requests() -> None:
    """The P/D router's view follows ``decode_blocks``' definition (views.py), as the single-pool
    router does: before any scrape the blocks of every request in flight; then the blocks the engine
    holds at the last scrape (``kv_usage`` × pool) plus those of the requests routed since that scrape
    began and not started. Regression: it was 0 (no KV term at all), then the engine's alone."""
    from kvroute.server.state.backends import ScrapedMetrics
    from kvroute.server.state.pdpools import PDBackend, PDInstance

    inst = PDInstance(0, PDBackend("http://d:1"))
    inst.add("a", 300, blocks=20, at=1.0)
    v = inst.view()
    assert (v.waiting, v.queued_prefill_tokens, v.decode_blocks) == (1, 300, 20)  # no scrape yet
    inst.add("b", 100, blocks=7, at=1.5)
    inst.scrape(ScrapedMetrics(running=1, waiting=1, kv_usage=0.03, at=1.2, num_kv_blocks=1000))
    v = inst.view()  # "a" routed before the scrape began (the engine's copy covers it), "b" after
    assert (v.queued_prefill_tokens, v.kv_capacity_blocks, v.decode_blocks) == (400, 1000, 30 + 7)
    inst.start("b")  # started: the next copy covers it
    assert inst.view().decode_blocks == 30
    inst.start("a")
    inst.done("a")
    inst.done("b")
    assert inst.view().decode_blocks == 30  # the engine's, until the next scrape
    assert not (inst.inflight or inst.blocks or inst.pending or inst.started)
    inst.scrape(ScrapedMetrics(1, 0, 0.03, 2.0, num_kv_blocks=1000, block_size=128))
    v = inst.view(16)  # the router's 16-token blocks: 8 per engine block
    assert (v.kv_capacity_blocks, v.decode_blocks) == (8000, 240)
