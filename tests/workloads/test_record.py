"""The recorded trace: keyed ids keep sharing and hide content, the file is sorted by arrival whatever order
requests end in, and the trace reader replays it (``--format auto`` detects it; bad lines name file:line)."""

from __future__ import annotations

import io
from pathlib import Path

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.blocks import hash_blocks
from kvroute.errors import TraceError
from kvroute.workloads.record import Keyer, RecordedRequest, TraceRecorder
from kvroute.workloads.traces import detect_format, open_trace


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _recorder(buf: io.BytesIO, clock: _Clock, salt: bytes = b"s" * 32) -> TraceRecorder:
    return TraceRecorder(buf, block_size=16, clock=clock, started_unix=1.7e9, salt=salt)


def _rec(arrival: float, tokens: list[int], output_len: int = 8, **kw: object) -> RecordedRequest:
    return RecordedRequest(
        arrival=arrival,
        prompt_len=len(tokens),
        output_len=output_len,
        block_hashes=tuple(hash_blocks(tokens, 16)),
        model="m",
        **kw,  # type: ignore[arg-type]
    )


def _lines(buf: io.BytesIO) -> list[dict[str, object]]:
    return [orjson.loads(line) for line in buf.getvalue().splitlines()]


def test_keyed_chain_keeps_shared_prefixes_and_hides_the_raw_hashes() -> None:
    system = list(range(64))
    a = _rec(0.0, [*system, *range(1000, 1040)])
    b = _rec(0.0, [*system, *range(2000, 2040)])
    keyer = Keyer(b"k" * 32)
    ka, kb = keyer.blocks(a.block_hashes), keyer.blocks(b.block_hashes)
    assert ka[:4] == kb[:4]  # the 64-token system prompt: 4 shared blocks
    assert ka[4] != kb[4]
    assert not set(ka) & set(a.block_hashes)  # no raw hash survives
    other = Keyer(b"j" * 32).blocks(a.block_hashes)
    assert other[:4] != ka[:4]  # another file's salt: unrelated ids
    assert all(0 <= v < 2**63 for v in ka)


def test_records_are_written_in_arrival_order_when_requests_end_out_of_order() -> None:
    buf, clock = io.BytesIO(), _Clock()
    rec = _recorder(buf, clock)
    t0, a0 = rec.begin()
    clock.t += 0.5
    t1, a1 = rec.begin()
    clock.t += 0.5
    t2, a2 = rec.begin()
    rec.finish(t2, _rec(a2, list(range(40)), session="s2"))
    rec.finish(t1, _rec(a1, list(range(50)), user="alice"))
    assert len(_lines(buf)) == 1  # header only: the first request is still in flight
    rec.finish(t0, _rec(a0, list(range(60)), status=503))
    rec.close()
    header, *rows = _lines(buf)
    assert header["format"] == "kvroute-trace" and header["block_size"] == 16
    assert [r["timestamp"] for r in rows] == [0.0, 0.5, 1.0]
    assert [r["input_length"] for r in rows] == [60, 50, 40]
    assert rows[0]["status"] == 503
    assert rows[1]["user"] != "alice" and len(str(rows[1]["user"])) == 16
    assert isinstance(rows[2]["session"], int)
    assert rec.written == 3


def test_a_request_finished_twice_is_written_once() -> None:
    buf, clock = io.BytesIO(), _Clock()
    rec = _recorder(buf, clock)
    t, a = rec.begin()
    rec.finish(t, _rec(a, list(range(20))))
    rec.finish(t, _rec(a, list(range(20))))
    rec.close()
    assert len(_lines(buf)) == 2


@settings(max_examples=50, deadline=None)
@given(st.permutations(range(8)), st.lists(st.floats(0.0, 2.0), min_size=8, max_size=8))
def test_any_end_order_gives_a_sorted_complete_file(order: list[int], gaps: list[float]) -> None:
    buf, clock = io.BytesIO(), _Clock()
    rec = _recorder(buf, clock)
    begun = []
    for gap in gaps:
        clock.t += gap
        begun.append(rec.begin())
    for i in order:
        ticket, arrival = begun[i]
        rec.finish(ticket, _rec(arrival, list(range(16 + i))))
    rec.close()
    rows = _lines(buf)[1:]
    assert len(rows) == 8
    stamps = [float(r["timestamp"]) for r in rows]  # type: ignore[arg-type]
    assert stamps == sorted(stamps)


def test_the_reader_replays_a_recorded_file(tmp_path: Path) -> None:
    path = tmp_path / "live.jsonl"
    clock = _Clock()
    with path.open("wb") as f:
        rec = _recorder(f, clock)  # type: ignore[arg-type]
        system = list(range(48))
        for turn in range(3):
            ticket, arrival = rec.begin()
            clock.t += 0.25
            tokens = [*system, *range(5000, 5000 + 20 * (turn + 1))]
            rec.finish(ticket, _rec(arrival, tokens, output_len=turn + 2, session="conv-1", user="bob"))
        rec.close()
    assert detect_format(path) == "kvroute"
    requests, stats = open_trace(path)
    got = list(requests)
    assert stats.fmt == "kvroute" and stats.requests == 3 and stats.lines == 4
    assert [r.arrival for r in got] == [0.0, 0.25, 0.5]
    assert [r.output_len for r in got] == [2, 3, 4]
    assert all(r.block_size == 16 for r in got)
    assert [len(r.block_ids) for r in got] == [(48 + 20 * k) // 16 for k in (1, 2, 3)]
    assert got[0].block_ids[:3] == got[2].block_ids[:3]  # the shared system prompt still shows
    assert len({r.session for r in got}) == 1 and got[0].session >= 0
    assert got[0].user == got[1].user


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"timestamp": 0, "input_length": 16, "output_length": 1, "hash_ids": [1]}\n', "header line"),
        ('{"format": "kvroute-trace", "version": 9, "block_size": 16}\n', "unsupported"),
        (
            '{"format": "kvroute-trace", "version": 1, "block_size": 16}\n'
            '{"timestamp": 0, "input_length": 64, "output_length": 1, "hash_ids": [1, 2]}\n',
            "fewer than the 4 full blocks",
        ),
    ],
)
def test_bad_recorded_lines_name_file_and_line(tmp_path: Path, text: str, reason: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    requests, _ = open_trace(path, fmt="kvroute")
    with pytest.raises(TraceError, match=reason) as err:
        list(requests)
    assert str(err.value).startswith(f"{path}:")
