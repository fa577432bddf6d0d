"""Streaming trace readers: one file → a stream of :class:`Request` in non-decreasing arrival order.

Formats (``TRACE_FORMATS``; ``fmt="auto"`` picks by extension, then by the keys of the first valid line):

- ``mooncake`` — Mooncake FAST'25 jsonl ``{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}``; 512-token blocks whose ids are chained (equal leading ids = equal prefix).
  ``block_ids`` = the first ``input_length // 512`` hash ids (full blocks only).
- ``bailian`` — Qwen-Bailian jsonl ``{"chat_id", "parent_chat_id", "timestamp": s, "input_length",
  "output_length", "type", "turn", "hash_ids"}``; 16-token blocks. ``session`` = the root chat id of the
  ``parent_chat_id`` chain (a parent never seen in the file is taken as the root); ``req_class`` = ``type``
  when present.
- ``azure`` — Azure LLM inference trace 2023 csv ``TIMESTAMP,ContextTokens,GeneratedTokens`` (absolute
  wall-clock strings); lengths only, so every request gets fresh, unique block ids (block size 16).
- ``vllm-bench`` — per-request records of a vLLM benchmark run (``requests.jsonl`` with ``input_toks``,
  ``output_toks``, ``arrival_time`` in epoch seconds); unique block ids (block size 16).
- ``jsonl`` — kvroute's generic format, one JSON object per line::

      {"timestamp": 0.25, "prompt_token_ids": [151644, 872, ...], "output_len": 128}
      {"timestamp": 0.50, "prompt": "some text", "output_len": 64, "session": 3, "user": "alice",
       "class": "chat"}
      {"timestamp": 0.75, "messages": [{"role": "user", "content": "hi"}], "output_len": 32}

  ``timestamp`` in seconds; exactly one of ``prompt_token_ids`` (token ids), ``prompt`` (text, tokenized
  with the bundled Qwen3 tokenizer, :mod:`kvroute.tokenizer`) or ``messages`` (OpenAI chat messages,
  rendered with ChatML); ``output_len`` tokens (>= 1 after clamping); optional ``session`` (int),
  ``user`` (str), ``class`` (str). Block ids are ``kvroute.blocks.hash_blocks(token_ids, 16)``, so two
  prompts sharing leading full blocks share leading block ids, as in the live router.
- ``kvroute`` — a trace recorded by the live router (``kvroute serve --record FILE``,
  :mod:`kvroute.workloads.record`): a header line ``{"format": "kvroute-trace", "version": 1,
  "block_size": B, ...}``, then ``{"timestamp": s, "input_length", "output_length", "hash_ids", "model",
  "session"?, "user"?, "class"?, "status"?}`` per request; ``hash_ids`` are the router's block chain
  re-keyed with the file's secret salt (B-token blocks); ``model`` and ``status`` are read but not used by
  the simulator (it has one model pool).

Common rules:

- Arrival = (timestamp − first valid timestamp of the file) / ``rate_scale``, in seconds; requests with
  arrival >= ``duration`` (seconds, after scaling) end the stream.
- ``output_len`` is clamped to >= 1; ``prompt_len`` must be >= 1.
- Timestamps must be non-decreasing. A timestamp that goes backwards is a bad line (we stream and never
  buffer the file, so we do not sort; sort the file first, e.g. ``sort -n -k…``). All real traces here
  are sorted.
- A bad line raises :class:`TraceError` (``file:line: reason``); with ``skip_bad_lines=True`` it is
  skipped and counted in :class:`TraceStats`. Blank lines are ignored. A missing file is a
  :class:`UserError`.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvroute.errors import TraceError, UserError
from kvroute.workloads.record import TRACE_FORMAT as RECORD_FORMAT
from kvroute.workloads.record import TRACE_VERSION as RECORD_VERSION
from kvroute.workloads.request import Request

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per Mooncake hash block (Mooncake FAST'25 trace README)."""
BAILIAN_BLOCK_SIZE = 16
"""Tokens per Qwen-Bailian hash block (``*_blksz_16.jsonl``)."""
DEFAULT_BLOCK_SIZE = 16
"""Block size for formats without prefix information and the generic jsonl (vLLM's default)."""

TRACE_FORMATS: tuple[str, ...] = ("mooncake", "bailian", "azure", "vllm-bench", "jsonl", "kvroute")
"""Names accepted by ``open_trace(fmt=...)`` besides ``"auto"``."""

__all__ = [
    "TRACE_FORMATS",
    "TraceStats",
    "detect_format",
    "open_trace",
    "read_trace",
]


@dataclass(slots=True)
class TraceStats:
    """Counters of one trace read, updated in place while the stream is consumed.

    ``lines``: non-blank data lines seen (csv header excluded); ``requests``: requests yielded;
    ``bad_lines``: lines skipped as bad (only with ``skip_bad_lines``); ``first_bad``: the first skipped
    line's ``file:line: reason``; ``fmt``: the format actually read.
    """

    fmt: str = ""
    lines: int = 0
    requests: int = 0
    bad_lines: int = 0
    first_bad: str | None = None


@dataclass(frozen=True, slots=True)
class _Row:
    """One parsed line before timing: ``timestamp`` in seconds (format's own origin)."""

    timestamp: float
    prompt_len: int
    output_len: int
    block_ids: tuple[int, ...]
    block_size: int
    session: int = -1
    user: str | None = None
    req_class: str = "default"


class _BadLine(ValueError):
    """A line's content is invalid; the message is the reason."""


# ---------------------------------------------------------------------------------------------- fields


def _field(obj: dict[str, Any], key: str) -> Any:
    if key not in obj:
        raise _BadLine(f"missing field {key!r}")
    return obj[key]


def _int(obj: dict[str, Any], key: str, minimum: int | None = None) -> int:
    value = _field(obj, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise _BadLine(f"field {key!r} must be an integer, got {value!r}")
    n = int(value)
    if minimum is not None and n < minimum:
        raise _BadLine(f"field {key!r} must be >= {minimum}, got {n}")
    return n


def _float(obj: dict[str, Any], key: str) -> float:
    value = _field(obj, key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise _BadLine(f"field {key!r} must be a number, got {value!r}")
    if value in (float("inf"), float("-inf")):
        raise _BadLine(f"field {key!r} must be finite")
    return float(value)


def _hash_blocks(obj: dict[str, Any], prompt_len: int, block_size: int) -> tuple[int, ...]:
    ids = _field(obj, "hash_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise _BadLine("field 'hash_ids' must be a list of integers")
    full = prompt_len // block_size
    if len(ids) < full:
        raise _BadLine(
            f"'hash_ids' has {len(ids)} ids, fewer than the {full} full blocks of {prompt_len} tokens"
        )
    return tuple(ids[:full])


class _UniqueBlocks:
    """Fresh block ids for length-only traces (every request its own blocks): 0, 1, 2, …"""

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> tuple[int, ...]:
        start = self._next
        self._next += n
        return tuple(range(start, start + n))


# --------------------------------------------------------------------------------------------- parsers


class _Parser:
    """Turns one line (already split off the file) into a :class:`_Row`; may keep per-file state."""

    csv_header = False

    def parse(self, line: str) -> _Row | None:
        """The line's row, or None for a line that carries no request (a header)."""
        raise NotImplementedError


def _json_object(line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _BadLine(f"invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise _BadLine("expected a JSON object")
    return obj


class _Mooncake(_Parser):
    def parse(self, line: str) -> _Row:
        obj = _json_object(line)
        prompt_len = _int(obj, "input_length", 1)
        return _Row(
            timestamp=_float(obj, "timestamp") / 1000.0,
            prompt_len=prompt_len,
            output_len=max(1, _int(obj, "output_length")),
            block_ids=_hash_blocks(obj, prompt_len, MOONCAKE_BLOCK_SIZE),
            block_size=MOONCAKE_BLOCK_SIZE,
        )


class _Bailian(_Parser):
    def __init__(self) -> None:
        self._root: dict[int, int] = {}  # chat id → root chat id (one int pair per chat of the file)

    def parse(self, line: str) -> _Row:
        obj = _json_object(line)
        prompt_len = _int(obj, "input_length", 1)
        chat_id = _int(obj, "chat_id")
        parent = _int(obj, "parent_chat_id") if obj.get("parent_chat_id") is not None else -1
        root = chat_id if parent < 0 else self._root.get(parent, parent)
        self._root[chat_id] = root
        kind = obj.get("type")
        return _Row(
            timestamp=_float(obj, "timestamp"),
            prompt_len=prompt_len,
            output_len=max(1, _int(obj, "output_length")),
            block_ids=_hash_blocks(obj, prompt_len, BAILIAN_BLOCK_SIZE),
            block_size=BAILIAN_BLOCK_SIZE,
            session=root,
            req_class=str(kind) if isinstance(kind, str | int) and str(kind) else "default",
        )


class _Azure(_Parser):
    csv_header = True

    def __init__(self) -> None:
        self._blocks = _UniqueBlocks()

    def parse(self, line: str) -> _Row:
        cells = next(csv.reader([line]))
        if len(cells) != 3:
            raise _BadLine(f"expected 3 columns TIMESTAMP,ContextTokens,GeneratedTokens, got {len(cells)}")
        try:
            ts = datetime.fromisoformat(cells[0].strip()).timestamp()
        except ValueError:
            raise _BadLine(f"bad TIMESTAMP {cells[0]!r}") from None
        try:
            prompt_len, output_len = int(cells[1]), int(cells[2])
        except ValueError:
            raise _BadLine(f"token counts must be integers, got {cells[1]!r}, {cells[2]!r}") from None
        if prompt_len < 1:
            raise _BadLine(f"ContextTokens must be >= 1, got {prompt_len}")
        return _Row(
            timestamp=ts,
            prompt_len=prompt_len,
            output_len=max(1, output_len),
            block_ids=self._blocks.take(prompt_len // DEFAULT_BLOCK_SIZE),
            block_size=DEFAULT_BLOCK_SIZE,
        )


class _VllmBench(_Parser):
    def __init__(self) -> None:
        self._blocks = _UniqueBlocks()

    def parse(self, line: str) -> _Row:
        obj = _json_object(line)
        prompt_len = _int(obj, "input_toks", 1)
        return _Row(
            timestamp=_float(obj, "arrival_time"),
            prompt_len=prompt_len,
            output_len=max(1, _int(obj, "output_toks")),
            block_ids=self._blocks.take(prompt_len // DEFAULT_BLOCK_SIZE),
            block_size=DEFAULT_BLOCK_SIZE,
        )


class _Jsonl(_Parser):
    """kvroute's generic jsonl (see the module docstring)."""

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self._block_size = block_size
        self._tokenizer: Any = None  # loaded on the first text line only

    def _tokens(self, obj: dict[str, Any]) -> list[int]:
        given = [k for k in ("prompt_token_ids", "prompt", "messages") if k in obj]
        if len(given) != 1:
            raise _BadLine("expected exactly one of 'prompt_token_ids', 'prompt', 'messages'")
        key = given[0]
        value = obj[key]
        if key == "prompt_token_ids":
            if not isinstance(value, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
            ):
                raise _BadLine("'prompt_token_ids' must be a list of non-negative integers")
            return value
        if self._tokenizer is None:
            from kvroute.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer()
        if key == "prompt":
            if not isinstance(value, str):
                raise _BadLine("'prompt' must be a string")
            return list(self._tokenizer.encode(value))
        if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
            raise _BadLine("'messages' must be a list of objects")
        try:
            return list(self._tokenizer.encode_chat(value))
        except (KeyError, TypeError) as exc:
            raise _BadLine(f"bad 'messages': {exc}") from None

    def parse(self, line: str) -> _Row:
        from kvroute.blocks import hash_blocks

        obj = _json_object(line)
        tokens = self._tokens(obj)
        if not tokens:
            raise _BadLine("empty prompt")
        session = _int(obj, "session") if "session" in obj else -1
        user = obj.get("user")
        cls = obj.get("class", "default")
        if user is not None and not isinstance(user, str):
            raise _BadLine("'user' must be a string")
        if not isinstance(cls, str) or not cls:
            raise _BadLine("'class' must be a non-empty string")
        return _Row(
            timestamp=_float(obj, "timestamp"),
            prompt_len=len(tokens),
            output_len=max(1, _int(obj, "output_len")),
            block_ids=tuple(hash_blocks(tokens, self._block_size)),
            block_size=self._block_size,
            session=session,
            user=user,
            req_class=cls,
        )


class _Recorded(_Parser):
    """A trace recorded by the live router (see the module docstring); the header comes first."""

    def __init__(self) -> None:
        self._block_size: int | None = None

    def parse(self, line: str) -> _Row | None:
        obj = _json_object(line)
        if self._block_size is None:
            if obj.get("format") != RECORD_FORMAT:
                raise _BadLine(f'expected the header line {{"format": "{RECORD_FORMAT}", ...}} first')
            version = obj.get("version")
            if version != RECORD_VERSION:
                raise _BadLine(
                    f"unsupported {RECORD_FORMAT} version {version!r} (this reader: {RECORD_VERSION})"
                )
            self._block_size = _int(obj, "block_size", 1)
            return None
        prompt_len = _int(obj, "input_length", 1)
        session = _int(obj, "session", 0) if obj.get("session") is not None else -1
        user = obj.get("user")
        cls = obj.get("class", "default")
        if user is not None and not isinstance(user, str):
            raise _BadLine("'user' must be a string")
        if not isinstance(cls, str) or not cls:
            raise _BadLine("'class' must be a non-empty string")
        return _Row(
            timestamp=_float(obj, "timestamp"),
            prompt_len=prompt_len,
            output_len=max(1, _int(obj, "output_length")),
            block_ids=_hash_blocks(obj, prompt_len, self._block_size),
            block_size=self._block_size,
            session=session,
            user=user,
            req_class=cls,
        )


_PARSERS: dict[str, Callable[[], _Parser]] = {
    "mooncake": _Mooncake,
    "bailian": _Bailian,
    "azure": _Azure,
    "vllm-bench": _VllmBench,
    "jsonl": _Jsonl,
    "kvroute": _Recorded,
}


# ------------------------------------------------------------------------------------------- detection


def _format_of_keys(obj: dict[str, Any]) -> str | None:
    if obj.get("format") == RECORD_FORMAT:
        return "kvroute"
    if "hash_ids" in obj and "chat_id" in obj:
        return "bailian"
    if "hash_ids" in obj and "input_length" in obj:
        return "mooncake"
    if "input_toks" in obj and "arrival_time" in obj:
        return "vllm-bench"
    if any(k in obj for k in ("prompt_token_ids", "prompt", "messages")):
        return "jsonl"
    return None


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of ``path``: ``azure`` for ``.csv`` files (or a first line starting with
    ``TIMESTAMP,``), else by the keys of the first line that parses as a JSON object.
    Raises :class:`UserError` when the file is missing or nothing matches."""
    p = _existing(path)
    if p.suffix.lower() == ".csv":
        return "azure"
    with p.open(encoding="utf-8", errors="replace") as f:
        for raw in f:
            line = raw.strip()
            if not line:
                continue
            if line.upper().startswith("TIMESTAMP,"):
                return "azure"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                fmt = _format_of_keys(obj)
                if fmt is not None:
                    return fmt
                raise UserError(
                    f"{p}: cannot detect the trace format from keys {sorted(obj)[:8]}; "
                    f"pass --format one of {', '.join(TRACE_FORMATS)}"
                )
    raise UserError(f"{p}: no valid line to detect the trace format from; pass --format")


def _existing(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    if not p.exists():
        raise UserError(f"trace file not found: {p}")
    if not p.is_file():
        raise UserError(f"trace path is not a file: {p}")
    return p


def _check_scaling(rate_scale: float, duration: float | None) -> None:
    if not rate_scale > 0 or rate_scale == float("inf"):
        raise UserError(f"rate scale must be a positive finite number, got {rate_scale}")
    if duration is not None and not duration > 0:
        raise UserError(f"duration must be > 0 seconds, got {duration}")


# --------------------------------------------------------------------------------------------- reading


def read_trace(
    path: str | os.PathLike[str],
    fmt: str,
    stats: TraceStats,
    rate_scale: float = 1.0,
    duration: float | None = None,
    skip_bad_lines: bool = False,
) -> Iterator[Request]:
    """Generator of the requests of ``path`` read as ``fmt`` (a name of ``TRACE_FORMATS``), updating
    ``stats`` in place. Arrivals in seconds from the first valid timestamp, divided by ``rate_scale``;
    stops before the first arrival >= ``duration`` (seconds, after scaling). Raises :class:`TraceError` on
    the first bad line unless ``skip_bad_lines``. Prefer :func:`open_trace`, which validates eagerly."""
    p = Path(path)
    parser = _PARSERS[fmt]()
    stats.fmt = fmt
    first_ts: float | None = None
    last_ts = float("-inf")
    req_id = 0
    with p.open(encoding="utf-8", errors="replace", newline="") as f:
        header_pending = parser.csv_header
        for line_no, raw in enumerate(f, start=1):
            line = raw.strip()
            if not line:
                continue
            if header_pending:
                header_pending = False
                if line.upper().startswith("TIMESTAMP"):
                    continue
            stats.lines += 1
            try:
                row = parser.parse(line)
                if row is None:
                    continue
                if row.timestamp < last_ts:
                    raise _BadLine(
                        f"timestamp goes backwards ({row.timestamp:.6f} s after {last_ts:.6f} s); "
                        "traces must be sorted by time"
                    )
            except _BadLine as exc:
                error = TraceError(str(p), line_no, str(exc))
                if not skip_bad_lines:
                    raise error from None
                stats.bad_lines += 1
                if stats.first_bad is None:
                    stats.first_bad = str(error)
                continue
            last_ts = row.timestamp
            if first_ts is None:
                first_ts = row.timestamp
            arrival = (row.timestamp - first_ts) / rate_scale
            if duration is not None and arrival >= duration:
                return
            yield Request(
                req_id=req_id,
                arrival=arrival,
                prompt_len=row.prompt_len,
                output_len=row.output_len,
                block_ids=row.block_ids,
                block_size=row.block_size,
                session=row.session,
                user=row.user,
                req_class=row.req_class,
            )
            req_id += 1
            stats.requests += 1


def open_trace(
    path: str | os.PathLike[str],
    fmt: str = "auto",
    rate_scale: float = 1.0,
    duration: float | None = None,
    skip_bad_lines: bool = False,
) -> tuple[Iterator[Request], TraceStats]:
    """Open a trace: validates the arguments, the file and the format now (raising :class:`UserError`),
    and returns a lazy stream of requests plus the :class:`TraceStats` it updates as it is consumed.

    ``fmt``: ``"auto"`` or one of ``TRACE_FORMATS``; ``rate_scale`` > 0 divides arrivals (2.0 = twice the
    request rate); ``duration``: seconds of (scaled) trace to keep, None for all."""
    _check_scaling(rate_scale, duration)
    p = _existing(path)
    if fmt == "auto":
        fmt = detect_format(p)
    elif fmt not in _PARSERS:
        raise UserError(f"unknown trace format {fmt!r}; choose auto or one of {', '.join(TRACE_FORMATS)}")
    stats = TraceStats(fmt=fmt)
    return read_trace(p, fmt, stats, rate_scale, duration, skip_bad_lines), stats
