"""The prepare stage: a parsed request → its token ids and block chain (:class:`Prepared`).

The prompt is split at its first uncached piece (:class:`~kvroute.prepare.tokenize.RequestTokenizer`),
the rest tokenized (on the worker thread from ``OFFLOAD_CHARS``), and the chain hashed along cached
pieces (:class:`~kvroute.prepare.chainmemo.ChainMemo`). With ``tokenize: defer`` a long new text is
not tokenized now: the request is routed on its known blocks and an estimate of the rest, and a
:class:`Tail` tokenizes the text once the request is on its way (see there).

Errors: ApiError(400) for content the tokenizer or the chat template rejects, token ids outside
[0, 2**32), or a prompt longer than :func:`prompt_cap` (checked before hashing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvroute.blocks import extra_key as block_extra_key
from kvroute.chat_template import ChatTemplateError
from kvroute.prepare.chainmemo import Piece
from kvroute.prepare.tokenize import Pending
from kvroute.server.state.backends import Lease
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import ApiError, ParsedRequest, too_long

__all__ = [
    "DEFER_CHARS",
    "OFFLOAD_CHARS",
    "TAIL_GRACE_S",
    "Prepared",
    "Tail",
    "defers",
    "extra_key",
    "hashed",
    "prepare",
    "prepare_inline",
    "prompt_cap",
    "split",
]

log = logging.getLogger("kvroute.server")

DEFER_CHARS = 1024
"""With ``tokenize: defer``: a prompt with at least this many characters of text the router has not
tokenized before is routed before that text is tokenized (see ``RouterConfig.tokenize``)."""

OFFLOAD_CHARS = 65536
"""At least this many characters to tokenize (~16,000 tokens, a few ms even with the tiktoken
encoder) are tokenized off the event loop, on the worker thread (HF tokenizers and tiktoken release
the GIL). Below it, the hand-off to the thread and back costs more latency than it saves: on the
proxy benchmark (one run each) the mean tokenize stage fell from 1,116 µs with a threshold of 8,192
characters to 646 µs with this one."""

TAIL_GRACE_S = 0.005
"""With ``tokenize: defer``: a routed request's new text is tokenized once its first byte has been
relayed to the client, or once it has waited this long (seconds) without one, whichever comes first.
A quick first token is not held up behind the router's own work; a long prefill gets its queued
prefill corrected while it waits."""


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request's tokens and blocks, as the decide stage needs them.

    ``key``: the extra key of its blocks (LoRA adapter, cache salt); ``ids``: its token ids, or with
    a deferred tail only their known leading part; ``chain``: the block hashes of ``ids``;
    ``tail_tokens``: the estimated tokens of the deferred text (0 when none); ``pending``: that
    text, for the :class:`Tail` (None when nothing is deferred). ``split_at``, ``tokenized_at``,
    ``hashed_at``: ``time.perf_counter()`` when each step ended (the stage timings on /metrics; a
    deferred request's tokenize and hash steps take no time here)."""

    key: str | bytes | None
    ids: Sequence[int]
    chain: tuple[int, ...]
    tail_tokens: int = 0
    pending: Pending | None = None
    split_at: float = 0.0
    tokenized_at: float = 0.0
    hashed_at: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        """The prompt's length in tokens (estimated when a tail is deferred)."""
        return len(self.ids) + self.tail_tokens


def extra_key(state: RouterState, req: ParsedRequest) -> str | bytes | None:
    """The extra key of ``req``'s blocks: its LoRA adapter (when its model is one) and its
    ``cache_salt`` (:func:`kvroute.blocks.extra_key`)."""
    adapter = req.model if state.pools.is_adapter(req.model) else None
    return block_extra_key(adapter, req.cache_salt)


def prompt_cap(state: RouterState) -> int:
    """The longest prompt routed, in tokens: one less than the largest ``max_model_len`` the
    backends' ``/v1/models`` list (vLLM refuses a prompt that long), else the config's
    ``max_prompt_tokens``."""
    longest = state.pools.max_model_len()
    return longest - 1 if longest > 1 else state.config.max_prompt_tokens


def defers(state: RouterState) -> bool:
    """Route before tokenizing new text (``config.tokenize == "defer"``, features off)."""
    return state.config.tokenize == "defer" and state.guard is None


def split(state: RouterState, req: ParsedRequest) -> Pending:
    """The prompt split at its first uncached piece (400 for content the tokenizer rejects)."""
    try:
        if req.chat:
            assert req.messages is not None
            return state.tokenizer.split_chat(req.messages, options=req.chat_options)
        assert req.prompt is not None
        return state.tokenizer.split_prompt(req.prompt)
    except ChatTemplateError as exc:  # the template's own message (raise_exception)
        raise ApiError(400, exc.message, "messages") from None
    except (TypeError, ValueError, KeyError) as exc:
        raise ApiError(400, f"cannot tokenize the request: {exc}") from None


def hashed(
    state: RouterState, pieces: Sequence[Piece], suffix: Sequence[int], salt: str | bytes | None
) -> tuple[list[int], tuple[int, ...]]:
    """The prompt's token ids and block chain from its pieces (see
    :mod:`kvroute.prepare.chainmemo`); 400 for token ids outside [0, 2**32)."""
    ids: list[int] = []
    for _, part in pieces:
        ids.extend(part)
    ids.extend(suffix)
    try:
        return ids, tuple(state.chains.chain(pieces, suffix, salt))
    except ValueError as exc:
        raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None


async def prepare(
    state: RouterState,
    req: ParsedRequest,
    pool: ThreadPoolExecutor,
    cap: int = 0,
    chain: tuple[int, ...] | None = None,
) -> Prepared:
    """``req``'s tokens and chain (module docstring); ``pool``: the worker thread for long texts;
    ``cap``: the most prompt tokens (0: no cap), checked before hashing; ``chain``: the chain of a
    token-id prompt the parse stage hashed already. Mutates the token cache and the chain memo only."""
    clock = time.perf_counter
    key = extra_key(state, req)
    if chain is not None and req.prompt is not None and not isinstance(req.prompt, str):
        now = clock()
        return Prepared(key, req.prompt, chain, 0, None, now, now, now)
    pending = split(state, req)
    t_split = clock()
    if pending.tail_chars >= DEFER_CHARS and defers(state):
        est = state.tokenizer.estimate_tail(pending)
        known, chain = hashed(state, pending.known_pieces, (), key)
        return Prepared(key, known, chain, est, pending, t_split, t_split, t_split)
    if pending.tail_chars >= OFFLOAD_CHARS:
        loop = asyncio.get_running_loop()
        pieces = await loop.run_in_executor(pool, state.tokenizer.finish_pieces, pending)
    else:
        pieces = state.tokenizer.finish_pieces(pending)
    t_tok = clock()
    if cap:
        n = sum(len(part) for _, part in pieces) + len(pending.suffix)
        if n > cap:
            raise too_long(n, cap)
    ids, whole = hashed(state, pieces, pending.suffix, key)
    return Prepared(key, ids, whole, 0, None, t_split, t_tok, clock())


def prepare_inline(state: RouterState, req: ParsedRequest) -> Prepared:
    """``req``'s whole tokens and chain on this thread, never deferred (tests, benchmarks)."""
    key = extra_key(state, req)
    pending = split(state, req)
    ids, chain = hashed(state, state.tokenizer.finish_pieces(pending), pending.suffix, key)
    return Prepared(key, ids, chain)


class Tail:
    """The deferred tokenization of a routed request's new text.

    Until it is done the request travels on an estimate (``Prepared.tail_tokens``, a chain of its
    known blocks only). It runs (:meth:`run`) after the first byte was relayed, or ``TAIL_GRACE_S``
    after the request was sent (:meth:`arm`), whichever is first, on the event loop (on the worker
    thread from ``OFFLOAD_CHARS``); then every backend the request was sent to records the whole
    chain in the KV view, the live attempt's queued prefill is corrected while it still waits, and
    the token cache knows the text for the conversation's next turn. ``cached_blocks``: the plan's
    predicted cached prefix per backend (blocks)."""

    __slots__ = (
        "_pending",
        "_pool",
        "_salt",
        "_timer",
        "cached_blocks",
        "chain",
        "lease",
        "n_tokens",
        "routed",
        "state",
    )

    def __init__(
        self,
        state: RouterState,
        cached_blocks: dict[int, int],
        pool: ThreadPoolExecutor,
        pending: Pending,
        salt: str | bytes | None,
    ) -> None:
        self.state = state
        self.cached_blocks = cached_blocks
        self.chain: tuple[int, ...] | None = None  # the whole prompt's chain, once known
        self.n_tokens = 0  # the whole prompt's tokens, once known
        self.routed: list[int] = []  # backends the request was sent to so far
        self.lease: Lease | None = None  # the attempt in progress
        self._pool = pool
        self._pending: Pending | None = pending  # None once started
        self._salt = salt
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """The request was sent: run at the latest ``TAIL_GRACE_S`` from now."""
        if self._pending is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(TAIL_GRACE_S, self.run)

    def run(self) -> None:
        """Tokenize the rest now (once; later calls do nothing); the chain is computed on the loop."""
        pending, self._pending = self._pending, None
        if self._timer is not None:
            self._timer.cancel()
        if pending is None:
            return
        salt = self._salt
        if pending.tail_chars >= OFFLOAD_CHARS:
            loop = asyncio.get_running_loop()
            try:
                fut = loop.run_in_executor(self._pool, self.state.tokenizer.finish_pieces, pending)
            except RuntimeError:  # the router is stopping (the thread pool is shut down)
                return
            fut.add_done_callback(lambda f: self._done(f, pending.suffix, salt))
        else:
            self._inline(pending, salt)

    def _inline(self, pending: Pending, salt: str | bytes | None) -> None:
        try:
            pieces = self.state.tokenizer.finish_pieces(pending)
            self._finish(*hashed(self.state, pieces, pending.suffix, salt))
        except Exception as exc:  # the request already went out on the estimate; only the view misses it
            log.warning("tokenizing a routed request's new text failed: %r", exc)

    def _done(
        self, fut: asyncio.Future[list[Piece]], suffix: Sequence[int], salt: str | bytes | None
    ) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            try:
                self._finish(*hashed(self.state, fut.result(), suffix, salt))
                return
            except Exception as err:
                exc = err
        log.warning("tokenizing a routed request's new text failed: %r", exc)

    def _finish(self, ids: list[int], chain: tuple[int, ...]) -> None:
        self.n_tokens, self.chain = len(ids), chain
        now = self.state.clock()
        for idx in self.routed:
            self.state.kv.on_routed(idx, self.chain, now)
        if self.lease is not None:
            blocks = -(-self.n_tokens // self.state.config.block_size)  # as reserve() counts them
            self.lease.adjust(self.prefill(self.lease.backend.index), blocks)

    def prefill(self, idx: int) -> int:
        """The exact new prefill on backend ``idx`` (once the tail is tokenized)."""
        cached = min(self.cached_blocks.get(idx, 0) * self.state.config.block_size, self.n_tokens)
        return self.n_tokens - cached
