"""Token ids → chained block hashes (vLLM's prefix-caching idea), computed once per request.

A prompt of ``n`` tokens has ``n // block_size`` *full* blocks; only full blocks get a hash (a partial
tail block is never cached by an engine, so it never counts). Block ``b``'s hash depends on the
hash of block ``b - 1`` (its *parent*), on the tokens of block ``b`` and on an optional extra key
(LoRA name, cache salt, ...), so equal hashes mean equal prefixes (up to 63-bit collisions) and
one dict lookup per block answers "is this prefix cached".

The hash ("kvroute block hash v1") is defined by explicit 64-bit integer arithmetic, so it is the
same in every process, on every machine and in every Python version (Python's salted ``hash`` of
``str``/``bytes`` is never used):

- per-position keys ``K[k]`` (``k`` in ``0..block_size-1``): SHAKE-128 of the block size and the
  extra key, read as little-endian uint64;
- per token ``z = mix(t[b, k] XOR K[k])`` with ``mix(y) = (y·C1 XOR (y·C1 >> 32))·C2`` (a bijection
  of 64-bit words), block content ``c_b = fmix64(Σ_k z)`` (all mod 2**64; ``fmix64`` is
  MurmurHash3's finaliser), so every token, its position and the extra key matter;
- chain ``h_b = (h_{b-1} · B + c_b) mod 2**63`` with a fixed odd multiplier ``B`` and
  ``h_{-1} = ROOT_HASH`` (or the ``parent`` given). Because the step is an affine map, the whole
  chain is computed with numpy in a few vector operations (a prefix sum with powers of ``B`` and of
  its inverse), with no per-block Python loop: that is what makes 512 blocks cost tens of
  microseconds instead of hundreds with one BLAKE2b call per block (see ``benchmarks/bench_route.py``).

Hashes are ints in ``[0, 2**63)``: they survive msgpack/JSON as int64. The hash is not
cryptographic: a crafted prompt could collide with another prefix, which can only misroute a
request (the engines use their own hashes), never corrupt an output.

Block ids that traces already carry (Mooncake and Qwen-Bailian ``hash_ids``: equal leading ids mean a
shared prefix) are already chained ids: feed them to :mod:`kvroute.index` as they are; they need no
conversion (and they need not be below 2**63).
"""

from __future__ import annotations

import array
import functools
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ROOT_HASH",
    "BlockHasher",
    "event_key",
    "extend_hashes",
    "extra_key",
    "hash_blocks",
    "split_key",
]

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block (vLLM's default)."""

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_C1 = 0xFF51AFD7ED558CCD  # MurmurHash3 fmix64 multipliers
_C2 = 0xC4CEB9FE1A85EC53
_B = 0x2545F4914F6CDD1D  # odd chain multiplier (invertible mod 2**64)
_B_INV = pow(_B, -1, 1 << 64)

ROOT_HASH = 0x1D8E4E27C47D124F & _MASK63
"""Parent hash of a prompt's first block when no ``parent`` is given."""

_U64 = np.uint64
_SH32 = _U64(32)
_POW_BLOCKS = 4096  # powers of B precomputed for chains up to this many blocks (64 KiB, read-only)
_B_POW = np.cumprod(np.full(_POW_BLOCKS + 1, _B, dtype=np.uint64))  # B^1 .. B^(n+1)
_B_INV_POW = np.cumprod(np.full(_POW_BLOCKS, _B_INV, dtype=np.uint64))  # B^-1 .. B^-n
_B_POW.flags.writeable = False
_B_INV_POW.flags.writeable = False
_SH33 = _U64(33)
_NP_C1 = _U64(_C1)
_NP_C2 = _U64(_C2)
_NP_MASK63 = _U64(_MASK63)

TokenIds = Sequence[int] | npt.NDArray[np.integer]


_LORA_TAG = b"\x00lora\x00"
_SALT_TAG = b"\x00salt\x00"
_OPAQUE_TAG = b"\x00xk\x00"


def extra_key(lora_name: str | None = None, cache_salt: str | None = None) -> str | bytes | None:
    """The extra key of a request's blocks: its LoRA adapter (as vLLM hashes ``lora_name`` into every
    block's extra keys, so the same tokens under two adapters, or under an adapter and the base model,
    are different cache entries) and its ``cache_salt``: None without either, else a byte string whose
    parts are tagged with NUL characters (``\\x00lora\\x00NAME``, then ``\\x00salt\\x00SALT``).

    **The salt enters the first block of a prompt only**, as in vLLM (``generate_block_hash_extra_keys``
    adds ``cache_salt`` when ``start_token_idx == 0``): :func:`hash_blocks` hashes the root block (no
    ``parent``) with the whole key and every later block with the adapter's key alone
    (:func:`split_key`); the chain carries the salt into every later hash. So a salted prompt shares
    no block with the same text unsalted or under another salt, and a continuation hashed after a
    ``parent`` needs no salt (vLLM's later ``BlockStored`` events carry none)."""
    if lora_name is None:
        return None if cache_salt is None else _SALT_TAG + cache_salt.encode("utf-8")
    key = _LORA_TAG + lora_name.encode("utf-8")
    if cache_salt is not None:
        key += _SALT_TAG + cache_salt.encode("utf-8")
    return key


def split_key(key: str | bytes | None) -> tuple[str | bytes | None, str | bytes | None]:
    """``(key of a prompt's first block, key of every later block)`` for an extra key: a salt-only key
    of :func:`extra_key` leaves later blocks without a key, an adapter key with a salt keeps the
    adapter for later blocks, any other key (any ``str``, untagged bytes) applies to every block. Pure."""
    if isinstance(key, bytes):
        if key.startswith(_SALT_TAG):
            return key, None
        if key.startswith(_LORA_TAG):
            cut = key.find(_SALT_TAG, len(_LORA_TAG))
            return key, (key if cut < 0 else key[:cut])
    return key, key


def event_key(lora_name: str | None, block_extra: Sequence[object] | None) -> str | bytes | None:
    """The router's extra key for one block of a ``BlockStored`` event: ``lora_name`` and that block's
    ``extra_keys`` entry (vLLM: ``lora name + multimodal hashes + cache_salt (first block only) +
    prompt-embedding hashes``). Adapter only (or nothing) → ``extra_key(lora_name)``; adapter and one
    string (a salt; only a root block has one) → ``extra_key(lora_name, salt)``, the key the router
    gives a salted request; anything else (multimodal or embedding hashes, which the router's text
    requests never carry) → an opaque per-block key, so those blocks and their descendants are
    recorded but never match a request. Pure."""
    rest = list(block_extra or ())
    if lora_name is not None and rest and rest[0] == lora_name:
        rest = rest[1:]
    if not rest:
        return extra_key(lora_name)
    if len(rest) == 1 and isinstance(rest[0], str):
        return extra_key(lora_name, rest[0])
    return _OPAQUE_TAG + repr((lora_name, rest)).encode("utf-8")


@functools.lru_cache(maxsize=256)
def _position_keys(block_size: int, extra_key: str | bytes | None) -> npt.NDArray[np.uint64]:
    """The ``block_size`` per-position keys (uint64) for this block size and extra key.

    SHAKE-128 of a tagged encoding of (block size, extra key), read as little-endian uint64s,
    identical on every machine. A pure function, so its last 256 results are kept (read-only
    arrays): a router hashes every request with the same few keys, and OpenSSL's digest set-up
    costs more than the hashing of a short prompt.
    """
    if extra_key is None:
        tail = b"\x00"
    else:  # a tag byte keeps None, "" and b"" apart
        tail = b"\x01" + (extra_key.encode("utf-8") if isinstance(extra_key, str) else bytes(extra_key))
    seed = b"kvroute-blk-v1\x00" + block_size.to_bytes(8, "little") + tail
    raw = hashlib.shake_128(seed).digest(8 * block_size)
    keys = np.frombuffer(raw, dtype="<u8").astype(np.uint64)
    keys.setflags(write=False)
    return keys


def _fmix64_inplace(x: npt.NDArray[np.uint64], tmp: npt.NDArray[np.uint64]) -> None:
    """MurmurHash3's fmix64 on every element of ``x`` (mod 2**64), in place; ``tmp`` is scratch."""
    np.right_shift(x, _SH33, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, _NP_C1, out=x)
    np.right_shift(x, _SH33, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, _NP_C2, out=x)
    np.right_shift(x, _SH33, out=tmp)
    np.bitwise_xor(x, tmp, out=x)


def _as_u64_blocks(token_ids: TokenIds, n_blocks: int, block_size: int) -> npt.NDArray[np.uint64]:
    """The first ``n_blocks * block_size`` token ids as a fresh (n_blocks, block_size) uint64 array.

    Token ids must be in [0, 2**32) (every real vocabulary is); raises ValueError otherwise.
    """
    n = n_blocks * block_size
    if isinstance(token_ids, np.ndarray):
        arr = token_ids[:n]
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise ValueError("token ids must be integers in [0, 2**32)")
        return arr.astype(np.uint64).reshape(n_blocks, block_size)
    try:
        # array('I') is the fastest list -> machine-int conversion and range-checks each id.
        packed = array.array("I", token_ids[:n] if len(token_ids) != n else token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
    u32 = np.frombuffer(packed, dtype=np.uint32) if packed.itemsize == 4 else np.array(packed, np.uint32)
    return u32.astype(np.uint64).reshape(n_blocks, block_size)


def _check(block_size: int, parent: int | None) -> int:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if parent is None:
        return ROOT_HASH
    if not 0 <= parent <= _MASK63:
        raise ValueError(f"parent hash must be in [0, 2**63), got {parent}")
    return parent


def _chain(
    token_ids: TokenIds, n_blocks: int, block_size: int, keys: npt.NDArray[np.uint64], parent: int
) -> list[int]:
    """Hashes of the first ``n_blocks`` full blocks of ``token_ids`` chained after ``parent``."""
    if n_blocks == 0:
        return []
    x = _as_u64_blocks(token_ids, n_blocks, block_size)
    tmp = np.empty_like(x)
    np.bitwise_xor(x, keys, out=x)  # broadcast over blocks
    np.multiply(x, _NP_C1, out=x)
    np.right_shift(x, _SH32, out=tmp)
    np.bitwise_xor(x, tmp, out=x)
    np.multiply(x, _NP_C2, out=x)
    c = x.sum(axis=1, dtype=np.uint64)  # wraps mod 2**64
    _fmix64_inplace(c, np.empty_like(c))
    # h_b = B^(b+1)·parent + Σ_{j<=b} c_j·B^(b-j) = B^(b+1)·parent + B^b · Σ_{j<=b} c_j·B^(-j)  (mod 2**64)
    if n_blocks <= _POW_BLOCKS:
        b_pow, inv_pow = _B_POW[: n_blocks + 1], _B_INV_POW[:n_blocks]
    else:
        b_pow = np.cumprod(np.full(n_blocks + 1, _B, dtype=np.uint64))  # B^1 .. B^(n+1)
        inv_pow = np.cumprod(np.full(n_blocks, _B_INV, dtype=np.uint64))  # B^-1 .. B^-n
    np.multiply(c[1:], inv_pow[:-1], out=c[1:])
    np.cumsum(c, out=c)
    np.multiply(c[1:], b_pow[:-2], out=c[1:])
    np.add(c, b_pow[:-1] * _U64(parent), out=c)
    np.bitwise_and(c, _NP_MASK63, out=c)
    out: list[int] = c.tolist()
    return out


def hash_blocks(
    token_ids: TokenIds,
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra_key: str | bytes | None = None,
    parent: int | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids``: one int in [0, 2**63) per full block.

    ``len(result) == len(token_ids) // block_size``; a partial tail block is ignored. ``extra_key``
    (LoRA name, cache salt; ``str`` is UTF-8 encoded; see :func:`extra_key`): the adapter enters every
    block, a salt the root block only (``parent is None``), so different keys never share blocks. ``parent`` is the hash of the block just before ``token_ids[0]`` (``None``: the
    start of a prompt), so ``hash_blocks(a + b) == hash_blocks(a) + hash_blocks(b, parent=...[-1])``
    when ``len(a)`` is a multiple of ``block_size``. Token ids are ints (or a numpy integer array) in
    [0, 2**32); raises ValueError otherwise (the ignored tail is not inspected), or for
    ``block_size < 1`` or a parent outside [0, 2**63).
    Pure: deterministic across processes, machines and Python versions.
    """
    root = _check(block_size, parent)
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    first, rest = split_key(extra_key)
    if parent is not None or first == rest:
        return _chain(token_ids, n_blocks, block_size, _position_keys(block_size, rest), root)
    head = _chain(token_ids, 1, block_size, _position_keys(block_size, first), root)
    if n_blocks == 1:
        return head
    tail = token_ids[block_size : n_blocks * block_size]
    return head + _chain(tail, n_blocks - 1, block_size, _position_keys(block_size, rest), head[0])


def extend_hashes(
    prev_hashes: Sequence[int],
    token_ids: TokenIds,
    block_size: int = DEFAULT_BLOCK_SIZE,
    extra_key: str | bytes | None = None,
) -> list[int]:
    """``prev_hashes`` followed by the hashes of the full blocks of ``token_ids`` chained after them.

    ``token_ids`` are the tokens that follow the ``len(prev_hashes)`` blocks already hashed (for a
    per-message token cache: the new message's tokens, starting at a block boundary); a partial tail
    is ignored, so keep it and pass it again with the next tokens (:class:`BlockHasher` does that).
    Returns a new list; ``prev_hashes`` is not mutated.
    """
    parent = prev_hashes[-1] if prev_hashes else None
    return [*prev_hashes, *hash_blocks(token_ids, block_size, extra_key, parent)]


class BlockHasher:
    """Hashes a growing token prefix incrementally: earlier blocks are never recomputed.

    ``extend(tokens)`` appends tokens and returns the hashes of the blocks they completed; the
    partial tail (< ``block_size`` tokens) waits for the next call. ``hashes`` holds every full
    block's hash so far and always equals ``hash_blocks(all tokens so far, block_size, extra_key)``.
    Mutable and not thread-safe: one per conversation/request; ``copy()`` forks a prefix cheaply.
    """

    __slots__ = ("_first", "_hashes", "_keys", "_tail", "block_size", "extra_key")

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, extra_key: str | bytes | None = None) -> None:
        _check(block_size, None)
        self.block_size = block_size
        self.extra_key = extra_key
        first, rest = split_key(extra_key)
        self._keys = _position_keys(block_size, rest)
        self._first = None if first == rest else _position_keys(block_size, first)  # the root block's
        self._hashes: list[int] = []
        self._tail: list[int] = []

    @property
    def hashes(self) -> list[int]:
        """Hashes of all full blocks so far (a copy)."""
        return list(self._hashes)

    @property
    def num_tokens(self) -> int:
        """Tokens given so far, including the partial tail."""
        return len(self._hashes) * self.block_size + len(self._tail)

    def extend(self, token_ids: TokenIds) -> list[int]:
        """Append ``token_ids``; return the hashes of the blocks completed by them (maybe none).

        Raises ValueError for token ids outside [0, 2**32) (then nothing is appended).
        """
        bs = self.block_size
        tokens: TokenIds
        if self._tail:
            tokens = self._tail + (
                token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
            )
        else:
            tokens = token_ids
        n_blocks = len(tokens) // bs
        parent = self._hashes[-1] if self._hashes else ROOT_HASH
        if self._hashes or self._first is None or n_blocks == 0:
            new = _chain(tokens, n_blocks, bs, self._keys, parent)
        else:  # the root block carries the salt (see extra_key)
            new = _chain(tokens, 1, bs, self._first, parent)
            new += _chain(tokens[bs : n_blocks * bs], n_blocks - 1, bs, self._keys, new[0])
        tail = tokens[n_blocks * bs :]
        if len(tail):  # the tail is not hashed yet: validate it now, before mutating anything
            _as_u64_blocks(tail, 1, len(tail))
        self._tail = tail.tolist() if isinstance(tail, np.ndarray) else list(tail)
        self._hashes.extend(new)
        return new

    def copy(self) -> BlockHasher:
        """An independent hasher with the same state (e.g. to try a continuation)."""
        other = BlockHasher.__new__(BlockHasher)
        other.block_size = self.block_size
        other.extra_key = self.extra_key
        other._keys = self._keys
        other._first = self._first
        other._hashes = list(self._hashes)
        other._tail = list(self._tail)
        return other
