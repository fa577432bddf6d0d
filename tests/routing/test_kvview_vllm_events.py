"""The exact KV view against vLLM 0.32's own hashing and events, without vLLM.

``tests/fixtures/vllm_events/salted_chats.json``: the KV event batches (raw msgpack) one real vLLM
0.32 CPU server published while two chats under one ``cache_salt`` shared a system prompt and the
server cycled its 64-block pool with fillers (``tests/real_vllm/test_salted_view.py``, which made
it): the repeated chat's token ids (the router's tokenization of it) and the ``cached_tokens`` vLLM
served it each round. Engine blocks are 128 tokens; the router's are 16.
"""

from __future__ import annotations

import base64
import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from kvroute.blocks import extra_key, hash_blocks
from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.kvevents import decode_batch
from kvroute.routing.kvview import KVView

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_events" / "salted_chats.json"


@pytest.fixture(scope="module")
def capture() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    data["events"] = [decode_batch(base64.b64decode(b64))[1] for _, b64 in data["batches"]]
    return data


def vllm_sha256(obj: object) -> bytes:
    """vLLM 0.32's default ``prefix_caching_hash_algo`` "sha256": SHA-256 of the pickle."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def published(block_hash: bytes) -> int:
    """What vLLM publishes for a block hash (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default):
    its last 8 bytes as an unsigned big-endian int."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def recompute(batches: list[list[KVEvent]], salt_every_block: bool = False) -> tuple[int, int]:
    """(matched, total): vLLM's engine hashes recomputed from every ``BlockStored``'s token ids by
    ``hash_block_tokens``: ``sha256((parent hash, block tokens, extra keys))``, the first block's
    parent ``NONE_HASH = sha256("vllm-none-hash")``, extra keys ``(("cache_salt", SALT),)`` where the
    event's ``extra_keys`` entry has the salt, else None (or, ``salt_every_block``, on every block of
    a salted prefix: the rule vLLM does not follow)."""
    none_hash = vllm_sha256("vllm-none-hash")
    full: dict[int, tuple[bytes, str | None]] = {}  # published hash -> (full hash, the prefix's salt)
    matched = total = 0
    for events in batches:
        for ev in events:
            if not isinstance(ev, BlockStored):
                continue
            if ev.parent_block_hash is None:
                parent, salt = none_hash, None
            else:
                parent, salt = full[ev.parent_block_hash]
            ebs = ev.block_size
            for i, eh in enumerate(ev.block_hashes):
                keys = ev.extra_keys[i] if ev.extra_keys else None
                if keys:
                    salt = str(keys[0])
                if keys or (salt_every_block and salt is not None):
                    extra: tuple[tuple[str, str], ...] | None = (("cache_salt", str(salt)),)
                else:
                    extra = None
                block = vllm_sha256((parent, tuple(ev.token_ids[i * ebs : (i + 1) * ebs]), extra))
                matched += published(block) == eh
                total += 1
                full[eh] = (block, salt)
                parent = block
    return matched, total


def test_vllm_salts_the_first_block_only(capture: dict[str, Any]) -> None:
    """Every engine hash in the real events is vLLM's rule with the salt in the first block only;
    salting every block of a salted prompt reproduces none of the salted chats' later blocks."""
    matched, total = recompute(capture["events"])
    assert total > 100 and matched == total
    salted_first = [
        ev
        for events in capture["events"]
        for ev in events
        if isinstance(ev, BlockStored) and ev.extra_keys and ev.extra_keys[0] == (capture["cache_salt"],)
    ]
    assert salted_first and all(ev.parent_block_hash is None for ev in salted_first)
    assert all(all(k is None for k in ev.extra_keys[1:]) for ev in salted_first if ev.extra_keys)
    wrong, _ = recompute(capture["events"], salt_every_block=True)
    assert wrong < matched


def replay(kv: KVView, batches: list[list[KVEvent]]) -> None:
    for events in batches:
        kv.apply_events(0, events)


def test_salted_chat_predicted_as_vllm_served_after_the_shared_block_went(capture: dict[str, Any]) -> None:
    """The router's salted chain of the repeated chat, matched in the view the real events built,
    predicts what vLLM served it at the end (640 tokens), although the other chat's first block,
    which shared the system prompt's router blocks, was evicted (before the fix: 0)."""
    kv = KVView(1, 16, capacity_blocks=1000, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    replay(kv, capture["events"])
    ids = capture["prompt_ids"]
    chain = hash_blocks(ids, 16, extra_key(None, capture["cache_salt"]))
    (matched,) = kv.match(chain, 1.0)
    served = capture["served_cached_tokens"][-1]
    assert served == 640
    assert kv.engine_block_size(0) == capture["engine_block_size"]
    assert kv.cached_tokens(0, matched, len(ids)) == served
    # the same text unsalted, or under another salt, is no hit: the salt keys the first block
    for key in (None, extra_key(None, "another")):
        assert kv.match(hash_blocks(ids, 16, key), 1.0) == [0]


def test_the_fixture_evicts_a_salted_first_block_that_shared_router_blocks(capture: dict[str, Any]) -> None:
    """The capture exercises the case: a salted first block that shares router blocks with the
    repeated chat's first block is removed while the repeated chat's stays."""
    salt = capture["cache_salt"]
    ids = capture["prompt_ids"]
    roots = {
        ev.block_hashes[0]: ev.token_ids[:128]
        for events in capture["events"]
        for ev in events
        if isinstance(ev, BlockStored) and ev.parent_block_hash is None and ev.extra_keys
        if ev.extra_keys[0] == (salt,)
    }
    mine = [h for h, toks in roots.items() if list(toks) == ids[:128]]
    other = [h for h, toks in roots.items() if list(toks[:16]) == ids[:16] and h not in mine]
    removed = {
        h
        for events in capture["events"]
        for ev in events
        if isinstance(ev, BlockRemoved)
        for h in ev.block_hashes
    }
    assert len(mine) == 1 and mine[0] not in removed
    assert other and set(other) <= removed


# ---- hand-computed: router blocks shared by engine blocks ------------------------------------------


def engine_block(
    hashes: tuple[int, ...], parent: int | None, toks: list[int], salt: str | None = None
) -> BlockStored:
    """A vLLM 0.32 ``BlockStored`` of 128-token blocks (the salt in a prompt's first block only)."""
    extra = None
    if salt is not None and parent is None:
        extra = ((salt,),) + (None,) * (len(hashes) - 1)
    return BlockStored(hashes, parent, tuple(toks), 128, extra_keys=extra)


def fresh() -> KVView:
    return KVView(1, 16, capacity_blocks=1000, ttl_s=None, recovery_s=5.0, exact_backends=[0])


@pytest.mark.parametrize("salt", [None, "tenant"])
def test_first_blocks_sharing_a_system_prompt(salt: str | None) -> None:
    """Two first engine blocks share their first 48 tokens (3 router blocks): evicting one keeps
    what the other holds; evicting both drops it."""
    system = list(range(1000, 1048))
    x = system + list(range(5000, 5080))
    y = system + list(range(7000, 7080))
    key = extra_key(None, salt)
    kv = fresh()
    kv.apply_events(0, [engine_block((11,), None, x, salt), engine_block((22,), None, y, salt)])
    chain_y = hash_blocks([*y, 1], 16, key)
    assert kv.match(chain_y, 1.0) == [8]
    kv.apply_events(0, [BlockRemoved((11,))])
    assert kv.match(chain_y, 1.0) == [8]  # before the fix: [0]
    assert kv.cached_tokens(0, 8, len(y) + 1) == 128
    assert kv.match(hash_blocks([*x, 1], 16, key), 1.0) == [3]  # x's own blocks are gone
    kv.apply_events(0, [BlockRemoved((22,))])
    assert kv.match(chain_y, 1.0) == [0]


def test_later_blocks_sharing_their_leading_tokens() -> None:
    """A conversation's block completed by generated tokens and the next turn's block with the
    re-rendered reply (same parent, same first 32 tokens)."""
    first = list(range(128))
    gen = list(range(200, 232)) + list(range(300, 396))
    rerendered = list(range(200, 232)) + list(range(400, 496))
    kv = fresh()
    kv.apply_events(
        0, [engine_block((1,), None, first), engine_block((2,), 1, gen), engine_block((3,), 1, rerendered)]
    )
    chain = hash_blocks(first + rerendered + [9], 16)
    assert kv.match(chain, 1.0) == [16]
    kv.apply_events(0, [BlockRemoved((2,))])
    assert kv.match(chain, 1.0) == [16]  # before the fix: [8]


def test_copies_of_one_engine_block_hold_once() -> None:
    """A hash vLLM caches twice counts as one holder: its copies' removals leave the shared router
    blocks to the other engine block, and the last holder's removal drops them."""
    system = list(range(1000, 1048))
    x = system + list(range(5000, 5080))
    y = system + list(range(7000, 7080))
    kv = fresh()
    kv.apply_events(
        0, [engine_block((11,), None, x), engine_block((11,), None, x), engine_block((22,), None, y)]
    )
    chain_x = hash_blocks([*x, 1], 16)
    chain_y = hash_blocks([*y, 1], 16)
    kv.apply_events(0, [BlockRemoved((11,))])  # one copy of x
    assert kv.match(chain_x, 1.0) == [8]
    kv.apply_events(0, [BlockRemoved((22,))])
    assert kv.match(chain_x, 1.0) == [8] and kv.match(chain_y, 1.0) == [3]
    kv.apply_events(0, [BlockRemoved((11,))])  # x's last copy
    assert kv.match(chain_x, 1.0) == [0]
    kv.apply_events(0, [engine_block((22,), None, y), AllBlocksCleared(), engine_block((11,), None, x)])
    kv.apply_events(0, [BlockRemoved((11,))])  # a clear forgets the holders
    assert kv.match(chain_y, 1.0) == [0]


def test_equal_block_sizes_two_engine_hashes_one_router_hash() -> None:
    """At equal block sizes an engine hash maps to one router hash; two engine hashes with the same
    router hash (vLLM keys an adapter by its path too, its events carry only the name) are two
    holders."""
    toks = list(range(32))
    kv = KVView(1, 16, capacity_blocks=1000, ttl_s=None, recovery_s=5.0, exact_backends=[0])
    ev = BlockStored((1, 2), None, tuple(toks), 16, lora_id=1, lora_name="a")
    again = BlockStored((3, 4), None, tuple(toks), 16, lora_id=2, lora_name="a")
    kv.apply_events(0, [ev, again, BlockRemoved((1, 2))])
    assert kv.match(hash_blocks(toks, 16, extra_key("a")), 1.0) == [2]
    kv.apply_events(0, [BlockRemoved((3, 4))])
    assert kv.match(hash_blocks(toks, 16, extra_key("a")), 1.0) == [0]
