"""The admin journal that the workers of one machine share (no sockets: a file in a temp folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvroute.server.sync.journal import AdminJournal


def test_each_process_sees_the_others_changes_in_order_not_its_own(tmp_path: Path) -> None:
    path = str(tmp_path / "j.jsonl")
    a, b = AdminJournal(path), AdminJournal(path)
    assert a.read_new() == []  # no file yet
    a.append("add", "http://x:1", {"url": "http://x:1", "kv_events": None})
    b.append("drain", "http://y:1")
    a.append("delete", "http://x:1")
    assert [(x["op"], x["url"]) for x in b.read_new()] == [("add", "http://x:1"), ("delete", "http://x:1")]
    assert [(x["op"], x["url"]) for x in a.read_new()] == [("drain", "http://y:1")]
    assert a.read_new() == [] and b.read_new() == []
    late = AdminJournal(path)  # a worker (re)started later replays everything
    assert [x["op"] for x in late.read_new()] == ["add", "drain", "delete"]


def test_partial_and_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    reader = AdminJournal(str(path))
    path.write_bytes(b'{"by": "w", "op": "drain", "url": "http://a:1"}\n{"by": "w", "op": "und')
    assert [x["op"] for x in reader.read_new()] == ["drain"]  # the half-written line waits
    with path.open("ab") as f:
        f.write(b'rain", "url": "http://a:1"}\nnot json\n[1, 2]\n')
    assert [x["op"] for x in reader.read_new()] == ["undrain"]
    assert reader.bad_lines == 2


def test_catch_up_applies_each_line_once_and_survives_a_failing_one(tmp_path: Path) -> None:
    path = str(tmp_path / "j.jsonl")
    writer, reader = AdminJournal(path), AdminJournal(path)
    for url in ("http://a:1", "http://bad:1", "http://c:1"):
        writer.append("drain", url)
    done: list[str] = []

    def apply(line: dict[str, Any]) -> None:
        if "bad" in line["url"]:
            raise ValueError("no such backend")
        done.append(line["url"])

    assert reader.catch_up(apply) == 2
    assert done == ["http://a:1", "http://c:1"]
    assert reader.catch_up(apply) == 0
