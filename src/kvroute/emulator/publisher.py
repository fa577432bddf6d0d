"""ZMQ publisher of KV events, wire-compatible with vLLM's ``ZmqEventPublisher``.

Each batch goes out on a PUB socket as the multipart message ``(topic, seq, payload)``: ``topic``
UTF-8 bytes (empty by default), ``seq`` an 8-byte big-endian counter starting at 0, ``payload`` one
msgpack ``EventBatch`` (:func:`kvroute.kvevents.encode_batch`, ``fmt`` "array" or "map", or
"sglang": SGLang's layout, ``pages_per_block`` events per block).

Optional replay (as vLLM): a ROUTER socket on ``replay_endpoint``; a client (REQ, or DEALER sending
an empty delimiter frame) sends an 8-byte big-endian start sequence number and receives every
buffered ``(seq, payload)`` with ``seq >= start``, then ``(END_SEQ, b"")`` (sequence -1). The last
``buffer_steps`` batches are kept.

Endpoints are bound by default (the engine is the stable side, as with vLLM's ``tcp://*:5557``);
``connect=True`` connects the PUB socket instead, for a subscriber that binds.
Runs on the caller's asyncio loop (``zmq.asyncio``); PUB sends never block (ZMQ drops messages past
the high-water mark for a slow subscriber, as vLLM's would).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence

import zmq
import zmq.asyncio

from kvroute.engine.types import KVEvent
from kvroute.kvevents import END_SEQ, EventFormat, encode_batch, encode_seq

__all__ = ["KVEventPublisher"]


class KVEventPublisher:
    """Publishes KV event batches; owns its ZMQ context and sockets. Call :meth:`start` on a running
    loop, then :meth:`publish`; :meth:`close` releases everything."""

    def __init__(
        self,
        endpoint: str,
        *,
        fmt: EventFormat = "map",
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        dp_rank: int = 0,
        connect: bool = False,
        hwm: int = 100_000,
        pages_per_block: int = 1,
    ) -> None:
        self.endpoint = endpoint
        self.fmt: EventFormat = fmt
        self.topic = topic.encode("utf-8")
        self.replay_endpoint = replay_endpoint
        self.dp_rank = dp_rank
        self.connect = connect
        self.hwm = hwm
        self.pages_per_block = pages_per_block  # fmt "sglang": pages sent per block
        self.seq = 0  # next sequence number
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Open the sockets (raises ``zmq.ZMQError`` if an endpoint cannot be bound)."""
        self._ctx = zmq.asyncio.Context()
        pub = self._ctx.socket(zmq.PUB)
        pub.set_hwm(self.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        try:
            if self.connect:
                pub.connect(self.endpoint)
            else:
                pub.bind(self.endpoint)
        except zmq.ZMQError:
            pub.close(linger=0)
            self._ctx.term()
            self._ctx = None
            raise
        self._pub = pub
        if self.replay_endpoint is not None:
            rep = self._ctx.socket(zmq.ROUTER)
            rep.setsockopt(zmq.LINGER, 0)
            rep.bind(self.replay_endpoint)
            self._replay = rep
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: Sequence[KVEvent], ts: float | None = None) -> int | None:
        """Send one batch (nothing when ``events`` is empty); ``ts`` in seconds since the epoch
        (default: now). Returns the batch's sequence number, or None when nothing was sent."""
        if not events or self._pub is None:
            return None
        payload = encode_batch(
            time.time() if ts is None else ts, events, self.dp_rank, self.fmt, self.pages_per_block
        )
        seq = self.seq
        self.seq += 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            # ROUTER prepends the client identity; REQ clients add an empty delimiter frame.
            if len(frames) == 3 and frames[1] == b"":
                head = [frames[0], b""]
            elif len(frames) == 2:
                head = [frames[0]]
            else:
                continue
            start_bytes = frames[-1]
            if len(start_bytes) != 8:
                continue
            start = int.from_bytes(start_bytes, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart([*head, encode_seq(seq), payload])
            await self._replay.send_multipart([*head, END_SEQ, b""])

    async def close(self) -> None:
        """Stop the replay task and close the sockets and the context."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
