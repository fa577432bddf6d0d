"""Trace readers: formats, detection, scaling, bad lines; the real traces only when ../shared exists."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.errors import TraceError, UserError
from kvroute.workloads.traces import TRACE_FORMATS, detect_format, open_trace

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
MOONCAKE = SHARED / "traces" / "mooncake" / "conversation_trace.jsonl"
AZURE_CODE = SHARED / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv"
needs_shared = pytest.mark.skipif(not MOONCAKE.is_file(), reason=f"shared traces not found at {SHARED}")


def write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake_rows() -> list[object]:
    return [
        {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1024, "output_length": 0, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 100, "output_length": 5, "hash_ids": [3]},
    ]


def test_mooncake_full_blocks_ms_and_output_clamp(tmp_path: Path) -> None:
    reqs, stats = open_trace(write_jsonl(tmp_path / "m.jsonl", mooncake_rows()))
    out = list(reqs)
    assert stats.fmt == "mooncake" and stats.requests == 3
    assert [r.arrival for r in out] == [0.0, 0.5, 2.0]
    assert [r.block_ids for r in out] == [(0, 1), (0, 1), ()]
    assert all(r.block_size == 512 for r in out)
    assert out[1].output_len == 1  # clamped from 0
    assert [r.req_id for r in out] == [0, 1, 2]


def test_rate_scale_and_duration(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "m.jsonl", mooncake_rows())
    reqs, _ = open_trace(path, rate_scale=2.0)
    assert [r.arrival for r in reqs] == [0.0, 0.25, 1.0]
    reqs, stats = open_trace(path, rate_scale=2.0, duration=1.0)
    assert [r.arrival for r in reqs] == [0.0, 0.25]
    assert stats.requests == 2


@pytest.mark.parametrize("kwargs", [{"rate_scale": 0.0}, {"rate_scale": -1.0}, {"duration": 0.0}])
def test_bad_scaling_is_user_error(tmp_path: Path, kwargs: dict[str, float]) -> None:
    with pytest.raises(UserError):
        open_trace(write_jsonl(tmp_path / "m.jsonl", mooncake_rows()), **kwargs)  # type: ignore[arg-type]


def test_missing_file_and_unknown_format(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not found"):
        open_trace(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="unknown trace format"):
        open_trace(write_jsonl(tmp_path / "m.jsonl", mooncake_rows()), fmt="parquet")


def test_bad_line_raises_with_file_and_line(tmp_path: Path) -> None:
    rows = mooncake_rows()
    rows.insert(1, "{not json")
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    reqs, _ = open_trace(path)
    with pytest.raises(TraceError) as info:
        list(reqs)
    assert info.value.line == 2 and info.value.path == str(path)
    assert str(info.value).startswith(f"{path}:2: invalid JSON")


def test_skip_bad_lines_counts(tmp_path: Path) -> None:
    rows = mooncake_rows()
    rows[1:1] = [
        "[1, 2]",
        {"timestamp": 100, "input_length": 1024, "output_length": 3, "hash_ids": [0]},  # too few ids
        {"timestamp": 100, "output_length": 3, "hash_ids": [0]},  # missing input_length
    ]
    rows.append({"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [9]})  # backwards
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    reqs, stats = open_trace(path, fmt="mooncake", skip_bad_lines=True)
    assert len(list(reqs)) == 3
    assert stats.bad_lines == 4 and stats.lines == 7
    assert stats.first_bad is not None and stats.first_bad.startswith(f"{path}:2:")
    reqs, _ = open_trace(path, fmt="mooncake")
    with pytest.raises(TraceError, match="expected a JSON object"):
        list(reqs)


def test_backwards_timestamp_is_an_error(tmp_path: Path) -> None:
    rows = mooncake_rows()
    rows.append({"timestamp": 1000, "input_length": 10, "output_length": 3, "hash_ids": [9]})
    reqs, _ = open_trace(write_jsonl(tmp_path / "m.jsonl", rows))
    with pytest.raises(TraceError, match="backwards") as info:
        list(reqs)
    assert info.value.line == 4


def test_bailian_sessions_classes_and_blocks(tmp_path: Path) -> None:
    def row(chat: int, parent: int, ts: float, n: int, kind: str, turn: int) -> dict[str, object]:
        ids = list(range(chat * 100, chat * 100 + (n + 15) // 16))
        return {
            "chat_id": chat,
            "parent_chat_id": parent,
            "timestamp": ts,
            "input_length": n,
            "output_length": 7,
            "type": kind,
            "turn": turn,
            "hash_ids": ids,
        }

    rows = [
        row(1, -1, 10.0, 40, "text", 1),
        row(2, 1, 11.5, 70, "text", 2),
        row(3, -1, 12.0, 16, "search", 1),
        row(4, 2, 13.0, 90, "text", 3),
    ]
    reqs, stats = open_trace(write_jsonl(tmp_path / "b.jsonl", rows))
    out = list(reqs)
    assert stats.fmt == "bailian"
    assert [r.session for r in out] == [1, 1, 3, 1]
    assert [r.req_class for r in out] == ["text", "text", "search", "text"]
    assert [r.arrival for r in out] == [0.0, 1.5, 2.0, 3.0]
    assert all(r.block_size == 16 and len(r.block_ids) == r.prompt_len // 16 for r in out)
    assert out[1].block_ids == (200, 201, 202, 203)


def test_azure_csv_unique_blocks(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,40,10\n2023-11-16 18:17:04.4799600,33,0\n2023-11-16 18:17:05,5,2"
    )
    reqs, stats = open_trace(path)
    out = list(reqs)
    assert stats.fmt == "azure"
    assert [round(r.arrival, 6) for r in out] == [0.0, 0.5, 1.02004]
    assert [r.block_ids for r in out] == [(0, 1), (2, 3), ()]
    assert out[1].output_len == 1


def test_vllm_bench(tmp_path: Path) -> None:
    rows = [
        {"request_id": f"bench-{i}", "input_toks": 20 + i, "output_toks": 5, "arrival_time": 1777142838.5 + i}
        for i in range(3)
    ]
    reqs, stats = open_trace(write_jsonl(tmp_path / "requests.jsonl", rows))
    out = list(reqs)
    assert stats.fmt == "vllm-bench"
    assert [r.arrival for r in out] == [0.0, 1.0, 2.0]
    assert [len(r.block_ids) for r in out] == [1, 1, 1] and len({r.block_ids for r in out}) == 3


def test_generic_jsonl_token_ids_share_prefix(tmp_path: Path) -> None:
    pytest.importorskip("kvroute.blocks")
    base = list(range(1000, 1040))
    rows = [
        {
            "timestamp": 1.0,
            "prompt_token_ids": base,
            "output_len": 4,
            "session": 7,
            "user": "u",
            "class": "c",
        },
        {"timestamp": 1.5, "prompt_token_ids": [*base[:32], 1, 2, 3, 4], "output_len": 0},
        {"timestamp": 2.0, "prompt_token_ids": [5, *base[1:]], "output_len": 4},
    ]
    reqs, stats = open_trace(write_jsonl(tmp_path / "g.jsonl", rows))
    a, b, c = list(reqs)
    assert stats.fmt == "jsonl"
    assert (a.session, a.user, a.req_class, b.output_len) == (7, "u", "c", 1)
    assert len(a.block_ids) == 2 and a.block_ids == b.block_ids  # same 32 leading tokens
    assert c.block_ids[0] != a.block_ids[0]
    assert [a.arrival, b.arrival] == [0.0, 0.5]


def test_generic_jsonl_text_prompt(tmp_path: Path) -> None:
    pytest.importorskip("kvroute.blocks")
    text = "The quick brown fox jumps over the lazy dog. " * 20
    rows = [
        {"timestamp": 0, "prompt": text, "output_len": 3},
        {"timestamp": 1, "messages": [{"role": "user", "content": text}], "output_len": 3},
    ]
    reqs, _ = open_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    a, b = list(reqs)
    assert a.prompt_len > 100 and len(a.block_ids) == a.prompt_len // 16
    assert b.prompt_len > a.prompt_len  # ChatML wrapping adds tokens


def test_generic_jsonl_needs_one_prompt_field(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "prompt_token_ids": [1], "prompt": "x", "output_len": 3}]
    reqs, _ = open_trace(write_jsonl(tmp_path / "g.jsonl", rows), fmt="jsonl")
    with pytest.raises(TraceError, match="exactly one of"):
        list(reqs)


def test_detect_format(tmp_path: Path) -> None:
    assert detect_format(write_jsonl(tmp_path / "m.jsonl", ["", "garbage", *mooncake_rows()])) == "mooncake"
    with pytest.raises(UserError, match="cannot detect"):
        detect_format(write_jsonl(tmp_path / "x.jsonl", [{"a": 1}]))
    with pytest.raises(UserError, match="no valid line"):
        detect_format(write_jsonl(tmp_path / "e.jsonl", ["", "nope"]))
    assert set(TRACE_FORMATS) == {"mooncake", "bailian", "azure", "vllm-bench", "jsonl", "kvroute"}


@needs_shared
def test_real_mooncake_conversation() -> None:
    reqs, stats = open_trace(MOONCAKE, duration=600.0)
    out = list(reqs)
    assert stats.fmt == "mooncake" and stats.bad_lines == 0
    assert 1500 < len(out) < 2500  # ~3.4 req/s over 600 s
    assert all(r.block_ids[:1] == (0,) for r in out if r.prompt_len >= 512)  # shared system prompt block
    assert all(len(r.block_ids) == r.prompt_len // 512 for r in out)


@needs_shared
def test_real_azure_code() -> None:
    reqs, stats = open_trace(AZURE_CODE)
    n = sum(1 for _ in reqs)
    assert n == 8819 and stats.fmt == "azure"
