"""The in-flight load table: slots by URL, rows per writer, a shared table across real processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.server.state.loadtable import LoadTable, SharedTableSpec


def test_slots_are_assigned_by_url_and_stable() -> None:
    t = LoadTable.local(4)
    a, b = t.slot("http://a:1"), t.slot("http://b:1")
    assert (a, b) == (0, 1)
    assert t.slot("http://a:1") == a
    assert t.url_of(b) == "http://b:1" and t.url_of(3) == ""
    t.slot("http://c:1")
    t.slot("http://d:1")
    with pytest.raises(ValueError, match="full"):
        t.slot("http://e:1")
    with pytest.raises(ValueError):
        t.slot("")


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(-5, 5), st.integers(-5, 5)), max_size=50))
def test_totals_are_the_sum_of_the_deltas_plus_the_remote_row(ops: list[tuple[int, int, int]]) -> None:
    t = LoadTable.local(4)
    for url in "abcd":
        t.slot(url)
    want = [[0, 0, 0, 0] for _ in range(4)]
    for slot, w, p in ops:
        t.add(slot, waiting=w, prefill=p, blocks=w + p)
        want[slot][0] += w
        want[slot][2] += p
        want[slot][3] += w + p
    for slot in range(4):
        assert list(t.own(slot)) == want[slot]
        assert t.totals(slot) == t.own(slot)
    t.set_remote(2, 1, 2, 3, 4)
    w, r, p, b = want[2]
    assert t.totals(2) == (w + 1, r + 2, p + 3, b + 4)
    assert list(t.totals(2, remote=False)) == want[2]


def _worker(spec: SharedTableSpec, writer: int, lock: object, urls: list[str], n: int) -> None:
    table = LoadTable.attach(spec, writer, lock)
    for _ in range(n):
        for url in urls:
            table.add(table.slot(url), waiting=1, prefill=10)
    table.close()


def test_a_shared_table_sums_real_worker_processes_and_agrees_on_slots() -> None:
    ctx = mp.get_context("spawn")
    lock = ctx.Lock()
    parent, spec = LoadTable.create_shared(3, lock, slots=8)
    try:
        procs = [
            ctx.Process(target=_worker, args=(spec, 1, lock, ["http://x", "http://y"], 50)),
            ctx.Process(target=_worker, args=(spec, 2, lock, ["http://y", "http://x"], 30)),
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        x, y = parent.slot("http://x"), parent.slot("http://y")
        assert {x, y} == {0, 1}
        assert parent.totals(x) == (80, 0, 800, 0)
        assert parent.totals(y) == (80, 0, 800, 0)
        assert parent.own(x) == (0, 0, 0, 0)
    finally:
        parent.close(unlink=True)


def test_pending_blocks_of_every_writer_reach_the_view_and_each_writer_settles_its_own() -> None:
    """Two workers of a machine over one shared table (and a peer replica's announced load): a view
    sums every writer's pending blocks; a scrape recorded by the scraper settles a worker's leases
    when that worker settles (its next view, or its scrape loop), so until then another worker's
    view still counts them: the approximation the backends module states."""
    from kvroute.server.state.backends import BackendState, Lease, ScrapedMetrics

    lock = mp.get_context("spawn").Lock()
    parent, spec = LoadTable.create_shared(2, lock, slots=8)
    other = LoadTable.attach(spec, 1, lock)
    try:
        a, b = BackendState(0, "http://e", parent), BackendState(0, "http://e", other)
        mine = Lease(a, 100, blocks=7, at=1.0)
        theirs = Lease(b, 50, blocks=3, at=1.1)
        parent.set_remote(a.slot, 1, 0, 10, 5, 5)  # a peer's request, pending at the peer
        a.scraped = ScrapedMetrics(running=0, waiting=0, kv_usage=0.0, at=0.5, num_kv_blocks=100)
        assert a.view(1.2, 10.0).decode_blocks == b.view(1.2, 10.0).decode_blocks == 7 + 3 + 5
        a.scraped = ScrapedMetrics(running=0, waiting=2, kv_usage=0.0, at=1.15, num_kv_blocks=100)
        assert a.view(1.2, 10.0).decode_blocks == 3 + 5  # a settled its own lease; b has not yet
        assert (mine.pending, theirs.pending) == (False, True)
        b.settle()  # b's scrape loop (or its next view)
        assert a.view(1.2, 10.0).decode_blocks == 5  # the peer's, until it announces its settlement
        parent.set_remote(a.slot, 1, 0, 10, 5, 0)
        assert a.view(1.2, 10.0).decode_blocks == 0
        assert b.view(1.2, 10.0).decode_blocks == 0
        mine.release()
        theirs.release()
        assert (parent.pending(a.slot, remote=False), parent.totals(a.slot, remote=False)) == (
            0,
            (0, 0, 0, 0),
        )
    finally:
        other.close()
        parent.close(unlink=True)
