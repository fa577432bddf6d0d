"""Property tests of KV event decoding: whatever bytes or msgpack arrive on the ZMQ socket, decoding
raises nothing but :class:`KVEventDecodeError`; deep msgpack (a RecursionError inside the decoder) is a
decode error too; valid batches round-trip in every encoding."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.kvevents import KVEventDecodeError, decode_batch, encode_batch

FAST = settings(max_examples=60, deadline=None)
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack carries

scalars = st.none() | st.booleans() | ints | st.floats() | st.text(max_size=12)
scalars = (
    scalars | st.binary(max_size=12) | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.text(max_size=8)
            | st.sampled_from(
                ["ts", "events", "type", "block_hashes", "block_size", "token_ids", "parent_block_hash"]
            ),
            inner,
            max_size=5,
        )
    ),
    max_leaves=25,
)


def _decodes_or_refuses(payload: bytes) -> None:
    with contextlib.suppress(KVEventDecodeError):
        ts, events, rank = decode_batch(payload)
        assert isinstance(ts, float) and isinstance(events, list)
        assert rank is None or isinstance(rank, int)


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_decode_errors(data: bytes) -> None:
    _decodes_or_refuses(data)


@FAST
@given(values)
def test_arbitrary_msgpack_raises_only_decode_errors(obj: object) -> None:
    _decodes_or_refuses(msgspec.msgpack.encode(obj))


@FAST
@given(
    st.lists(values, max_size=4),
    st.floats(allow_nan=False) | ints,
    st.none() | ints | values,
)
def test_batch_shaped_msgpack_raises_only_decode_errors(
    events: list[object], ts: object, rank: object
) -> None:
    """Right outer shape, arbitrary events: the per-event checks refuse, never crash."""
    _decodes_or_refuses(msgspec.msgpack.encode([ts, events, rank]))
    _decodes_or_refuses(msgspec.msgpack.encode({"ts": ts, "events": events, "data_parallel_rank": rank}))


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"], ids=["arrays", "maps"])
def test_deep_msgpack_is_a_decode_error_not_a_recursion_error(opener: bytes) -> None:
    payload = opener * 100_000 + b"\xc0"
    with pytest.raises(KVEventDecodeError, match=r"nested too deeply|invalid msgpack"):
        decode_batch(payload)
    inner = b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 100_000 + b"\xc0"  # [ts, [[[...]]]]
    with pytest.raises(KVEventDecodeError):
        decode_batch(inner)


hashes = st.lists(st.integers(0, 2**63 - 1), min_size=1, max_size=6).map(tuple)
stored = st.builds(
    BlockStored,
    block_hashes=hashes,
    parent_block_hash=st.none() | st.integers(0, 2**63 - 1),
    token_ids=st.lists(st.integers(0, 200_000), max_size=32).map(tuple),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 1000),
    lora_name=st.none() | st.text(min_size=1, max_size=8),
)
events = st.lists(
    stored | st.builds(BlockRemoved, block_hashes=hashes) | st.just(AllBlocksCleared()), max_size=6
)


@FAST
@given(events, st.floats(0, 2e9), st.sampled_from(["array", "map"]))
def test_valid_batches_round_trip(evs: list[object], ts: float, fmt: str) -> None:
    got_ts, got, rank = decode_batch(encode_batch(ts, evs, 0, fmt))  # type: ignore[arg-type]
    assert got == evs and got_ts == ts and rank == 0
