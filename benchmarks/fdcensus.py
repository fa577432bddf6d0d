"""What a process holds open, by kind and by peer: the soak's and the leak tests' descriptor census.

:func:`census` reads ``/proc/PID/fd`` (each link's target: ``socket:[inode]``, ``pipe:[inode]``,
``anon_inode:[eventfd]``/``[eventpoll]``/..., a file path) and, for the sockets, psutil's view of the
same process's connections (psutil maps each socket inode to ``/proc/net/tcp``, ``tcp6``, ``udp`` and
``unix``: addresses, state, the descriptor). :class:`Peers` names the other end of each TCP socket from
the ports the caller knows: ``client`` (accepted on the router's port), ``listen``, ``engine0`` (an
engine's HTTP port), ``zmq:engine0`` (its KV event publisher or replay endpoint), ``peer`` (the
replicas' shared-reservation channel), ``tcp:other``; unix sockets are ``unix`` (the multiprocessing
pipes between a supervisor and its workers are unix socket pairs or pipes).

Linux only (``/proc``); a process that is gone gives an empty census. Reading another process's
descriptors needs the same user (the soak's processes are its own children).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

__all__ = ["Census", "Peers", "census", "fd_kind"]


def fd_kind(target: str) -> str:
    """``socket``, ``pipe``, ``eventfd``, ``epoll``, ``anon_inode`` (others: timerfd, signalfd, ...),
    ``file`` (a path; ``/dev/shm`` and ``/dev/*`` included) or ``other``, from a ``/proc/PID/fd``
    link's target."""
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("anon_inode:"):
        name = target.removeprefix("anon_inode:").strip("[]")
        return {"eventfd": "eventfd", "eventpoll": "epoll"}.get(name, "anon_inode")
    if target.startswith("/"):
        return "file"
    return "other"


@dataclass(frozen=True, slots=True)
class Peers:
    """Ports the caller knows, to name a TCP socket's other end: ``listen_ports`` (the router's
    client port: a socket bound to it is ``listen`` or ``client``), ``engines`` (HTTP port → engine
    name), ``zmq`` (KV event publisher and replay ports → engine name), ``peer_ports`` (the replicas'
    ``--peer-bind`` ports)."""

    listen_ports: frozenset[int] = frozenset()
    engines: dict[int, str] = field(default_factory=dict)
    zmq: dict[int, str] = field(default_factory=dict)
    peer_ports: frozenset[int] = frozenset()

    def name(self, status: str, local: int, remote: int | None) -> str:
        """The peer of a TCP socket with ``local`` and ``remote`` ports (``remote`` None: none)."""
        if local in self.peer_ports or (remote is not None and remote in self.peer_ports):
            return "peer"
        if local in self.listen_ports:
            return "listen" if status == psutil.CONN_LISTEN else "client"
        if remote is None:
            return "listen" if status == psutil.CONN_LISTEN else "tcp:unconnected"
        if remote in self.engines:
            return self.engines[remote]
        if remote in self.zmq:
            return f"zmq:{self.zmq[remote]}"
        return "tcp:other"


@dataclass(frozen=True, slots=True)
class Census:
    """One process's open descriptors at one moment: ``fds`` in all, ``by_kind`` (:func:`fd_kind`),
    ``by_peer`` (sockets only, :meth:`Peers.name`; ``unix``, ``udp``, ``unknown`` for a socket psutil
    did not list), ``rss_mib`` (resident set, MiB), ``threads``. Empty (``fds == 0``) when the process
    is gone."""

    pid: int
    fds: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    by_peer: dict[str, int] = field(default_factory=dict)
    rss_mib: float = 0.0
    threads: int = 0

    def as_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "fds": self.fds,
            "by_kind": dict(sorted(self.by_kind.items())),
            "by_peer": dict(sorted(self.by_peer.items())),
            "rss_mib": round(self.rss_mib, 1),
            "threads": self.threads,
        }


def _targets(pid: int) -> dict[int, str]:
    """Descriptor → its link target (descriptors closed while reading are skipped)."""
    out: dict[int, str] = {}
    base = Path(f"/proc/{pid}/fd")
    for entry in os.listdir(base):
        with contextlib.suppress(FileNotFoundError):
            out[int(entry)] = os.readlink(base / entry)
    return out


def census(pid: int, peers: Peers | None = None) -> Census:
    """The census of process ``pid`` now (module docstring)."""
    peers = peers or Peers()
    try:
        proc = psutil.Process(pid)
        targets = _targets(pid)
        conns = proc.net_connections(kind="all")
        mem = proc.memory_info().rss / (1 << 20)
        threads = proc.num_threads()
    except (psutil.NoSuchProcess, psutil.ZombieProcess, FileNotFoundError, ProcessLookupError):
        return Census(pid)
    by_fd: dict[int, str] = {}
    for c in conns:
        if c.fd < 0:
            continue
        if c.family == socket.AF_UNIX:
            by_fd[c.fd] = "unix"
        elif c.type == socket.SOCK_DGRAM:
            by_fd[c.fd] = "udp"
        else:
            local = c.laddr.port if c.laddr else 0
            remote = c.raddr.port if c.raddr else None
            by_fd[c.fd] = peers.name(c.status, local, remote)
    kinds: Counter[str] = Counter()
    peer_counts: Counter[str] = Counter()
    for fd, target in targets.items():
        kind = fd_kind(target)
        kinds[kind] += 1
        if kind == "socket":
            peer_counts[by_fd.get(fd, "unknown")] += 1
    return Census(pid, len(targets), dict(kinds), dict(peer_counts), mem, threads)
