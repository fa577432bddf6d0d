"""Router replicas sharing reservations (kvroute.server.sync.peers): the receiver's state machine under a
fake clock, the publisher's hook on the load table, both over real ZMQ sockets on loopback, the
pick-and-reserve step, and the flags."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.errors import UserError
from kvroute.server.app import RouterServer
from kvroute.server.cluster import free_port
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.state.backends import BackendState, Lease
from kvroute.server.state.loadtable import LoadTable
from kvroute.server.sync.peers import (
    PROTOCOL,
    Bye,
    Delta,
    PeerPublisher,
    PeerReceiver,
    Refresh,
    encode,
    parse_peer_endpoint,
    resolve_peers,
)
from kvroute.tokenizer import Tokenizer

from .fakes import FakeTransport, Scripted

U1, U2 = "http://e1:8000", "http://e2:8000"


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def receiver(expiry_s: float = 3.0) -> tuple[PeerReceiver, LoadTable, Clock]:
    table = LoadTable.local(slots=8)
    clock = Clock()
    return PeerReceiver(table, "me", clock, expiry_s), table, clock


def remote(table: LoadTable, url: str) -> tuple[int, int, int, int]:
    slot = table.slot(url)
    total, local = table.totals(slot), table.totals(slot, remote=False)
    return tuple(a - b for a, b in zip(total, local, strict=True))  # type: ignore[return-value]


def reserve(sender: str, seq: int, url: str = U1, prefill: int = 4000, worker: int = 0) -> list[bytes]:
    return encode(Delta(sender, worker, seq, url, 1, 0, prefill, 250))


def release_waiting(sender: str, seq: int, url: str = U1, prefill: int = 4000) -> list[bytes]:
    return encode(Delta(sender, 0, seq, url, -1, 0, -prefill, -250))


def test_deltas_sum_over_senders_and_workers_and_reach_the_remote_row() -> None:
    rec, table, _ = receiver()
    rec.handle(reserve("a", 1))
    rec.handle(reserve("a", 1, worker=1))  # another worker of replica a: its own sequence
    rec.handle(reserve("b", 7, url=U2, prefill=100))
    assert remote(table, U1) == (2, 0, 8000, 500) and remote(table, U2) == (1, 0, 100, 250)
    rec.handle(encode(Delta("a", 0, 2, U1, -1, 1, -4000, 0)))  # first byte
    assert remote(table, U1) == (1, 1, 4000, 500)
    assert table.totals(table.slot(U1), remote=False) == (0, 0, 0, 0)  # the local rows untouched
    assert len(rec.senders) == 3 and rec.received["delta"] == 4


def test_pending_blocks_travel_in_deltas_and_refreshes_and_default_to_zero() -> None:
    rec, table, _ = receiver()
    slot = table.slot(U1)
    rec.handle(encode(Delta("a", 0, 1, U1, 1, 0, 4000, 250, 250)))  # reserved: its blocks pending
    assert table.pending(slot) == 250 and table.pending(slot, remote=False) == 0
    rec.handle(encode(Delta("a", 0, 2, U1, 0, 0, 0, 0, -250)))  # a's scrape settled it
    assert table.pending(slot) == 0 and remote(table, U1) == (1, 0, 4000, 250)
    rec.handle(reserve("b", 1))  # a sender without the field: no pending blocks
    assert table.pending(slot) == 0 and remote(table, U1) == (2, 0, 8000, 500)
    rec.handle(encode(Refresh("a", 0, 3, [(U1, 2, 0, 10, 20)], {U1: 7})))
    assert table.pending(slot) == 7 and remote(table, U1) == (3, 0, 4010, 270)
    rec.handle(encode(Refresh("a", 0, 4, [(U1, 2, 0, 10, 20)])))  # the same load, none pending now
    assert table.pending(slot) == 0
    rec.handle(encode(Bye("b", 0, 2)))
    rec.handle(encode(Bye("a", 0, 5)))
    assert remote(table, U1) == (0, 0, 0, 0) and table.pending(slot) == 0


def test_own_messages_are_ignored() -> None:
    rec, table, _ = receiver()
    rec.handle(reserve("me", 1))
    rec.handle(reserve("me", 1, worker=3))
    assert remote(table, U1) == (0, 0, 0, 0) and rec.dropped["own"] == 2 and not rec.senders


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([PROTOCOL, b"\xc1garbage"], "malformed"),
        ([PROTOCOL, b"\x93\x01\x02\x03"], "malformed"),  # a valid msgpack array of the wrong shape
        ([PROTOCOL], "malformed"),
        ([PROTOCOL, b"", b""], "malformed"),
        ([b"kvp9", reserve("a", 1)[1]], "version"),
    ],
)
def test_malformed_messages_are_counted_and_dropped(frames: list[bytes], reason: str) -> None:
    rec, table, _ = receiver()
    rec.handle(frames)
    assert rec.dropped[reason] == 1 and not rec.senders
    rec.handle(reserve("a", 1))  # still works
    assert remote(table, U1)[0] == 1


def test_a_lost_release_is_healed_by_the_next_refresh_and_gaps_are_counted() -> None:
    rec, table, _ = receiver()
    rec.handle(reserve("a", 1))
    rec.handle(reserve("a", 2))
    # seq 3 (the release of one of them) is lost on the way
    rec.handle(reserve("a", 4, url=U2, prefill=10))
    assert rec.dropped["lost"] == 1 and remote(table, U1)[0] == 2
    rec.handle(encode(Refresh("a", 0, 5, [(U1, 1, 0, 4000, 250), (U2, 1, 0, 10, 250)])))
    assert remote(table, U1) == (1, 0, 4000, 250) and remote(table, U2) == (1, 0, 10, 250)
    rec.handle(encode(Refresh("a", 0, 6, [])))  # nothing in flight any more
    assert remote(table, U1) == (0, 0, 0, 0) and remote(table, U2) == (0, 0, 0, 0)
    rec.handle(reserve("a", 6))  # a replayed / old sequence number
    assert rec.dropped["stale"] == 1 and remote(table, U1) == (0, 0, 0, 0)


def test_a_lost_reserve_never_drives_the_remote_row_negative() -> None:
    rec, table, _ = receiver()
    rec.handle(release_waiting("a", 2))  # its reserve (seq 1) was lost: the sender starts mid-stream
    assert remote(table, U1) == (0, 0, 0, 0)
    rec.handle(encode(Refresh("a", 0, 3, [])))
    rec.handle(reserve("a", 4))
    assert remote(table, U1) == (1, 0, 4000, 250)


def test_a_silent_sender_expires_within_expiry_plus_a_sweep() -> None:
    rec, table, clock = receiver(expiry_s=3.0)
    rec.handle(reserve("a", 1))
    rec.handle(reserve("b", 1))
    clock.t += 2.0
    rec.handle(encode(Refresh("b", 0, 2, [(U1, 1, 0, 4000, 250)])))  # b is alive, a silent
    clock.t += 1.0
    assert rec.sweep() == 0 and remote(table, U1)[0] == 2  # a: exactly 3 s, not yet
    clock.t += rec.sweep_s
    assert rec.sweep() == 1 and remote(table, U1) == (1, 0, 4000, 250)
    assert set(rec.senders) == {("b", 0)} and rec.expired == 1
    clock.t += 3.0 + rec.sweep_s
    assert rec.sweep() == 1 and remote(table, U1) == (0, 0, 0, 0) and not rec.senders


def test_bye_drops_the_sender_at_once() -> None:
    rec, table, _ = receiver()
    rec.handle(reserve("a", 1))
    rec.handle(encode(Bye("a", 0, 2)))
    assert remote(table, U1) == (0, 0, 0, 0) and not rec.senders and rec.received["bye"] == 1


def test_a_url_the_table_cannot_hold_is_dropped() -> None:
    rec, table, _ = receiver()
    for i in range(8):
        rec.handle(reserve("a", i + 1, url=f"http://e{i}:1"))
    rec.handle(reserve("a", 9, url="http://one-too-many:1"))
    assert rec.dropped["bad_url"] == 1 and remote(table, "http://e7:1")[0] == 1


def test_publisher_announces_each_lease_step_and_refreshes_its_row() -> None:
    table = LoadTable.local(slots=8)
    sent: list[object] = []
    pub = PeerPublisher(table, "a", refresh_s=1.0)
    try:
        pub._send = lambda msg, kind: sent.append((kind, msg))  # type: ignore[method-assign]
        pub.install()
        backend = BackendState(0, U1, table)
        lease = Lease(backend, 4000, 250)
        lease.adjust(3000)
        lease.first_byte()
        other = Lease(BackendState(1, U2, table), 10, 1)
        pub.refresh()
        lease.release()
        other.release()
        kinds = [k for k, _ in sent]
        assert kinds == ["reserve", "adjust", "start", "reserve", "refresh", "release", "release"]
        deltas = [m for _, m in sent if isinstance(m, Delta)]
        assert [m.seq for _, m in sent] == [1, 2, 3, 4, 5, 6, 7]
        assert (deltas[0].url, deltas[0].waiting, deltas[0].prefill, deltas[0].blocks) == (U1, 1, 4000, 250)
        # its blocks are pending from the reservation to the start (first byte)
        assert (deltas[0].pending, deltas[1].pending, deltas[2].pending) == (250, 0, -250)
        refresh = sent[4][1]
        assert isinstance(refresh, Refresh)
        assert refresh.rows == [(U1, 0, 1, 0, 250), (U2, 1, 0, 10, 1)]
        assert refresh.pending == {U2: 1}  # the started one has none pending
    finally:
        pub.close()
    assert table.announce is None


async def test_publisher_to_receiver_over_zmq() -> None:
    """Two tables (two machines), a Lease on one shows in the other's remote row; the other's own
    publisher, connected to its own receiver too (a shared --peers list), is ignored."""
    bind_b = f"tcp://127.0.0.1:{free_port()}"
    table_a, table_b = LoadTable.local(slots=8), LoadTable.local(slots=8)
    pub_a = PeerPublisher(table_a, "a", refresh_s=0.05)
    pub_b = PeerPublisher(table_b, "b", refresh_s=0.05)
    rec_b = PeerReceiver(
        table_b, "b", asyncio.get_running_loop().time, expiry_s=60.0
    )  # the bye path, not expiry: a loaded machine may stall past a short expiry
    rec_b.bind(bind_b)
    tasks = [asyncio.create_task(rec_b.run())]
    try:
        for pub in (pub_a, pub_b):
            pub.install()
            tasks.append(asyncio.create_task(pub.run((bind_b,), set())))
        lease = Lease(BackendState(0, U1, table_a), 4000, 250)
        Lease(BackendState(0, U1, table_b), 1, 1)  # b's own: not in b's remote row
        slot = table_b.slot(U1)
        for _ in range(1500):  # the slow joiner: the refresh delivers it within refresh_s
            if remote(table_b, U1) == (1, 0, 4000, 250):
                break
            await asyncio.sleep(0.02)
        assert remote(table_b, U1) == (1, 0, 4000, 250)
        assert table_b.totals(slot) == (2, 0, 4001, 251)
        assert table_b.pending(slot) == 251 and table_b.pending(slot, remote=False) == 1
        lease.release()
        for _ in range(1500):  # up to ~30 s on a loaded machine
            if remote(table_b, U1) == (0, 0, 0, 0):
                break
            await asyncio.sleep(0.02)
        assert remote(table_b, U1) == (0, 0, 0, 0)
        assert rec_b.dropped["own"] > 0 and set(rec_b.senders) == {("a", 0)}
        Lease(BackendState(0, U1, table_a), 7, 1)  # in flight when a says bye
        await asyncio.sleep(0.1)
        pub_a.close()
        for _ in range(1500):  # up to ~30 s on a loaded machine
            if not rec_b.senders:
                break
            await asyncio.sleep(0.02)
        assert not rec_b.senders and rec_b.expired == 0 and remote(table_b, U1) == (0, 0, 0, 0)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pub_a.close()
        pub_b.close()
        rec_b.close()


async def test_pick_and_reservation_are_one_step(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the routing decision (the decide stage) and the Lease (and so its announcement) the
    handler never yields to the event loop: a callback queued at the decision already sees the lease."""
    from kvroute.server import pipeline

    t = FakeTransport({U1: [Scripted()], U2: [Scripted()]})
    # the decide stage (without the router-side queue, whose wait stage decides and takes its hold
    # in one call, WaitingRoom._commit)
    cfg = RouterConfig(backends=(BackendSpec(U1), BackendSpec(U2)), port=0, router_queue=None)
    server = RouterServer(cfg, transport=t, tokenizer=tokenizer, background=False)
    await server.start()
    seen: list[int] = []
    core = server.state
    decide = pipeline.decide

    def spying_decide(*args: object, **kw: object):  # type: ignore[no-untyped-def]
        out = decide(*args, **kw)  # type: ignore[arg-type]
        chosen = core.backends[out.order[0]]
        asyncio.get_running_loop().call_soon(lambda: seen.append(chosen.waiting + chosen.running))
        return out

    monkeypatch.setattr(pipeline, "decide", spying_decide)
    try:
        import aiohttp

        body = {"model": "m", "prompt": "hello world " * 20, "max_tokens": 2, "stream": True}
        async with aiohttp.ClientSession() as s:
            for _ in range(3):
                async with s.post(server.url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()
        assert seen == [1, 1, 1]
    finally:
        await server.stop()


def test_endpoints_parse() -> None:
    assert parse_peer_endpoint("tcp://10.0.0.1:5600") == ("tcp", "10.0.0.1", 5600)
    assert parse_peer_endpoint("dns://kvroute-peers.ns.svc:5600") == ("dns", "kvroute-peers.ns.svc", 5600)
    assert parse_peer_endpoint("tcp://[::1]:5600") == ("tcp", "::1", 5600)
    for bad in ("10.0.0.1:5600", "udp://h:1", "tcp://h", "tcp://h:0", "tcp://h:x", "tcp://:5"):
        with pytest.raises(UserError):
            parse_peer_endpoint(bad)
    with pytest.raises(UserError):
        parse_peer_endpoint("dns://h:1", dns=False)


async def test_resolve_leaves_out_this_machine() -> None:
    own = {("127.0.0.1", 5600)}
    got = await resolve_peers(("tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601", "dns://localhost:5600"), own)
    assert got is not None and "tcp://127.0.0.1:5601" in got and "tcp://127.0.0.1:5600" not in got
    got = await resolve_peers(("dns://localhost:5602",), own)
    assert got is not None and "tcp://127.0.0.1:5602" in got


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--peers", "10.0.0.1:5600"], "expected tcp://HOST:PORT or dns://NAME:PORT"),
        (["--peer-bind", "dns://x:5600"], "expected tcp://HOST:PORT"),
        (["--peer-bind", "tcp://0.0.0.0:0"], "port must be in 1..65535"),
        (["--peers", "tcp://a:1", "--peer-expiry", "1", "--peer-refresh", "1"], "must be longer than"),
        (["--peers", "tcp://a:1", "--peer-refresh", "0"], "peer_refresh_s=0.0 must be > 0"),
        (["--peer-expiry", "x"], "invalid number of seconds 'x'"),
    ],
)
def test_bad_peer_flags(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--backend", "http://a:1", *argv]) == 2
    *usage, last = capsys.readouterr().err.splitlines()  # a bad flag: argparse's usage block first
    assert needle in last and "Traceback" not in "".join(usage)
    assert not usage or usage[0].startswith("usage: kvroute serve ")


def test_peer_config_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.commands.settings import load_config_file

    path = tmp_path / "r.yaml"
    path.write_text(
        "backends: [http://a:1]\npeer_bind: tcp://0.0.0.0:5600\npeers: [dns://kvroute:5600]\n"
        "peer_expiry_s: 5\npeer_refresh_s: 0.5\n"
    )
    cfg = load_config_file(path).validate()
    assert (cfg.peer_bind, cfg.peers, cfg.peer_expiry_s, cfg.peer_refresh_s) == (
        "tcp://0.0.0.0:5600",
        ("dns://kvroute:5600",),
        5.0,
        0.5,
    )
    path.write_text("backends: [http://a:1]\npeers: tcp://a:1\n")
    assert main(["serve", "--config", str(path)]) == 2
    assert "'peers' must be a list" in capsys.readouterr().err
