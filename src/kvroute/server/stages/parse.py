"""The parse stage: a request body → its :class:`~kvroute.server.wire.validate.ParsedRequest`, and
for a long token-id prompt its block chain too, off the event loop for large bodies.

A body of ``parse_offload_bytes`` or more (``RouterConfig``) is parsed by :func:`parse_body` away
from the event loop, so that one 30 MB body does not stall every other client (``/livez``
included): ``"process"`` (the default) in a worker process, ``"thread"`` on a worker thread, ``"off"``
on the loop. JSON parsing (orjson) holds the GIL for the whole body, so on a thread the loop still
waits for it; in a process only the hand-over of the bytes is the loop's. ``make bench ONLY=livez``
measures the three (``benchmarks/bench_livez.py``).

The prompt-token cap is checked there, before anything costs in proportion to the prompt: a token-id
prompt over it is a 400 before its ids are checked one by one, and before it is hashed. A token-id
prompt of at least :data:`HASH_OFF_TOKENS` tokens is packed (``array('I')``: range-checked, and
cheap to hand back) and chain-hashed there too (:func:`kvroute.blocks.hash_blocks`, which needs no
state: a token-id prompt is one piece without a memo key, see :mod:`kvroute.prepare.chainmemo`).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import dataclasses
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from kvroute.blocks import extra_key, hash_blocks
from kvroute.server.wire.validate import ApiError, ParsedRequest, parse_request

__all__ = ["HASH_OFF_TOKENS", "BodyParser", "Parsed", "parse_body"]

HASH_OFF_TOKENS = 16384
"""A token-id prompt of at least this many tokens, parsed off the loop, is hashed there too."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """A parsed body: ``request``; ``chain``: the block chain of its token-id prompt when
    :func:`parse_body` hashed it (None: the prepare stage hashes the prompt)."""

    request: ParsedRequest
    chain: tuple[int, ...] | None = None


def parse_body(
    raw: bytes, chat: bool, cap: int, block_size: int, adapters: frozenset[str], hash_from: int
) -> Parsed:
    """Parse and check ``raw`` (ApiError for the client otherwise), capping a token-id prompt at
    ``cap`` tokens; hash a token-id prompt of ``hash_from`` tokens or more (its extra key: the model
    when it is one of ``adapters``, and its cache salt). Pure: runs in any thread or process."""
    req = parse_request(raw, chat, cap)
    prompt = req.prompt
    if chat or prompt is None or isinstance(prompt, str) or len(prompt) < hash_from:
        return Parsed(req)
    try:
        ids = array.array("I", prompt)
    except (OverflowError, TypeError) as exc:
        raise ApiError(
            400, f"invalid token ids: token ids must be integers in [0, 2**32): {exc}", "prompt"
        ) from None
    key = extra_key(req.model if req.model in adapters else None, req.cache_salt)
    chain = tuple(hash_blocks(ids, block_size, key))
    return Parsed(dataclasses.replace(req, prompt=ids), chain)


def _die_with_parent(parent: int) -> None:
    """A parse worker process's initializer: it ends when the router does, however the router ends
    (Linux: the parent-death signal; elsewhere the pool's own shutdown)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the router died before the signal was armed
        os._exit(0)


class BodyParser:
    """Runs :func:`parse_body` on the loop (small bodies), or off it (module docstring). ``mode``:
    ``"process"``, ``"thread"`` or ``"off"``; ``offload_bytes``: the smallest body parsed off the
    loop. The worker starts with the first large body (a spawned interpreter: about a second on an
    idle machine, paid by that request only) and lives as long as the router; :meth:`close` kills
    it (a parse in progress is abandoned: the router is stopping)."""

    def __init__(self, mode: str, offload_bytes: int) -> None:
        self.mode = mode
        self.offload_bytes = offload_bytes
        self._pool: Executor | None = None
        self.offloaded = 0  # bodies parsed off the loop

    def _executor(self) -> Executor:
        if self._pool is None:
            if self.mode == "process":
                ctx = multiprocessing.get_context("spawn")
                self._pool = ProcessPoolExecutor(
                    1, mp_context=ctx, initializer=_die_with_parent, initargs=(os.getpid(),)
                )
            else:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvroute-parse")
        return self._pool

    async def parse(
        self, raw: bytes, chat: bool, cap: int, block_size: int, adapters: Callable[[], frozenset[str]]
    ) -> Parsed:
        """``raw`` parsed (ApiError for the client otherwise); ``cap``: the prompt-token cap."""
        if self.mode == "off" or len(raw) < self.offload_bytes:
            return parse_body(raw, chat, cap, block_size, frozenset(), 1 << 62)  # hashed by prepare
        self.offloaded += 1
        loop = asyncio.get_running_loop()
        args = (raw, chat, cap, block_size, adapters(), HASH_OFF_TOKENS)
        try:
            return await loop.run_in_executor(self._executor(), parse_body, *args)
        except BrokenProcessPool:  # the worker died (killed, out of memory): a new one next time
            self._drop()
            raise ApiError(
                503, "the router could not parse the request now; retry", etype="service_unavailable"
            ) from None

    def _drop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # the process pool's own shutdown waits for its worker (at interpreter exit too), which may
        # be busy with a 30 MB body or still starting: kill it instead (no API for that before 3.14)
        workers = []
        if isinstance(pool, ProcessPoolExecutor):
            workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in workers:
            with contextlib.suppress(OSError, ValueError):
                proc.kill()

    def close(self) -> None:
        """Kill the worker (its pending work is dropped)."""
        self._drop()
