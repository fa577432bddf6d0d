"""Router replicas on several machines: each announces its in-flight load to the others over ZMQ.

Every replica consumes the engines' KV events and scrapes their ``/metrics`` itself; what the replicas
share is only their *reservations*, the router-side counters of :class:`~kvroute.server.state.loadtable.LoadTable`
(per backend: waiting, running, queued prefill tokens, KV blocks of the requests they routed and
that have not ended, and the *pending* ones among them: routed since that replica's last completed
scrape of the backend began and not started, which each replica settles at its own scrapes, so a
peer's pending blocks leave the others' view when its announcement of the settlement arrives, not at
their own scrapes; :mod:`kvroute.server.state.backends`). Best effort: PUB/SUB, no acknowledgements, state that expires.

**Who does what.** Every process that routes (a router, or each worker of ``kvroute serve --workers
N``) runs a :class:`PeerPublisher` over its own row of the table: a PUB socket *connected* to every
peer's receive endpoint. It is installed as the table's ``announce`` hook, so each change of the row
(a :class:`~kvroute.server.state.backends.Lease` reserving, starting, adjusting or releasing) is published
in the same synchronous step as the local reservation, and every ``refresh_s`` seconds it publishes the
whole row (its *refresh*). Exactly one process per machine runs a :class:`PeerReceiver`: a SUB socket
*bound* at ``--peer-bind``; it keeps each sender's load per backend and writes the sum over senders into
the table's remote row (:meth:`LoadTable.set_remote`), which :meth:`BackendState.view` adds to the
machine's own rows.

**Wire format** (version 1): a two-frame ZMQ message ``[b"kvp1", payload]``; the first frame is the
protocol and version (any other value is counted and dropped), the payload a msgpack array tagged by
its first element (:class:`Delta` = 1, :class:`Refresh` = 2, :class:`Bye` = 3), then ``sender`` (the
replica id: random hex chosen at start, shared by the workers of one machine), ``worker`` (0 for a
single-process router), ``seq`` (per (sender, worker), +1 per message), then the body: a delta names the
backend by URL (slots are per machine) with the change of (waiting, running, prefill tokens, blocks,
pending blocks); a refresh lists ``(url, waiting, running, prefill, blocks)`` for every backend the
sender has load on (an absent URL means zero) and then ``{url: pending blocks}`` (absent: zero); a bye
says the sender is stopping. The pending fields come last and default to zero, so a sender that does
not send them decodes the same (its requests then count no pending blocks).

**Consistency and expiry.** A refresh *replaces* what the receiver holds for its sender, so lost
messages (sequence gaps, counted) are healed by the next refresh, at most ``refresh_s`` later; one
publisher's messages reach one receiver in order (one TCP connection), so a refresh never overtakes
the deltas before it. A sender silent for ``expiry_s`` seconds is dropped with all its load: a dead or
partitioned replica's reservations vanish from the others' view within ``expiry_s`` plus one sweep
(:attr:`PeerReceiver.sweep_s`, at most 0.25 s). A stopping replica says bye and vanishes at once.
Messages from the receiver's own replica id (its own workers, or itself when ``--peers`` lists its own
endpoint) are ignored. Malformed messages are counted and dropped.

Backends must be spelled the same way (the same URL) in every replica's config: they are matched by URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvroute.errors import UserError
from kvroute.server.config import parse_peer_endpoint
from kvroute.server.state.loadtable import COLUMNS, LoadTable

__all__ = [
    "PROTOCOL",
    "Bye",
    "Delta",
    "PeerCollector",
    "PeerLink",
    "PeerPublisher",
    "PeerReceiver",
    "Refresh",
    "decode",
    "encode",
    "new_replica_id",
    "parse_peer_endpoint",
    "resolve_peers",
]

log = logging.getLogger("kvroute.server.sync.peers")

PROTOCOL = b"kvp1"
"""First frame of every message: protocol name and version."""

DNS_INTERVAL_S = 5.0
"""Seconds between resolutions of ``dns://`` peers (a headless Service lists the router pods)."""

SNDHWM = 10000
"""Messages queued per peer before the publisher drops (a slow or unreachable peer)."""

DELTA_KINDS = ("reserve", "start", "adjust", "release")


# ------------------------------------------------------------------------------------ wire format


class Delta(msgspec.Struct, array_like=True, frozen=True, tag=1):
    """A change of the sender's load on backend ``url``: requests ``waiting``, ``running``, queued
    ``prefill`` tokens, KV ``blocks``, ``pending`` blocks (each a signed difference)."""

    sender: str
    worker: int
    seq: int
    url: str
    waiting: int
    running: int
    prefill: int
    blocks: int
    pending: int = 0


class Refresh(msgspec.Struct, array_like=True, frozen=True, tag=2):
    """The sender's whole load: ``rows`` of ``(url, waiting, running, prefill tokens, blocks)``;
    backends not listed have none; ``pending``: url → pending blocks (absent: 0)."""

    sender: str
    worker: int
    seq: int
    rows: list[tuple[str, int, int, int, int]]
    pending: dict[str, int] = msgspec.field(default_factory=dict)


class Bye(msgspec.Struct, array_like=True, frozen=True, tag=3):
    """The sender stops: drop its load now."""

    sender: str
    worker: int
    seq: int


Message = Delta | Refresh | Bye
_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> list[bytes]:
    """The frames of ``msg``."""
    return [PROTOCOL, _ENCODER.encode(msg)]


def decode(payload: bytes) -> Message:
    """The payload frame → a message; raises ``msgspec.DecodeError`` (a ValueError) when malformed."""
    return _DECODER.decode(payload)


def new_replica_id() -> str:
    """A random replica id (16 hex digits), chosen once per machine at start."""
    return secrets.token_hex(8)


def delta_kind(waiting: int, running: int) -> str:
    """What a lease did, from the change of its counters: reserve, start, adjust (a correction, or
    its pending blocks settled by a scrape) or release."""
    if waiting > 0:
        return "reserve"
    if waiting < 0 and running > 0:
        return "start"
    if waiting == 0 and running == 0:
        return "adjust"
    return "release"


# ------------------------------------------------------------------------------------ endpoints


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


async def own_addresses(bind: str | None) -> set[tuple[str, int]]:
    """(address, port) pairs that reach this machine's receiver: the bind host, and every address of
    this host's name, with the bind port; empty without a bind endpoint."""
    if bind is None:
        return set()
    _, host, port = parse_peer_endpoint(bind, dns=False)
    addrs = {host} if host not in ("*", "0.0.0.0", "::") else set()
    addrs |= {"127.0.0.1", "::1"} if host in ("*", "0.0.0.0", "::", "localhost") else set()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(OSError):
        for info in await loop.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM):
            addrs.add(str(info[4][0]))
    return {(a, port) for a in addrs}


async def resolve_peers(specs: Iterable[str], own: set[tuple[str, int]]) -> set[str] | None:
    """The ``tcp://`` endpoints ``specs`` name: ``tcp://`` ones as given, ``dns://NAME:PORT`` ones
    resolved to every address of ``NAME``; those in ``own`` (this machine's receiver) left out. None
    when a name did not resolve (keep the previous set)."""
    out: set[str] = set()
    loop = asyncio.get_running_loop()
    failed = False
    for spec in specs:
        scheme, host, port = parse_peer_endpoint(spec)
        if scheme == "tcp":
            if (host, port) not in own:
                out.add(spec)
            continue
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            log.warning("peers: cannot resolve %s: %s", spec, exc)
            failed = True
            continue
        for info in infos:
            addr = str(info[4][0])
            if (addr, port) not in own:
                out.add(_tcp(addr, port))
    return None if failed and not out else out


# ------------------------------------------------------------------------------------ publisher


class PeerPublisher:
    """Publishes this process's row of ``table`` (see the module docstring). :meth:`install` makes it
    the table's ``announce`` hook; :meth:`run` (a task) refreshes every ``refresh_s`` seconds and
    follows the peer list; :meth:`close` says bye. Counters: ``sent[kind]``, ``dropped``. Not
    thread-safe: use from the event loop that routes."""

    def __init__(
        self,
        table: LoadTable,
        replica: str,
        worker: int = 0,
        refresh_s: float = 1.0,
        ctx: zmq.Context[Any] | None = None,
    ) -> None:
        self.table = table
        self.replica = replica
        self.worker = worker
        self.refresh_s = refresh_s
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context()
        sock = self._ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 200)  # ms: a bye on close still goes out
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.IPV6, 1)
        self._sock: zmq.Socket[Any] | None = sock
        self.endpoints: set[str] = set()
        self.seq = 0
        self.sent = dict.fromkeys((*DELTA_KINDS, "refresh", "bye"), 0)
        self.dropped = 0  # messages the socket refused (queue full)
        self._urls: list[str] = []  # slot → URL, as far as known (slots are never freed)

    def install(self) -> None:
        """Publish every change of this process's row from now on (``table.announce``)."""
        self.table.announce = self.announce

    def set_peers(self, endpoints: Iterable[str]) -> None:
        """Connect to ``endpoints`` (``tcp://``) and disconnect from the ones no longer listed."""
        sock = self._sock
        if sock is None:
            return
        new = set(endpoints)
        for ep in self.endpoints - new:
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(ep)
        for ep in sorted(new - self.endpoints):
            try:
                sock.connect(ep)
            except zmq.ZMQError as exc:
                log.warning("peers: cannot connect to %s: %s", ep, exc)
                new.discard(ep)
        if new != self.endpoints:
            log.info("peers: publishing to %s", ", ".join(sorted(new)) or "nobody")
        self.endpoints = new

    def _url(self, slot: int) -> str:
        urls = self._urls
        while len(urls) <= slot:
            urls.append(self.table.url_of(len(urls)))
        if not urls[slot]:  # not assigned when first looked at
            urls[slot] = self.table.url_of(slot)
        return urls[slot]

    def _send(self, msg: Message, kind: str) -> None:
        sock = self._sock
        if sock is None:
            return
        try:
            sock.send_multipart(encode(msg), zmq.NOBLOCK)
            self.sent[kind] += 1
        except zmq.ZMQError:  # zmq.Again: the queue is full
            self.dropped += 1

    def _next(self) -> int:
        self.seq += 1
        return self.seq

    def announce(
        self, slot: int, waiting: int, running: int, prefill: int, blocks: int, pending: int
    ) -> None:
        """This process's row changed on ``slot`` by these deltas (called by :meth:`LoadTable.add`)."""
        msg = Delta(
            self.replica,
            self.worker,
            self._next(),
            self._url(slot),
            waiting,
            running,
            prefill,
            blocks,
            pending,
        )
        self._send(msg, delta_kind(waiting, running))

    def refresh(self) -> None:
        """Publish this process's whole row (every slot with load)."""
        table = self.table
        rows = []
        pending = {}
        slot = 0
        while slot < table.slots and self._url(slot):
            w, r, p, b = table.own(slot)
            if w or r or p or b:
                rows.append((self._urls[slot], w, r, p, b))
            d = table.own_pending(slot)
            if d:
                pending[self._urls[slot]] = d
            slot += 1
        self._send(Refresh(self.replica, self.worker, self._next(), rows, pending), "refresh")

    async def run(self, specs: tuple[str, ...], own: set[tuple[str, int]]) -> None:
        """Refresh every ``refresh_s`` seconds; resolve ``specs`` (see :func:`resolve_peers`) at
        start and every ``DNS_INTERVAL_S`` seconds when one is ``dns://``. Cancel to stop."""
        dns = any(s.startswith("dns://") for s in specs)
        next_resolve = 0.0
        loop = asyncio.get_running_loop()
        while True:
            if loop.time() >= next_resolve:
                found = await resolve_peers(specs, own)
                if found is not None:
                    self.set_peers(found)
                next_resolve = loop.time() + DNS_INTERVAL_S if dns else float("inf")
            self.refresh()
            await asyncio.sleep(self.refresh_s)

    def close(self) -> None:
        """Say bye, stop announcing, close the socket (waits up to 0.2 s for the bye to go out)."""
        if self.table.announce == self.announce:
            self.table.announce = None
        if self._sock is None:
            return
        self._send(Bye(self.replica, self.worker, self._next()), "bye")
        self._sock.close()
        self._sock = None
        if self._own_ctx:
            self._ctx.term()


# ------------------------------------------------------------------------------------ receiver


_COLS = len(COLUMNS)  # waiting, running, prefill, blocks, pending
_ZERO = (0,) * _COLS


class _Sender:
    __slots__ = ("last", "rows", "seq")

    def __init__(self, seq: int, now: float) -> None:
        self.seq = seq
        self.last = now  # when its last message came, seconds (the receiver's clock)
        self.rows: dict[str, list[int]] = {}  # url → [waiting, running, prefill, blocks, pending]


DROP_REASONS = ("malformed", "version", "own", "stale", "lost", "bad_url")
"""``kvroute_peer_dropped_total{reason}``: ``malformed`` (undecodable), ``version`` (another
protocol), ``own`` (from this replica), ``stale`` (sequence number not newer), ``lost`` (messages a
sequence gap shows were never received), ``bad_url`` (a backend URL the table cannot hold)."""


class PeerReceiver:
    """The other replicas' load, written into ``table``'s remote row (see the module docstring).

    ``replica``: this machine's replica id (its messages are ignored). ``clock``: monotonic seconds.
    :meth:`handle` and :meth:`sweep` are the synchronous core (tests drive them with a fake clock);
    :meth:`bind` then :meth:`run` put them on a SUB socket. Counters: ``received[kind]``,
    ``dropped[reason]``, ``expired`` (senders dropped for silence)."""

    def __init__(
        self,
        table: LoadTable,
        replica: str,
        clock: Callable[[], float],
        expiry_s: float = 3.0,
    ) -> None:
        self.table = table
        self.replica = replica
        self.clock = clock
        self.expiry_s = expiry_s
        self.sweep_s = min(0.25, expiry_s / 4)
        self.senders: dict[tuple[str, int], _Sender] = {}
        self._agg: dict[str, list[int]] = {}  # url → sum over senders
        self.received = dict.fromkeys(("delta", "refresh", "bye"), 0)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self.expired = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self.endpoint = ""

    # ---- the state ---------------------------------------------------------------------------

    def remote(self, url: str) -> tuple[int, int, int, int, int]:
        """(waiting, running, prefill, blocks, pending) the other replicas announced on ``url``, as
        written into the table (negative sums clamp to 0)."""
        a = self._agg.get(url)
        return (
            (0, 0, 0, 0, 0)
            if a is None
            else (max(a[0], 0), max(a[1], 0), max(a[2], 0), max(a[3], 0), max(a[4], 0))
        )

    def handle(self, frames: list[bytes]) -> None:
        """Apply one received message (mutates the senders' state and the table's remote row)."""
        if len(frames) != 2:
            self.dropped["malformed"] += 1
            return
        if frames[0] != PROTOCOL:
            self.dropped["version"] += 1
            return
        try:
            msg = decode(frames[1])
        except (msgspec.DecodeError, ValueError):
            self.dropped["malformed"] += 1
            return
        if msg.sender == self.replica:
            self.dropped["own"] += 1
            return
        key = (msg.sender, msg.worker)
        now = self.clock()
        s = self.senders.get(key)
        if s is None:
            s = self.senders[key] = _Sender(msg.seq - 1, now)
        if msg.seq <= s.seq:
            self.dropped["stale"] += 1
            return
        if msg.seq > s.seq + 1:
            self.dropped["lost"] += msg.seq - s.seq - 1
        s.seq = msg.seq
        s.last = now
        if isinstance(msg, Delta):
            self.received["delta"] += 1
            self._apply(s, msg.url, (msg.waiting, msg.running, msg.prefill, msg.blocks, msg.pending))
        elif isinstance(msg, Refresh):
            self.received["refresh"] += 1
            self._replace(s, {r[0]: [*r[1:], msg.pending.get(r[0], 0)] for r in msg.rows})
        else:
            self.received["bye"] += 1
            self._drop(key)

    def _apply(self, s: _Sender, url: str, d: tuple[int, int, int, int, int]) -> None:
        row = s.rows.get(url)
        if row is None:
            row = s.rows[url] = [0] * _COLS
        agg = self._agg.setdefault(url, [0] * _COLS)
        for i in range(_COLS):
            row[i] += d[i]
            agg[i] += d[i]
        self._write(url)

    def _replace(self, s: _Sender, rows: dict[str, list[int]]) -> None:
        old = s.rows
        s.rows = rows
        for url in old.keys() | rows.keys():
            before, after = old.get(url, _ZERO), rows.get(url, _ZERO)
            if tuple(before) != tuple(after):
                agg = self._agg.setdefault(url, [0] * _COLS)
                for i in range(_COLS):
                    agg[i] += after[i] - before[i]
                self._write(url)

    def _drop(self, key: tuple[str, int]) -> None:
        s = self.senders.pop(key, None)
        if s is not None:
            self._replace(s, {})

    def _write(self, url: str) -> None:
        try:
            slot = self.table.slot(url)
        except ValueError:
            self.dropped["bad_url"] += 1
            return
        self.table.set_remote(slot, *self.remote(url))

    def sweep(self) -> int:
        """Drop senders silent for more than ``expiry_s`` seconds; returns how many."""
        now = self.clock()
        dead = [k for k, s in self.senders.items() if now - s.last > self.expiry_s]
        for k in dead:
            log.warning(
                "peers: no message from replica %s worker %d for %.3g s: its load dropped",
                *k,
                now - self.senders[k].last,
            )
            self._drop(k)
        self.expired += len(dead)
        return len(dead)

    # ---- the socket --------------------------------------------------------------------------

    def bind(self, endpoint: str) -> None:
        """Bind the SUB socket at ``endpoint`` (``tcp://HOST:PORT``; port 0 is not allowed); raises
        :class:`UserError` when it cannot."""
        parse_peer_endpoint(endpoint, dns=False)
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
            raise UserError(f"cannot bind --peer-bind {endpoint}: {exc}") from None
        self._sock = sock
        self.endpoint = endpoint

    async def run(self) -> None:
        """Receive (after :meth:`bind`) and sweep every ``sweep_s`` seconds until cancelled."""
        sock = self._sock
        if sock is None:
            raise RuntimeError("PeerReceiver.run before bind")
        loop = asyncio.get_running_loop()
        next_sweep = loop.time() + self.sweep_s
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(next_sweep - loop.time(), 0.0)):
                    self.handle(await sock.recv_multipart())
                    while True:  # drain what is queued without a loop round trip
                        try:
                            frames = [zmq.Socket.recv(sock, zmq.NOBLOCK)]
                        except zmq.Again:
                            break
                        while zmq.Socket.getsockopt(sock, zmq.RCVMORE):
                            frames.append(zmq.Socket.recv(sock))
                        self.handle(frames)
            if loop.time() >= next_sweep:
                self.sweep()
                next_sweep = loop.time() + self.sweep_s

    def close(self) -> None:
        """Close the socket; the remote row keeps its last values (call :meth:`clear` to zero it)."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def clear(self) -> None:
        """Forget every sender (their load leaves the remote row)."""
        for k in list(self.senders):
            self._drop(k)


# ------------------------------------------------------------------------------------ wiring


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """``bind``: this machine's receive endpoint (None: do not receive); ``peers``: ``tcp://`` and
    ``dns://`` endpoints to publish to; ``expiry_s``, ``refresh_s``: seconds (see the module docstring)."""

    bind: str | None
    peers: tuple[str, ...]
    expiry_s: float = 3.0
    refresh_s: float = 1.0


class PeerLink:
    """A single-process router's publisher and receiver (the ``--workers`` supervisor instead runs a
    :class:`PeerReceiver` itself and a :class:`PeerPublisher` in each worker, all with one replica id)."""

    def __init__(
        self,
        settings: PeerSettings,
        table: LoadTable,
        clock: Callable[[], float],
        replica: str | None = None,
        worker: int = 0,
    ) -> None:
        self.settings = settings
        self.replica = replica or new_replica_id()
        self.publisher = PeerPublisher(table, self.replica, worker, settings.refresh_s)
        self.receiver = PeerReceiver(table, self.replica, clock, settings.expiry_s) if settings.bind else None

    def start(self) -> list[asyncio.Task[None]]:
        """Bind the receiver (UserError when it cannot), install the publisher; the tasks to run."""
        if self.receiver is not None and self.settings.bind:
            self.receiver.bind(self.settings.bind)
        self.publisher.install()
        tasks = [asyncio.create_task(self._publish())]
        if self.receiver is not None:
            tasks.append(asyncio.create_task(self.receiver.run()))
        return tasks

    async def _publish(self) -> None:
        own = await own_addresses(self.settings.bind)
        await self.publisher.run(self.settings.peers, own)

    def close(self) -> None:
        self.publisher.close()
        if self.receiver is not None:
            self.receiver.close()


class PeerCollector(Collector):
    """``kvroute_peer_messages_total{direction,kind}``, ``kvroute_peer_dropped_total{reason}``,
    ``kvroute_peer_expired_total``, ``kvroute_peers`` (live senders), ``kvroute_peer_endpoints``
    (endpoints published to), and ``kvroute_backend_remote_{waiting,running,queued_prefill_tokens}
    {backend}`` (the other replicas' load as this machine's table holds it). ``backends``: the
    router's (url, slot) pairs at scrape time."""

    def __init__(self, link: PeerLink, backends: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self.link = link
        self.backends = backends

    def collect(self) -> Iterator[Metric]:
        pub, rec = self.link.publisher, self.link.receiver
        msgs = CounterMetricFamily(
            "kvroute_peer_messages", "Peer messages sent and received", labels=["direction", "kind"]
        )
        for kind, n in pub.sent.items():
            msgs.add_metric(["sent", kind], n)
        dropped = CounterMetricFamily(
            "kvroute_peer_dropped", "Peer messages dropped or lost", labels=["reason"]
        )
        dropped.add_metric(["send_queue_full"], pub.dropped)
        if rec is not None:
            for kind, n in rec.received.items():
                msgs.add_metric(["received", kind], n)
            for reason, n in rec.dropped.items():
                dropped.add_metric([reason], n)
        yield msgs
        yield dropped
        yield CounterMetricFamily(
            "kvroute_peer_expired",
            "Peers dropped after peer_expiry_s of silence",
            value=rec.expired if rec is not None else 0,
        )
        yield GaugeMetricFamily(
            "kvroute_peers", "Peer senders heard from", value=len(rec.senders) if rec is not None else 0
        )
        yield GaugeMetricFamily("kvroute_peer_endpoints", "Endpoints published to", value=len(pub.endpoints))
        names = ("waiting", "running", "queued_prefill_tokens")
        fams = [
            GaugeMetricFamily(
                f"kvroute_backend_remote_{n}", f"Other replicas' {n.replace('_', ' ')}", labels=["backend"]
            )
            for n in names
        ]
        table = pub.table
        for url, slot in self.backends():
            total = table.totals(slot)
            local = table.totals(slot, remote=False)
            for i, fam in enumerate(fams):
                fam.add_metric([url], total[i] - local[i])
        yield from fams
