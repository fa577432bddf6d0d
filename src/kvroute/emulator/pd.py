"""Prefill/decode roles of the emulated engine: vLLM's ``--kv-transfer-config`` with the NIXL connector.

vLLM's flow (``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` and the scheduler side of
``vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py``), as emulated here:

- **P** (a request with ``kv_transfer_params.do_remote_decode``): prefills, samples its token, and
  answers with a top-level ``kv_transfer_params`` = ``{do_remote_prefill: true, do_remote_decode:
  false, remote_block_ids (one list per KV cache group), remote_engine_id, remote_request_id,
  remote_host, remote_port, tp_size, dcp_size, pp_size, remote_num_tokens, remote_blocks_expiry_time,
  transfer_mode: "pull", remote_prefill_cached_tokens}`` (vLLM 0.32's ``nixl/pull_scheduler.py``
  ``request_finished``, checked against vLLM 0.32's CPU build with NIXL).
  Its blocks stay referenced under a lease (:class:`Leases`) until D reads them and notifies, or until
  ``lease_timeout_s`` passes (vLLM 0.32: ``kv_connector_extra_config.kv_lease_duration``, 30 s, which
  D's heartbeats renew; older vLLM: ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s). Heartbeats are not
  emulated: D reads as soon as it gets the request. An aborted P request frees at once (vLLM frees
  unless the request finished by length).
- **D** (``kv_transfer_params.do_remote_prefill`` with P's fields): asks P over the side channel
  whether the blocks are still there (``read``), waits the modelled transfer time of the tokens it
  lacks (:class:`kvroute.engine.transfer.TransferModel`), notifies P (``done``: P frees), then runs the
  request with ``remote_prefill``: the tokens it lacked count as external
  (``prompt_tokens_by_source{source="external_kv_transfer"}``), only its local hit as
  ``cached_tokens`` (as vLLM 0.32's D reports), and it computes the last prompt token again. If P no longer has the
  blocks (lease expired, P restarted) D recomputes the prompt itself (vLLM's ``kv_load_failure_policy``
  ``recompute``). A D request aborted while it waits still notifies P.

The side channel is real ZMQ, as vLLM's NIXL side channel is: P binds a ROUTER socket at its
``remote_host:remote_port`` (vLLM's ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``_PORT``); D connects a DEALER per
exchange. Messages are msgpack ``[op, remote_request_id]`` with ``op`` ``"read"`` (reply
``[true, blocks]`` or ``[false, 0]``) or ``"done"`` (reply ``[freed, 0]``). Only the block *count* and
the time are modelled; the bytes never move.

The lease is on the wall clock (seconds), like vLLM's; transfer times are model seconds (divided by the
time scale before sleeping, as every modelled duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvroute.emulator.protocol import bad

__all__ = [
    "KV_ROLES",
    "KVTransferSettings",
    "Leases",
    "SideChannel",
    "ask",
    "parse_kv_transfer_config",
    "parse_kv_transfer_params",
]

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)  # the pull flow emulated here
DEFAULT_LEASE_TIMEOUT_S = 30.0  # vLLM 0.32's kv_connector_extra_config.kv_lease_duration default
# vLLM's KVTransferConfig fields (vllm/config/kv_transfer.py); others are refused as a typo would be
_CONFIG_KEYS = frozenset(
    {
        "kv_connector",
        "engine_id",
        "kv_buffer_device",
        "kv_buffer_size",
        "kv_role",
        "kv_rank",
        "kv_parallel_size",
        "kv_ip",
        "kv_port",
        "kv_connector_extra_config",
        "kv_connector_module_path",
        "enable_permute_local_kv",
        "kv_load_failure_policy",
    }
)
SIDE_TIMEOUT_S = 5.0  # wall seconds D waits for P's side-channel reply


@dataclass(frozen=True, slots=True)
class KVTransferSettings:
    """One engine's KV-transfer role. ``role``: ``kv_producer`` (P only), ``kv_consumer`` (D only) or
    ``kv_both``; ``engine_id``: its ``remote_engine_id``; ``side_host``/``side_port``: the side
    channel's address (port 0: any free one); ``lease_timeout_s``: wall seconds P keeps unread blocks;
    ``bandwidth_gbps``/``latency_s``: the link (GB/s, seconds)."""

    connector: str = "NixlConnector"
    role: str = "kv_both"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    side_host: str = "127.0.0.1"
    side_port: int = 0
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    bandwidth_gbps: float = 25.0
    latency_s: float = 0.0

    @property
    def produces(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(text: str) -> tuple[str, str, str | None, float | None]:
    """vLLM's ``--kv-transfer-config`` JSON → ``(connector, role, engine_id, lease seconds from
    kv_connector_extra_config.kv_lease_duration or None)``; ValueError with a one-line reason for
    anything else."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    unknown = sorted(set(data) - _CONFIG_KEYS)
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown field(s) {', '.join(unknown)}")
    connector = data.get("kv_connector")
    if connector not in CONNECTORS:
        raise ValueError(
            f"--kv-transfer-config: kv_connector {connector!r} is not emulated (only {', '.join(CONNECTORS)})"
        )
    role = data.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}, not {role!r}")
    engine_id = data.get("engine_id")
    if engine_id is not None and (not isinstance(engine_id, str) or not engine_id):
        raise ValueError("--kv-transfer-config: engine_id must be a non-empty string")
    extra = data.get("kv_connector_extra_config", {})
    if not isinstance(extra, dict):
        raise ValueError("--kv-transfer-config: kv_connector_extra_config must be an object")
    lease = extra.get("kv_lease_duration")
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int | float) or lease <= 0):
        raise ValueError("--kv-transfer-config: kv_lease_duration must be a positive number of seconds")
    return connector, role, engine_id, None if lease is None else float(lease)


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """A D request's view of P's answer (its ``kv_transfer_params``)."""

    engine_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    request_id: str | None


@dataclass(frozen=True, slots=True)
class KVParams:
    """A request's ``kv_transfer_params``: ``remote_decode`` (a P leg), or ``prefill`` (a D leg), or
    neither (the field absent or both flags false)."""

    remote_decode: bool = False
    prefill: RemotePrefill | None = None


def parse_kv_transfer_params(body: Mapping[str, Any]) -> KVParams:
    """Validate a request body's ``kv_transfer_params`` (ApiError 400 on a wrong type)."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return KVParams()
    if not isinstance(raw, dict):
        raise bad("'kv_transfer_params' must be an object", "kv_transfer_params")
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if raw.get(flag) is not None and not isinstance(raw.get(flag), bool):
            raise bad(f"'kv_transfer_params.{flag}' must be a boolean", "kv_transfer_params")
    decode, prefill = bool(raw.get("do_remote_decode")), bool(raw.get("do_remote_prefill"))
    if decode and prefill:
        raise bad(
            "'kv_transfer_params' cannot ask for remote decode and remote prefill", "kv_transfer_params"
        )
    if not prefill:
        return KVParams(remote_decode=decode)

    def need(name: str, kind: type, what: str) -> Any:
        v = raw.get(name)
        if not isinstance(v, kind) or isinstance(v, bool):
            raise bad(
                f"'kv_transfer_params.{name}' must be {what} with do_remote_prefill", "kv_transfer_params"
            )
        return v

    ids = need("remote_block_ids", list, "an array of integers (or one array per KV cache group)")
    if ids and all(isinstance(g, list) for g in ids):  # vLLM 0.32: one list per KV cache group
        ids = [i for g in ids for i in g]
    if any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise bad("'kv_transfer_params.remote_block_ids' must be an array of integers", "kv_transfer_params")
    port = need("remote_port", int, "an integer")
    if not 0 < port < 65536:
        raise bad("'kv_transfer_params.remote_port' must be a port number", "kv_transfer_params")
    rid = raw.get("remote_request_id")
    if rid is not None and not isinstance(rid, str):
        raise bad("'kv_transfer_params.remote_request_id' must be a string", "kv_transfer_params")
    return KVParams(
        prefill=RemotePrefill(
            need("remote_engine_id", str, "a string"),
            need("remote_host", str, "a string"),
            port,
            tuple(ids),
            rid,
        )
    )


class Leases:
    """P's blocks held for readers: ``remote_request_id`` → the expiry timer. ``free(rid)`` is called
    once per lease, on ``done`` or at expiry (it releases the engine's blocks and returns whether it
    held any). Loop thread only."""

    def __init__(self, free: Callable[[str], bool], timeout_s: float) -> None:
        self._free = free
        self.timeout_s = timeout_s
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self.expired = 0  # leases that ran out unread

    def grant(self, rid: str) -> None:
        loop = asyncio.get_running_loop()
        self._timers[rid] = loop.call_later(self.timeout_s, self._expire, rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._timers

    def __len__(self) -> int:
        return len(self._timers)

    def end(self, rid: str) -> bool:
        """The reader is done (or gone): free now. False if no such lease."""
        timer = self._timers.pop(rid, None)
        if timer is None:
            return False
        timer.cancel()
        return self._free(rid)

    def _expire(self, rid: str) -> None:
        if self._timers.pop(rid, None) is not None:
            self.expired += 1
            self._free(rid)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


class SideChannel:
    """P's side of the side channel: a ROUTER socket answering ``read`` and ``done``. ``blocks(rid)``
    tells how many blocks a lease holds (0: none); ``done(rid)`` ends it."""

    def __init__(
        self, host: str, port: int, blocks: Callable[[str], int], done: Callable[[str], bool]
    ) -> None:
        self.host = host
        self.port = port
        self._blocks = blocks
        self._done = done
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> int:
        """Bind (raises ``zmq.ZMQError`` if the address is taken); returns the bound port."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            if self.port:
                sock.bind(f"tcp://{self.host}:{self.port}")
            else:
                self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError:
            sock.close(linger=0)
            self._ctx.term()
            raise
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._serve())
        return self.port

    async def _serve(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) < 2:
                continue
            ident, payload = frames[0], frames[-1]
            try:
                op, rid = msgspec.msgpack.decode(payload)
                if not isinstance(rid, str):
                    raise ValueError(rid)
            except (ValueError, TypeError, msgspec.DecodeError):
                await sock.send_multipart([ident, b"", msgspec.msgpack.encode([False, 0])])
                continue
            if op == "read":
                n = self._blocks(rid)
                reply = [n > 0, n]
            elif op == "done":
                reply = [self._done(rid), 0]
            else:
                reply = [False, 0]
            await sock.send_multipart([ident, b"", msgspec.msgpack.encode(reply)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


async def ask(ctx: zmq.asyncio.Context, host: str, port: int, op: str, rid: str) -> tuple[bool, int]:
    """D's side: send ``[op, rid]`` to P's side channel and wait for the reply; ``(False, 0)`` when P
    does not answer within :data:`SIDE_TIMEOUT_S` (P gone)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        await sock.send_multipart([b"", msgspec.msgpack.encode([op, rid])])
        if not await sock.poll(int(SIDE_TIMEOUT_S * 1000)):
            return False, 0
        frames = await sock.recv_multipart()
        ok, n = msgspec.msgpack.decode(frames[-1])
        return bool(ok), int(n)
    except (zmq.ZMQError, ValueError, TypeError, msgspec.DecodeError):
        return False, 0
    finally:
        sock.close(linger=0)
