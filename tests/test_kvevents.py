"""KV event wire format: round trips, vLLM-shaped bytes, malformed payloads."""

from __future__ import annotations

import contextlib
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.kvevents import (
    END_SEQ,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

EVENTS = [
    BlockStored(
        block_hashes=(1, 2**64 - 1), parent_block_hash=None, token_ids=tuple(range(32)), block_size=16
    ),
    BlockStored(
        block_hashes=(-5,), parent_block_hash=2**64 - 1, token_ids=tuple(range(16, 32)), block_size=16
    ),
    BlockRemoved(block_hashes=(1, -5)),
    AllBlocksCleared(),
]


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_round_trip(fmt):
    payload = encode_batch(1757500000.25, EVENTS, dp_rank=3, fmt=fmt)
    ts, events, rank = decode_batch(payload)
    assert ts == 1757500000.25 and rank == 3
    assert events == EVENTS


def test_formats_differ_on_the_wire():
    arr = msgspec.msgpack.decode(encode_batch(1.0, EVENTS[:1], fmt="array"))
    mp = msgspec.msgpack.decode(encode_batch(1.0, EVENTS[:1], fmt="map"))
    assert arr[0] == 1.0 and arr[2] == 0
    # positional: every field is sent, vLLM 0.32's trailing extra_keys, group_idx, kv_cache_spec_kind too
    head = ["BlockStored", [1, 2**64 - 1], None, list(range(32)), 16, None, "GPU", None]
    assert arr[1][0] == [*head, None, None, None]
    assert mp[1][0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2**64 - 1],
        "parent_block_hash": None,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    cleared = msgspec.msgpack.decode(encode_batch(1.0, [AllBlocksCleared(), BlockRemoved((7,))], fmt="array"))
    assert cleared[1] == [["AllBlocksCleared"], ["BlockRemoved", [7], "GPU"]]


def test_unknown_format_rejected():
    with pytest.raises(ValueError):
        encode_batch(1.0, [], fmt="json")  # type: ignore[arg-type]


# ---- bytes built by hand, byte for byte as msgpack lays out vLLM's array_like structs ----


def _str(s: str) -> bytes:
    b = s.encode()
    return bytes([0xA0 | len(b)]) + b


def test_hand_built_array_payload():
    # [ts=2.5, [["BlockStored", [0xDEADBEEF12345678], nil, [1, 300, 70000], 16, nil]], 0]
    stored = (
        b"\x96"
        + _str("BlockStored")
        + b"\x91\xcf"
        + struct.pack(">Q", 0xDEADBEEF12345678)
        + b"\xc0"
        + b"\x93\x01\xcd"
        + struct.pack(">H", 300)
        + b"\xce"
        + struct.pack(">I", 70000)
        + b"\x10"
        + b"\xc0"
    )
    removed = b"\x93" + _str("BlockRemoved") + b"\x91\xd3" + struct.pack(">q", -2) + _str("GPU")
    cleared = b"\x91" + _str("AllBlocksCleared")
    payload = b"\x93\xcb" + struct.pack(">d", 2.5) + b"\x93" + stored + removed + cleared + b"\x00"
    ts, events, rank = decode_batch(payload)
    assert (ts, rank) == (2.5, 0)
    assert events == [
        BlockStored(
            block_hashes=(0xDEADBEEF12345678,),
            parent_block_hash=None,
            token_ids=(1, 300, 70000),
            block_size=16,
        ),
        BlockRemoved(block_hashes=(-2,)),
        AllBlocksCleared(),
    ]


def test_hand_built_two_item_batch_without_rank():
    payload = b"\x92\x01\x91\x91" + _str("AllBlocksCleared")
    assert decode_batch(payload) == (1.0, [AllBlocksCleared()], None)


# ---- vLLM 0.10+ layout declared independently: positional batch, tagged map events with extras ----


class _VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _VStored(_VEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _VRemoved(_VEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


def test_vllm_map_layout_with_extra_fields_and_bytes_hashes():
    digest = bytes(range(32))
    batch = _VBatch(
        ts=10.0,
        events=[
            _VStored([digest], None, [5] * 16, 16, 3, "CPU", "adapter", extra_keys=[("salt",)], group_idx=0),
            _VRemoved([7], "GPU", group_idx=0),
        ],
        data_parallel_rank=1,
    )
    ts, events, rank = decode_batch(msgspec.msgpack.encode(batch))
    assert (ts, rank) == (10.0, 1)
    assert events == [
        BlockStored(
            (int.from_bytes(digest, "big"),),
            None,
            (5,) * 16,
            16,
            lora_id=3,
            lora_name="adapter",
            extra_keys=(("salt",),),
            group_idx=0,
        ),
        BlockRemoved((7,)),
    ]


def test_batch_as_map():
    payload = msgspec.msgpack.encode({"ts": 4.0, "events": [{"type": "AllBlocksCleared"}]})
    assert decode_batch(payload) == (4.0, [AllBlocksCleared()], None)


@pytest.mark.parametrize(
    "obj",
    [
        "just a string",
        [1.0],
        [1.0, [], 0, 9],
        ["x", [], 0],
        [1.0, "events", 0],
        [1.0, [], "rank"],
        [1.0, [["Nope"]], 0],
        [1.0, [[]], 0],
        [1.0, [5], 0],
        [1.0, [["BlockStored", [1], None]], 0],
        [1.0, [["BlockStored", [1], None, [1], 0]], 0],
        [1.0, [["BlockStored", [1.5], None, [1], 16]], 0],
        [1.0, [["BlockStored", [1], None, ["a"], 16]], 0],
        [1.0, [["BlockStored", [1], None, [3] * 15 + [True], 16]], 0],
        [1.0, [["BlockStored", [1], None, [3] * 15 + [2.0], 16]], 0],
        [1.0, [["BlockStored", [1, False], None, [3] * 32, 16]], 0],
        [1.0, [["BlockRemoved", [7, "x"]]], 0],
        [1.0, [["BlockStored", "hashes", None, [1], 16]], 0],
        [1.0, [{"type": "BlockRemoved"}], 0],
        [1.0, [{"block_hashes": []}], 0],
        {"events": []},
    ],
)
def test_malformed_payloads_raise_decode_error(obj):
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgspec.msgpack.encode(obj))


def test_mixed_int_and_bytes_hashes_decode():
    raw = [1.0, [["BlockStored", [5, b"\x01\x00"], 9, list(range(32)), 16], ["BlockRemoved", [b"\x02", 3]]]]
    _, events, _ = decode_batch(msgspec.msgpack.encode(raw))
    assert events == [
        BlockStored(block_hashes=(5, 256), parent_block_hash=9, token_ids=tuple(range(32)), block_size=16),
        BlockRemoved(block_hashes=(2, 3)),
    ]


def test_invalid_msgpack_raises_decode_error():
    with pytest.raises(KVEventDecodeError):
        decode_batch(b"\xc1\xff\x00")
    with pytest.raises(KVEventDecodeError):
        decode_batch(b"")


@given(st.binary(max_size=64))
def test_random_bytes_never_raise_other_errors(data):
    with contextlib.suppress(KVEventDecodeError):
        ts, events, _ = decode_batch(data)
        assert isinstance(ts, float) and isinstance(events, list)


def test_sequence_frames():
    assert encode_seq(5) == b"\x00" * 7 + b"\x05"
    assert decode_seq(encode_seq(2**40)) == 2**40
    assert decode_seq(END_SEQ) == -1
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x01")


def test_extra_keys_group_and_spec_kind_round_trip_and_decode_from_vllm_layouts():
    """vLLM 0.32's trailing BlockStored fields: ``extra_keys`` (one entry per block; a salt in the
    first block, a multimodal ``(hash, offset)`` pair), ``group_idx``, ``kv_cache_spec_kind``."""
    ev = BlockStored(
        (11, 12),
        None,
        tuple(range(32)),
        16,
        extra_keys=(("salt-a",), (("img", 3),)),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    for fmt in ("array", "map"):
        _, events, _ = decode_batch(encode_batch(2.0, [ev], fmt=fmt))
        assert events == [ev]
    plain = ["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", None, [None, None], 0]
    _, events, _ = decode_batch(msgspec.msgpack.encode([1.0, [plain], 0]))
    assert events[0].extra_keys == (None, None) and events[0].group_idx == 0
    mapped = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": list(range(16)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["s"]],
        "group_idx": 1,
        "kv_cache_spec_kind": "x",
        "kv_cache_spec_sliding_window": None,
        "locality": "LOCAL",
    }
    _, events, _ = decode_batch(msgspec.msgpack.encode([1.0, [mapped], 0]))
    assert events[0] == BlockStored(
        (1,), None, tuple(range(16)), 16, extra_keys=(("s",),), group_idx=1, kv_cache_spec_kind="x"
    )
    for bad in ([["s"], None], "s", [3]):  # wrong length, not an array, an entry that is no array
        with pytest.raises(KVEventDecodeError):
            decode_batch(msgspec.msgpack.encode([1.0, [{**mapped, "extra_keys": bad}], 0]))
    with pytest.raises(KVEventDecodeError):
        decode_batch(msgspec.msgpack.encode([1.0, [{**mapped, "group_idx": "0"}], 0]))
