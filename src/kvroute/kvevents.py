"""vLLM's KV-cache event wire format (``vllm/distributed/kv_events.py``), encoded and decoded with msgspec.

One ZMQ message is multipart ``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian sequence number
and ``payload`` one msgpack ``EventBatch``. The batch is positional, ``[ts, [events...], dp_rank]``
(``ts`` in seconds since the epoch); newer engines may send it as a map ``{"ts", "events",
"data_parallel_rank"}``. Each event is a msgspec tagged struct whose tag is its class name:

- ``fmt="array"`` (older vLLM, ``array_like=True``): ``["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``.
- ``fmt="map"`` (vLLM 0.10+): ``{"type": "BlockStored", "block_hashes": ..., ...}``; fields equal to
  their default are omitted (``lora_id``, ``medium``, ``lora_name`` have none, so they are always sent).

Block hashes are ints (signed or unsigned 64-bit) or, with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``,
digest bytes; :func:`decode_batch` maps bytes to ``int.from_bytes(b, "big")``. Events are decoded
whatever their ``medium`` (GPU or an offload tier); unknown extra fields are ignored; an unknown event
tag is a decode error. ``lora_id`` and ``lora_name`` (the LoRA adapter of the request that cached the
blocks; vLLM hashes the name into the blocks' extra keys) are decoded into :class:`BlockStored`, and
so are vLLM 0.32's trailing optional fields ``extra_keys`` (one entry per block: the keys hashed into
it, a request's ``cache_salt`` in its first block, multimodal hashes), ``group_idx`` and
``kv_cache_spec_kind``; later fields are ignored.

**SGLang** (``sglang/srt/disaggregation/kv_events.py``, ``mem_cache``'s event mixin) publishes the
same framing, replay protocol and event tags, with these differences, all decoded here: the batch is
``[ts, [events...]]`` (no rank); events are always positional; ``BlockStored`` is
``["BlockStored", [hash], parent, token_ids, block_size, lora_id]`` (newer: ``medium`` after it, no
``lora_name``), **one event per page** of ``page_size`` tokens (SGLang's default page size is 1
token; the last page of a radix node may be shorter), chained through ``parent_block_hash``;
``BlockRemoved`` is ``["BlockRemoved", [hash]]`` (newer: ``medium``), one per page. The router
re-blocks pages into its own blocks (:class:`kvroute.routing.kvview.KVView`). ``fmt="sglang"`` in
:func:`encode_batch` writes that layout (the emulated engine's ``--flavor sglang``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = [
    "END_SEQ",
    "EVENT_FORMATS",
    "MEDIUM_GPU",
    "KVEventDecodeError",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

EventFormat = Literal["array", "map", "sglang"]
EVENT_FORMATS = ("array", "map", "sglang")
MEDIUM_GPU = "GPU"
# sent by the replay socket after the last buffered batch: sequence number -1
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventDecodeError(ValueError):
    """A payload that is not a valid vLLM KV event batch (bad msgpack, shape, tag or field type)."""


# ---- wire structs (our own declarations of vLLM's layout) ------------------------------------------


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _SglBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]


class _SglBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _SglBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


_MASK63 = (1 << 63) - 1
_PAGE_MUL = 0x9E3779B97F4A7C15


def page_hashes(block_hash: int, pages: int) -> list[int]:
    """Hashes of the ``pages`` pages of one block in SGLang layout: the last page carries the block's
    own hash (so a child block's parent is its parent block's hash), the others a hash derived from
    it. Emulation only: a real SGLang hashes each page itself."""
    return [((block_hash * _PAGE_MUL + j + 1) & _MASK63) for j in range(pages - 1)] + [block_hash]


def _to_sglang(event: KVEvent, pages: int) -> list[msgspec.Struct]:
    """One event per page (``pages`` pages per block), as SGLang's radix cache publishes them."""
    if isinstance(event, BlockStored):
        out: list[msgspec.Struct] = []
        parent = event.parent_block_hash
        bs = event.block_size
        ps = bs // pages
        for b, h in enumerate(event.block_hashes):
            tokens = event.token_ids[b * bs : (b + 1) * bs]
            for j, ph in enumerate(page_hashes(h, pages)):
                page = list(tokens[j * ps : (j + 1) * ps])
                out.append(_SglBlockStored([ph], parent, page, len(page), event.lora_id, MEDIUM_GPU))
                parent = ph
        return out
    if isinstance(event, BlockRemoved):  # leaf first, as SGLang evicts
        return [
            _SglBlockRemoved([ph], MEDIUM_GPU)
            for h in event.block_hashes
            for ph in reversed(page_hashes(h, pages))
        ]
    if isinstance(event, AllBlocksCleared):
        return [_ArrayAllBlocksCleared()]
    raise TypeError(f"not a KV event: {event!r}")


def _to_wire(event: KVEvent, fmt: EventFormat) -> msgspec.Struct:
    arr = fmt == "array"
    if isinstance(event, BlockStored):
        stored = _ArrayBlockStored if arr else _MapBlockStored
        return stored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=MEDIUM_GPU,
            lora_name=event.lora_name,
            extra_keys=None
            if event.extra_keys is None
            else [None if k is None else list(k) for k in event.extra_keys],
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
        )
    if isinstance(event, BlockRemoved):
        removed = _ArrayBlockRemoved if arr else _MapBlockRemoved
        return removed(block_hashes=list(event.block_hashes), medium=MEDIUM_GPU)
    if isinstance(event, AllBlocksCleared):
        return _ArrayAllBlocksCleared() if arr else _MapAllBlocksCleared()
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(
    ts: float,
    events: Sequence[KVEvent],
    dp_rank: int | None = 0,
    fmt: EventFormat = "array",
    pages_per_block: int = 1,
) -> bytes:
    """One msgpack ``EventBatch`` payload. ``ts`` in seconds since the epoch; ``fmt`` picks the event
    encoding (the batch itself is always positional, as vLLM's ``ZmqEventPublisher`` sends it).
    ``fmt="sglang"``: SGLang's layout (module docstring), each block sent as ``pages_per_block``
    pages (its block size must be a multiple); ``dp_rank`` is not sent."""
    if fmt not in EVENT_FORMATS:
        raise ValueError(f"unknown KV event format {fmt!r} (use one of {', '.join(EVENT_FORMATS)})")
    if fmt == "sglang":
        if pages_per_block < 1:
            raise ValueError(f"pages_per_block must be >= 1, got {pages_per_block}")
        wire = [w for e in events for w in _to_sglang(e, pages_per_block)]
        return msgspec.msgpack.encode(_SglBatch(ts=float(ts), events=wire))
    batch = _Batch(ts=float(ts), events=[_to_wire(e, fmt) for e in events], data_parallel_rank=dp_rank)
    return msgspec.msgpack.encode(batch)


def encode_seq(seq: int) -> bytes:
    """The 8-byte big-endian frame of a sequence number (signed, so that -1 is ``END_SEQ``)."""
    return seq.to_bytes(8, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """Inverse of :func:`encode_seq`; raises :class:`KVEventDecodeError` unless the frame is 8 bytes."""
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


# ---- decoding (generic msgpack → checked fields → engine dataclasses) --------------------------------

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size")
_STORED_OPTIONAL = (  # positional order after the required ones
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes",)
_INT_ONLY = frozenset({int})


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """Decode one ``EventBatch`` in either encoding → ``(ts seconds, events, data_parallel_rank)``.

    Raises :class:`KVEventDecodeError` on anything malformed; never another exception type.
    """
    try:
        obj = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise KVEventDecodeError(f"invalid msgpack: {exc}") from exc
    except RecursionError:  # nested deeper than the decoder recurses: no valid batch is
        raise KVEventDecodeError("invalid msgpack: nested too deeply") from None
    if isinstance(obj, list):
        if not 2 <= len(obj) <= 3:
            raise KVEventDecodeError(f"EventBatch array must have 2 or 3 items, got {len(obj)}")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) == 3 else None
    elif isinstance(obj, dict):
        if "ts" not in obj or "events" not in obj:
            raise KVEventDecodeError("EventBatch map needs 'ts' and 'events'")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise KVEventDecodeError(f"EventBatch must be an array or a map, got {type(obj).__name__}")
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventDecodeError("EventBatch ts must be a number")
    if not isinstance(events, list):
        raise KVEventDecodeError("EventBatch events must be an array")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise KVEventDecodeError("EventBatch data_parallel_rank must be an int or nil")
    return float(ts), [_decode_event(e, i) for i, e in enumerate(events)], rank


def _decode_event(raw: Any, index: int) -> KVEvent:
    if isinstance(raw, list):
        if not raw or not isinstance(raw[0], str):
            raise KVEventDecodeError(f"event {index}: array event must start with its tag")
        tag, values = raw[0], raw[1:]
        names = {"BlockStored": _STORED_FIELDS, "BlockRemoved": _REMOVED_FIELDS}.get(tag, ())
        if len(values) < len(names):
            raise KVEventDecodeError(f"event {index}: {tag} needs {len(names)} fields, got {len(values)}")
        if tag == "BlockStored":
            names = _STORED_FIELDS + _STORED_OPTIONAL
        fields = dict(zip(names, values, strict=False))
    elif isinstance(raw, dict):
        map_tag = raw.get("type")
        if not isinstance(map_tag, str):
            raise KVEventDecodeError(f"event {index}: map event needs a string 'type'")
        tag, fields = map_tag, raw
    else:
        raise KVEventDecodeError(f"event {index}: must be an array or a map")
    if tag == "BlockStored":
        _require(fields, _STORED_FIELDS, tag, index)
        block_size = fields["block_size"]
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise KVEventDecodeError(f"event {index}: block_size must be a positive int")
        parent = fields["parent_block_hash"]
        lora_id, lora_name = fields.get("lora_id"), fields.get("lora_name")
        if lora_id is not None and (isinstance(lora_id, bool) or not isinstance(lora_id, int)):
            raise KVEventDecodeError(f"event {index}: lora_id must be an int or nil")
        if lora_name is not None and not isinstance(lora_name, str):
            raise KVEventDecodeError(f"event {index}: lora_name must be a string or nil")
        hashes = _hashes(fields["block_hashes"], index)
        group, kind = fields.get("group_idx"), fields.get("kv_cache_spec_kind")
        if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
            raise KVEventDecodeError(f"event {index}: group_idx must be an int or nil")
        if kind is not None and not isinstance(kind, str):
            raise KVEventDecodeError(f"event {index}: kv_cache_spec_kind must be a string or nil")
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else _hash(parent, index),
            token_ids=_ints(fields["token_ids"], "token_ids", index),
            block_size=block_size,
            lora_id=lora_id,
            lora_name=lora_name,
            extra_keys=_extra_keys(fields.get("extra_keys"), len(hashes), index),
            group_idx=group,
            kv_cache_spec_kind=kind,
        )
    if tag == "BlockRemoved":
        _require(fields, _REMOVED_FIELDS, tag, index)
        return BlockRemoved(block_hashes=_hashes(fields["block_hashes"], index))
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"event {index}: unknown event type {tag!r}")


def _freeze(value: Any) -> object:
    """msgpack arrays (vLLM's tuples, e.g. a multimodal ``(hash, offset)``) as tuples, recursively."""
    return tuple(_freeze(v) for v in value) if isinstance(value, list) else value


def _extra_keys(value: Any, n: int, index: int) -> tuple[tuple[object, ...] | None, ...] | None:
    """``BlockStored.extra_keys``: nil, or one entry (an array or nil) per block."""
    if value is None:
        return None
    if not isinstance(value, list) or len(value) != n:
        raise KVEventDecodeError(f"event {index}: extra_keys must be nil or one entry per block")
    if not any(value):
        return (None,) * n
    out: list[tuple[object, ...] | None] = []
    for entry in value:
        if entry is not None and not isinstance(entry, list):
            raise KVEventDecodeError(f"event {index}: each extra_keys entry must be an array or nil")
        out.append(None if entry is None else tuple(_freeze(v) for v in entry))
    return tuple(out)


def _require(fields: dict[str, Any], names: Sequence[str], tag: str, index: int) -> None:
    missing = [n for n in names if n not in fields]
    if missing:
        raise KVEventDecodeError(f"event {index}: {tag} lacks {', '.join(missing)}")


def _hash(value: Any, index: int) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventDecodeError(f"event {index}: block hash must be an int or bytes")
    return value


def _hashes(value: Any, index: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVEventDecodeError(f"event {index}: block_hashes must be an array")
    if set(map(type, value)) <= _INT_ONLY:  # fast path: int hashes need no conversion
        return tuple(value)
    return tuple(_hash(v, index) for v in value)


def _ints(value: Any, name: str, index: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVEventDecodeError(f"event {index}: {name} must be an array of ints")
    # Fast path (C loops, no per-element Python frame): msgpack decodes token ids to exact ints.
    if set(map(type, value)) <= _INT_ONLY:
        return tuple(value)
    if any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise KVEventDecodeError(f"event {index}: {name} must be an array of ints")
    return tuple(value)
