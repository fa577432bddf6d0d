"""Chained block hashing: definition, prefix property, incremental forms, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.blocks import (
    ROOT_HASH,
    BlockHasher,
    _position_keys,
    event_key,
    extend_hashes,
    extra_key,
    hash_blocks,
    split_key,
)

M64 = (1 << 64) - 1

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=200)
small_tokens_st = st.lists(st.integers(0, 50), max_size=120)  # small vocab: many equal blocks


def _fmix64(x: int) -> int:
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & M64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & M64
    return x ^ (x >> 33)


def _mix(y: int) -> int:
    y = (y * 0xFF51AFD7ED558CCD) & M64
    y ^= y >> 32
    return (y * 0xC4CEB9FE1A85EC53) & M64


def reference(tokens: list[int], bs: int = 16, extra: str | bytes | None = None, parent: int | None = None):
    """The documented definition, one block at a time with plain Python ints."""
    keys = [int(k) for k in _position_keys(bs, extra)]
    h = ROOT_HASH if parent is None else parent
    out = []
    for b in range(len(tokens) // bs):
        c = _fmix64(sum(_mix(tokens[b * bs + k] ^ keys[k]) for k in range(bs)) & M64)
        h = (h * 0x2545F4914F6CDD1D + c) % (1 << 63)
        out.append(h)
    return out


def test_golden_values_pin_the_definition() -> None:
    # Computed once; any change here breaks interoperability between router replicas and saved data.
    assert hash_blocks(list(range(32))) == [4711124123566549492, 8648171427634436375]
    golden = [7644586897309919469, 7126419786345462088]
    assert hash_blocks(list(range(8)), block_size=4, extra_key="lora-a") == golden
    assert hash_blocks(np.arange(8, dtype=np.uint32), block_size=4, extra_key=b"lora-a") == golden


@settings(max_examples=60, deadline=None)
@given(tokens_st, st.integers(1, 20), st.sampled_from([None, "", b"", "lora", b"salt\x00"]))
def test_matches_reference_definition(tokens: list[int], bs: int, extra: str | bytes | None) -> None:
    assert hash_blocks(tokens, bs, extra) == reference(tokens, bs, extra)


@given(tokens_st, st.integers(1, 20))
def test_one_hash_per_full_block_in_63_bits(tokens: list[int], bs: int) -> None:
    hashes = hash_blocks(tokens, bs)
    assert len(hashes) == len(tokens) // bs
    assert all(0 <= h < 2**63 for h in hashes)
    assert hashes == hash_blocks(tokens + [7] * (bs - 1), bs)[: len(hashes)]  # the tail is ignored


@given(small_tokens_st, small_tokens_st, st.integers(1, 8))
def test_equal_hashes_iff_equal_prefix(a: list[int], b: list[int], bs: int) -> None:
    ha, hb = hash_blocks(a, bs), hash_blocks(b, bs)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * bs] == b[: (i + 1) * bs]
        assert (ha[i] == hb[i]) == same_prefix


@settings(deadline=None)  # a property, not a timing: the shared 2-core machine stalls examples
@given(tokens_st, tokens_st, st.integers(1, 20))
def test_parent_chains_like_one_call(a: list[int], b: list[int], bs: int) -> None:
    a = a[: len(a) // bs * bs]
    ha = hash_blocks(a, bs)
    parent = ha[-1] if ha else None
    assert hash_blocks(a + b, bs) == ha + hash_blocks(b, bs, parent=parent)
    assert extend_hashes(ha, b, bs) == hash_blocks(a + b, bs)


def test_extra_key_and_position_matter() -> None:
    tokens = list(range(64))
    plain = hash_blocks(tokens)
    assert set(plain).isdisjoint(hash_blocks(tokens, extra_key="lora"))
    assert hash_blocks(tokens, extra_key="") != hash_blocks(tokens)  # "" is a key, None is none
    assert hash_blocks(tokens, extra_key="é") == hash_blocks(tokens, extra_key="é".encode())
    swapped = [1, 0, *tokens[2:]]
    assert hash_blocks(swapped)[0] != plain[0]
    # The extra key enters every block, not only the root: same parent, different key → different.
    assert hash_blocks(tokens[16:32], parent=plain[0]) != hash_blocks(
        tokens[16:32], extra_key="x", parent=plain[0]
    )
    assert hash_blocks(tokens, block_size=8)[1] != plain[0]


def test_numpy_input_equals_list_input() -> None:
    rng = np.random.default_rng(1)
    arr = rng.integers(0, 150_000, size=1000, dtype=np.int64)
    assert hash_blocks(arr) == hash_blocks(arr.tolist())
    assert hash_blocks(arr.astype(np.uint32), 7) == hash_blocks(arr.tolist(), 7)


@settings(max_examples=60, deadline=None)
@given(tokens_st, st.lists(st.integers(0, 60), max_size=8), st.integers(1, 16))
def test_block_hasher_equals_one_shot(tokens: list[int], cuts: list[int], bs: int) -> None:
    hasher = BlockHasher(bs, extra_key="k")
    pieces = sorted(min(c, len(tokens)) for c in cuts)
    got: list[int] = []
    for lo, hi in zip([0, *pieces], [*pieces, len(tokens)], strict=True):
        new = hasher.extend(tokens[lo:hi])
        got.extend(new)
        assert hasher.hashes == got
        assert hasher.num_tokens == hi
    assert got == hash_blocks(tokens, bs, "k")


def test_block_hasher_copy_forks_and_accepts_numpy() -> None:
    base = BlockHasher(4)
    base.extend([1, 2, 3, 4, 5, 6])
    fork = base.copy()
    assert fork.extend(np.array([7, 8], dtype=np.int32)) == hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)[1:]
    assert base.hashes == hash_blocks([1, 2, 3, 4], 4)  # the original is untouched
    assert base.num_tokens == 6


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], ["a"]])
def test_rejects_bad_token_ids(bad: list) -> None:
    with pytest.raises(ValueError):
        hash_blocks([0] * 15 + bad)
    with pytest.raises(ValueError):
        hash_blocks(np.array([0] * 15 + bad) if not isinstance(bad[0], str) else bad * 16)


def test_block_hasher_rejects_bad_tokens_without_mutating() -> None:
    hasher = BlockHasher(4)
    hasher.extend([1, 2])
    with pytest.raises(ValueError):
        hasher.extend([3, -4])  # only reaches the tail
    with pytest.raises(ValueError):
        hasher.extend([3, 4, 5, 6, 2**40])
    assert hasher.num_tokens == 2 and hasher.hashes == []


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        hash_blocks([1, 2], block_size=0)
    with pytest.raises(ValueError):
        hash_blocks([1, 2], block_size=1, parent=2**63)
    with pytest.raises(ValueError):
        hash_blocks([1, 2], block_size=1, parent=-1)
    with pytest.raises(ValueError):
        BlockHasher(0)
    assert hash_blocks([], 16) == [] and hash_blocks([1] * 15) == []


@pytest.mark.parametrize("n", [4095, 4096, 4097, 5000])
def test_long_chains_beyond_the_power_table(n: int) -> None:
    """Chains longer than the precomputed powers of B equal the same chain hashed in short pieces."""
    tokens = [(i * 7919) % 151_000 for i in range(n)]
    whole = hash_blocks(tokens, 1)
    pieces: list[int] = []
    for start in range(0, n, 300):
        pieces += hash_blocks(tokens[start : start + 300], 1, parent=pieces[-1] if pieces else None)
    assert whole == pieces and len(whole) == n


def test_cache_salt_enters_the_first_block_only_as_in_vllm() -> None:
    """vLLM hashes ``cache_salt`` into a prompt's first block (``start_token_idx == 0``); the chain
    carries it into every later block. The adapter stays in every block."""
    tokens = list(range(64))
    salted = hash_blocks(tokens, 16, extra_key(None, "tenant-a"))
    plain = hash_blocks(tokens, 16)
    assert set(salted).isdisjoint(plain)
    assert set(salted).isdisjoint(hash_blocks(tokens, 16, extra_key(None, "tenant-b")))
    assert salted[1:] == hash_blocks(tokens[16:], 16, None, parent=salted[0])  # later blocks: no salt
    assert salted[0] == hash_blocks(tokens[:16], 16, extra_key(None, "tenant-a"))[0]
    lora = hash_blocks(tokens, 16, extra_key("sql", "tenant-a"))
    assert lora[1:] == hash_blocks(tokens[16:], 16, extra_key("sql"), parent=lora[0])
    assert set(lora).isdisjoint(hash_blocks(tokens, 16, extra_key("sql")))
    # after a parent the salt is ignored: a continuation hashes the same with or without it
    assert hash_blocks(tokens, 16, extra_key(None, "x"), parent=5) == hash_blocks(tokens, 16, parent=5)
    hasher = BlockHasher(16, extra_key(None, "tenant-a"))
    hasher.extend(tokens[:20])
    hasher.extend(tokens[20:])
    assert hasher.hashes == salted
    assert split_key(extra_key(None, "s")) == (extra_key(None, "s"), None)
    assert split_key("plain") == ("plain", "plain")


def test_event_key_reads_vllm_extra_keys() -> None:
    assert event_key(None, None) is None and event_key(None, ()) is None
    assert event_key("sql", ("sql",)) == extra_key("sql")
    assert event_key(None, ("salt",)) == extra_key(None, "salt")
    assert event_key("sql", ("sql", "salt")) == extra_key("sql", "salt")
    mm = event_key(None, (("img-hash", 0),))
    assert mm not in (None, extra_key(None, "img-hash")) and mm == event_key(None, (("img-hash", 0),))
    assert event_key(None, (("img-hash", 4),)) != mm
