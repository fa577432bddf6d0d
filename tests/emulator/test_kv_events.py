"""KV events over ZMQ: a SUB decodes both encodings and rebuilds the model's cached block set."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio

from kvroute.blocks import hash_blocks
from kvroute.emulator.server import EmulatorServer, KVEventsSettings
from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.kvevents import decode_batch, decode_seq, encode_seq

from .conftest import MODEL, free_port


async def _complete(server: EmulatorServer, prompt: list[int]) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{server.port}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 2},
        ) as r,
    ):
        assert r.status == 200
        await r.read()


def _apply(blocks: set[int], events: list[KVEvent]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored):
            # a consumer can rebuild its own hash chain from token_ids (here the engine uses the same hash)
            assert hash_blocks(ev.token_ids, ev.block_size, parent=ev.parent_block_hash) == list(
                ev.block_hashes
            )
            blocks.update(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            blocks.difference_update(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared):
            blocks.clear()


@pytest.mark.parametrize("fmt", ["array", "map"])
async def test_subscriber_rebuilds_block_set(start_server, fmt):
    pub_port, replay_port = free_port(), free_port()
    kv = KVEventsSettings(f"tcp://127.0.0.1:{pub_port}", fmt, "kv", f"tcp://127.0.0.1:{replay_port}")
    # 40 blocks of 16 tokens; every prompt has 10 full blocks: the pool must evict
    server: EmulatorServer = await start_server(blocks=40, max_model_len=640, kv=kv, time_scale=50.0)
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(kv.endpoint)
    dealer = ctx.socket(zmq.DEALER)  # replay: [empty, start seq] → [empty, seq, payload]…, then seq -1
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(kv.replay_endpoint or "")
    try:
        # let the subscription reach the publisher; a gap at the start is filled from replay below
        await asyncio.sleep(0.2)
        shared = list(range(2000, 2080))  # 5 blocks shared by every prompt
        for i in range(8):
            await _complete(server, shared + list(range(3000 + 100 * i, 3000 + 100 * i + 85)))
        await _complete(server, shared + list(range(3000, 3085)))  # a repeat: partly still cached
        last = server.publisher.seq - 1 if server.publisher else -1
        assert last >= 0
        got: dict[int, list[KVEvent]] = {}
        while last not in got:
            if not await sub.poll(5000):
                break
            topic, seq, payload = await sub.recv_multipart()
            assert topic == b"kv"
            _, events, rank = decode_batch(payload)
            assert rank == 0
            wire_event = msgspec.msgpack.decode(payload)[1][0]
            assert isinstance(wire_event, list if fmt == "array" else dict)
            got[decode_seq(seq)] = events
        # fill any gap at the start from the replay socket; check replay agrees with what was received
        await dealer.send_multipart([b"", encode_seq(0)])
        replayed: dict[int, list[KVEvent]] = {}
        while await dealer.poll(5000):
            empty, seq, payload = await dealer.recv_multipart()
            assert empty == b""
            if decode_seq(seq) == -1:
                assert payload == b""
                break
            replayed[decode_seq(seq)] = decode_batch(payload)[1]
    finally:
        sub.close()
        dealer.close()
        ctx.term()
    assert sorted(replayed) == list(range(last + 1))
    assert got and all(replayed[s] == got[s] for s in got)
    assert max(got) == last  # the subscriber saw the stream up to its end
    # a consumer's view: live batches, with the ones before its first live batch taken from replay
    blocks: set[int] = set()
    for s in range(last + 1):
        _apply(blocks, got[s] if s in got else replayed[s])
    assert any(isinstance(e, BlockRemoved) for evs in replayed.values() for e in evs)  # evictions happened
    assert blocks == set(server.model.pool.cached)
    assert len(blocks) == server.model.stats().cached_blocks
