"""ZMQ subscriber of one backend's KV events, with sequence-gap detection and replay.

Wire format (vLLM ``ZmqEventPublisher``): multipart ``(topic, seq, payload)`` with ``seq`` 8 bytes
big-endian; replay: a DEALER sends ``(b"", start_seq)`` to the engine's ROUTER socket, which answers
``(b"", seq, payload)`` per buffered batch with ``seq >= start_seq``, then ``(b"", -1, b"")``.

On subscribe (a router started after its engines) everything the engine still buffers is replayed
at once, before the first live batch; until then the backend is routed on ``max(exact, approximate)``.

Gap handling: the next expected sequence number is ``last + 1``. A batch with a larger number means
batches were lost (ZMQ drops on overflow): they are replayed when a replay endpoint is configured; if
replay is absent or incomplete, the backend's exact view is reset (see :meth:`KVView.reset`). When
the engine's replay buffer no longer starts where asked (it keeps its last ``buffer_steps`` batches),
the view is reset and the buffered batches are applied: partial, so approximate help continues for
``recovery_s``. A smaller number means the engine restarted: its cache is empty, so the backend's
view is cleared and the new numbering is followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from kvroute.kvevents import END_SEQ, KVEventDecodeError, decode_batch, decode_seq, encode_seq
from kvroute.routing.kvview import KVView

__all__ = ["EventSubscriber"]

log = logging.getLogger("kvroute.prepare.events")


def _queued(sock: zmq.asyncio.Socket) -> bool:
    """A message is queued on ``sock`` (``ZMQ_EVENTS``; reading it also clears the socket's FD
    signal, so a level-triggered reader on that FD fires again only when something new happens)."""
    events = zmq.Socket.getsockopt(sock, zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


def _recv_now(sock: zmq.asyncio.Socket) -> list[bytes] | None:
    """One queued multipart message, received synchronously (the base class's methods bypass the
    asyncio socket's futures); None when none is queued (no ``zmq.Again`` raised and caught)."""
    if not _queued(sock):
        return None
    frames = [zmq.Socket.recv(sock, zmq.NOBLOCK)]
    while zmq.Socket.getsockopt(sock, zmq.RCVMORE):
        frames.append(zmq.Socket.recv(sock))
    return frames


class EventSubscriber:
    """Feeds ``kv`` from ``endpoint`` for backend ``backend``. Counters: ``batches``, ``gaps``,
    ``replayed``, ``resets``, ``bad``, ``partial`` (replays whose buffer no longer reached back to the
    batch asked for). ``synced`` is set once the replay asked for on subscribe has ended (whatever
    its outcome). Run with :meth:`run` as a task; cancel it to stop."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        backend: int,
        endpoint: str,
        replay_endpoint: str | None,
        kv: KVView,
        clock: Callable[[], float],
        replay_timeout_s: float = 1.0,
    ) -> None:
        self.ctx = ctx
        self.backend = backend
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.kv = kv
        self.clock = clock
        self.replay_timeout_s = replay_timeout_s
        self.last_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.replayed = 0
        self.resets = 0
        self.bad = 0
        self.partial = 0
        self.synced = asyncio.Event()
        self._replayed_to: int | None = None  # the last batch the replay on subscribe applied

    async def run(self) -> None:
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        loop = asyncio.get_running_loop()
        fd = sock.fileno()  # ZMQ_FD
        waiter: asyncio.Future[None] | None = None

        def readable() -> None:
            # ZMQ's FD only says "look at ZMQ_EVENTS"; looking clears it (see _queued)
            if _queued(sock) and waiter is not None and not waiter.done():
                waiter.set_result(None)

        reading = False
        try:
            await self._catch_up(sock)
            loop.add_reader(fd, readable)
            reading = True
            while True:
                # drain what is queued (bursts under load), then wait for the FD: one reader
                # callback per wake-up, no future per message and no zmq.Again per drain
                frames = _recv_now(sock)
                while frames is not None:
                    if len(frames) < 2:
                        self.bad += 1
                    else:
                        await self.handle(frames[-2], frames[-1])
                    frames = _recv_now(sock)
                waiter = loop.create_future()
                try:
                    if not _queued(sock):  # nothing arrived since the last look
                        await waiter
                finally:
                    waiter = None
        finally:
            if reading:
                loop.remove_reader(fd)
            self.synced.set()
            sock.close(0)

    async def _catch_up(self, sock: zmq.asyncio.Socket) -> None:
        """On subscribe, before the first live batch: replay everything the engine still buffers, so
        that a router started after its engines knows their caches at once. Until it has caught up
        the backend's view is ``max(exact, approximate)`` (:meth:`KVView.begin_sync`); a replay that
        fails leaves it recovering (as after a gap) and the first live batch decides; the live
        batches queued meanwhile that the replay already applied are dropped."""
        if self.replay_endpoint is None:
            self.synced.set()
            return
        self.kv.begin_sync(self.backend)
        outcome = await self._replay(0, None)
        if outcome == "complete":
            self.kv.end_sync(self.backend, self.clock())
        elif outcome == "failed":
            self.kv.reset(self.backend, self.clock())
            log.info("backend %d: no KV event replay on subscribe; approximate view for now", self.backend)
        self.synced.set()
        last = self._replayed_to = self.last_seq
        while last is not None:  # live batches queued during the replay
            frames = _recv_now(sock)
            if frames is None:
                return
            if len(frames) < 2:
                self.bad += 1
                continue
            try:
                seq = decode_seq(frames[-2])
            except KVEventDecodeError:
                self.bad += 1
                continue
            if seq > last:
                await self.handle(frames[-2], frames[-1])
                last = self.last_seq

    async def handle(self, seq_frame: bytes, payload: bytes) -> None:
        """Process one received batch (gap check, replay, apply)."""
        try:
            seq = decode_seq(seq_frame)
        except KVEventDecodeError:
            self.bad += 1
            return
        last = self.last_seq
        if self._replayed_to is not None:  # a live batch the replay on subscribe already applied,
            if seq <= self._replayed_to:  # delivered late (the replay may end after newer batches)
                return
            self._replayed_to = None
        if last is not None and seq <= last:
            if seq < last:  # numbering restarted: the engine restarted with an empty cache
                self.resets += 1
                self.kv.reset(self.backend, self.clock())
                log.warning("backend %d: KV event numbering restarted (%d after %d)", self.backend, seq, last)
            else:
                return  # duplicate
        elif (last is None and seq > 0) or (last is not None and seq > last + 1):
            start = 0 if last is None else last + 1
            self.gaps += 1
            if await self._replay(start, seq) == "failed":
                self.resets += 1
                self.kv.reset(self.backend, self.clock())
                log.warning(
                    "backend %d: KV event gap %d..%d not replayed; approximate view for now",
                    self.backend,
                    start,
                    seq - 1,
                )
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            _ts, events, _rank = decode_batch(payload)
        except KVEventDecodeError as exc:
            self.bad += 1
            log.warning("backend %d: undecodable KV event batch %d: %s", self.backend, seq, exc)
            return
        self.batches += 1
        self.kv.apply_events(self.backend, events)

    async def _replay(self, start: int, stop: int | None) -> str:
        """Replay batches ``start..stop-1`` (``stop`` None: up to the last one buffered), applying
        them in order. Returns ``"complete"`` when all were applied; ``"partial"`` when the engine's
        buffer no longer reaches back to ``start`` (vLLM keeps its last ``buffer_steps`` batches): the
        view is reset (recovering, counted in ``partial``) and the batches from the first buffered
        one on are applied; ``"failed"`` for no replay endpoint, a timeout (``replay_timeout_s`` per
        message), a malformed answer or a hole after the first replayed batch."""
        if self.replay_endpoint is None:
            return "failed"
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        expected = start
        partial = ended = False
        try:
            await sock.send_multipart([b"", encode_seq(start)])
            while True:
                async with asyncio.timeout(self.replay_timeout_s):
                    frames = await sock.recv_multipart()
                if len(frames) < 2:
                    break
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_SEQ:
                    ended = True
                    break
                seq = decode_seq(seq_frame)
                if seq < expected:
                    continue
                if stop is not None and seq >= stop:
                    break
                if seq > expected:
                    if expected != start:
                        break  # a hole inside the buffer
                    partial = True  # the buffer starts after what we asked for: what came before is lost
                    self.partial += 1
                    self.kv.reset(self.backend, self.clock())
                    log.warning(
                        "backend %d: KV event replay starts at %d, not %d: partial view, approximate for now",
                        self.backend,
                        seq,
                        start,
                    )
                self._apply(seq, payload)
                self.replayed += 1
                expected = seq + 1
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError):
            pass
        finally:
            with contextlib.suppress(zmq.ZMQError):
                sock.close(0)
        done = ended if stop is None else expected == stop
        if not done:
            return "failed"
        return "partial" if partial else "complete"
