"""The routing core: request → token blocks → KV match → instance views → policy → ordered backends.

No sockets here: backends are reached through the :class:`~kvroute.server.transport.Transport` given
to the proxy, and the clock is injected (``clock()`` returns monotonic seconds), so this runs the same
under tests and in production.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute.blocks import hash_blocks
from kvroute.policies.base import Policy
from kvroute.server.backends import BackendState
from kvroute.server.config import RouterConfig
from kvroute.server.kvview import KVView
from kvroute.server.tokenize import RequestTokenizer
from kvroute.server.validate import ApiError, ParsedRequest
from kvroute.views import Decision, RequestView

__all__ = ["Plan", "RouterCore", "RouterCounters"]


@dataclass(frozen=True, slots=True)
class Plan:
    """A routing decision: ``order`` lists backend indices, best first (the retry order);
    ``new_prefill[i]`` is the uncached prompt tokens if sent to backend ``i`` (tokens); ``chain`` the
    prompt's block hashes; ``cached_blocks[i]`` the predicted cached prefix on backend ``i`` (blocks)."""

    order: tuple[int, ...]
    chain: tuple[int, ...]
    prompt_tokens: int
    new_prefill: dict[int, int]
    cached_blocks: dict[int, int]
    decision: Decision


class RouterCounters:
    """Plain integer counters exported on the router's /metrics (cheaper than label lookups per request)."""

    __slots__ = ("cancelled", "client_errors", "ok", "rejected", "retries", "unavailable", "upstream_errors")

    def __init__(self) -> None:
        self.ok = 0
        self.client_errors = 0  # 4xx from us (validation) or passed through from a backend
        self.upstream_errors = 0  # failures after the first byte, or non-retryable backend errors
        self.retries = 0
        self.cancelled = 0  # client went away
        self.rejected = 0  # validation errors (subset of client_errors)
        self.unavailable = 0  # 503: no backend could take it


class RouterCore:
    """Owns the backends' state, the KV view, the tokenizer and the policy. Not thread-safe: use from
    one event loop."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: RequestTokenizer,
        policy: Policy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.policy = policy
        self.clock = clock
        self.backends = [BackendState(i, b.url) for i, b in enumerate(config.backends)]
        self.kv = KVView(
            num_backends=len(self.backends),
            block_size=config.block_size,
            capacity_blocks=config.approx_capacity_blocks or 16384,
            ttl_s=config.approx_ttl_s,
            recovery_s=config.kv_recovery_s,
            exact_backends=frozenset(i for i, b in enumerate(config.backends) if b.kv_events),
        )
        self.counters = RouterCounters()

    def tokens(self, req: ParsedRequest) -> Sequence[int]:
        """The prompt's token ids (400 for content the tokenizer rejects)."""
        try:
            if req.chat:
                assert req.messages is not None
                return self.tokenizer.chat(req.messages)
            assert req.prompt is not None
            return self.tokenizer.prompt(req.prompt)
        except (TypeError, ValueError, KeyError) as exc:
            raise ApiError(400, f"cannot tokenize the request: {exc}") from None

    def plan(self, req: ParsedRequest, ids: Sequence[int] | None = None) -> Plan:
        """Route ``req`` (``ids``: its token ids when already computed, e.g. on a worker thread).
        Raises ApiError(503) when no backend is healthy, 400 for untokenizable input."""
        candidates = [b for b in self.backends if b.healthy]
        if not candidates:
            raise ApiError(503, "no healthy backend", etype="service_unavailable")
        if ids is None:
            ids = self.tokens(req)
        bs = self.config.block_size
        try:
            chain = tuple(hash_blocks(ids, bs, extra_key=req.cache_salt))
        except ValueError as exc:
            raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None
        now = self.clock()
        n_prompt = len(ids)
        matched = self.kv.match(chain, now)
        cached_blocks = [matched[b.index] for b in candidates]
        cached = tuple(min(c * bs, n_prompt) for c in cached_blocks)
        stale = self.config.scrape_stale_s
        views = [b.view(now, stale) for b in candidates]
        rv = RequestView(
            prompt_tokens=n_prompt,
            cached_tokens=cached,
            num_blocks=len(chain),
            block_size=bs,
            max_tokens=req.max_tokens,
            user=req.user,
            prefix_key=chain[0] if chain else 0,
        )
        decision = self.policy.choose(rv, views)
        order = _retry_order(decision, [b.index for b in candidates])
        return Plan(
            order=order,
            chain=chain,
            prompt_tokens=n_prompt,
            new_prefill={b.index: n_prompt - c for b, c in zip(candidates, cached, strict=True)},
            cached_blocks={b.index: c for b, c in zip(candidates, cached_blocks, strict=True)},
            decision=decision,
        )


def _retry_order(decision: Decision, indices: Sequence[int]) -> tuple[int, ...]:
    """The chosen backend first, then the others from best to worst score (stable on ties)."""
    scores = decision.scores
    sign = 1.0 if decision.lower_is_better else -1.0
    rest = sorted((p for p in range(len(indices)) if p != decision.choice), key=lambda p: sign * scores[p])
    return (indices[decision.choice], *(indices[p] for p in rest))
