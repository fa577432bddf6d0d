"""The descriptor census (:mod:`benchmarks.fdcensus`) counts what a process opens, by kind and by
peer, and the soak's figures from it (:func:`benchmarks.soak.fd_growth`, :func:`rss_slopes`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from benchmarks.fdcensus import Peers, census, fd_kind
from benchmarks.soak import fd_growth, rss_slopes

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_kinds_from_link_targets() -> None:
    assert fd_kind("socket:[123]") == "socket"
    assert fd_kind("pipe:[9]") == "pipe"
    assert fd_kind("anon_inode:[eventfd]") == "eventfd"
    assert fd_kind("anon_inode:[eventpoll]") == "epoll"
    assert fd_kind("anon_inode:[timerfd]") == "anon_inode"
    assert fd_kind("/dev/shm/x") == "file"
    assert fd_kind("net:[4026531840]") == "other"


# A child that opens exactly what the census test names, one step per line read: the census reads
# its /proc, so that no thread of the test process (which holds many) can open or close a
# descriptor between two censuses.
CHILD = """
import os, socket, sys
server = socket.create_server(("127.0.0.1", 0))
engine = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], engine.getsockname()[1], flush=True)
sys.stdin.readline()
r, w = os.pipe()
client = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
accepted, _ = server.accept()
upstream = socket.create_connection(("127.0.0.1", engine.getsockname()[1]))
a, b = socket.socketpair()
print("opened", flush=True)
sys.stdin.readline()
for s in (client, accepted, upstream, a, b, server, engine):
    s.close()
os.close(r)
os.close(w)
print("closed", flush=True)
sys.stdin.readline()
"""


@linux
def test_census_counts_what_a_process_opens_and_names_the_peers() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None

    def step(expect: str) -> None:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == expect

    try:
        port, engine_port = map(int, child.stdout.readline().split())
        peers = Peers(frozenset({port}), {engine_port: "engine0"})
        before = census(child.pid, peers)
        step("opened")
        after = census(child.pid, peers)
        assert after.fds == before.fds + 7
        assert after.by_kind["pipe"] == before.by_kind.get("pipe", 0) + 2
        grew = {k: after.by_peer.get(k, 0) - before.by_peer.get(k, 0) for k in after.by_peer}
        # accepted on the router's port: a client; our side of it: an unknown port's peer; the
        # engine's port: engine0; the socket pair: unix; both servers: listen
        assert grew["client"] == 1 and grew["tcp:other"] == 1 and grew["engine0"] == 1 and grew["unix"] == 2
        assert after.by_peer["listen"] == before.by_peer["listen"] == 2
        assert after.rss_mib > 0 and after.threads >= 1
        step("closed")
        assert census(child.pid, peers).fds == before.fds - 2  # the two listening sockets closed too
    finally:
        child.kill()
        child.communicate()


def test_census_of_a_process_that_is_gone_is_empty() -> None:
    c = census(2**22 + 12345)  # above Linux's default pid_max
    assert c.fds == 0 and c.by_kind == {} and c.rss_mib == 0.0


def _proc(fds: int, peers: dict[str, int]) -> dict[str, object]:
    return {"fds": fds, "by_kind": {}, "by_peer": peers, "rss_mib": 1.0, "threads": 1}


def test_fd_growth_compares_each_process_with_its_own_start() -> None:
    phases = [
        {"phase": "start", "replicas": {"A": {"processes": {"worker1": _proc(50, {"engine0": 2})}}}},
        {
            "phase": "replica B restarted",
            "replicas": {"B": {"processes": {"worker1": _proc(40, {"engine0": 1})}}},
        },
        {
            "phase": "end",
            "replicas": {
                "A": {"processes": {"worker1": _proc(57, {"engine0": 6})}},
                "B": {"processes": {"worker1": _proc(44, {"engine0": 1, "unix": 4})}},
            },
        },
    ]
    g = fd_growth(phases)
    assert g["A:worker1"]["growth"] == 7 and g["A:worker1"]["growth_not_pooled"] == 3
    assert g["B:worker1"]["growth"] == 4 and g["B:worker1"]["growth_not_pooled"] == 4


def test_rss_slopes_per_thousand_requests_in_each_half() -> None:
    series = [(0, 100.0), (1000, 110.0), (2000, 120.0), (3000, 121.0), (4000, 122.0)]
    assert rss_slopes(series) == (10.0, 1.0, 4000)
    assert rss_slopes([(0, 1.0)]) == (0.0, 0.0, 0)
