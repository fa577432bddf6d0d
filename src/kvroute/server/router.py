"""The routing core: request → token blocks → KV match → instance views → policy → ordered backends.

No sockets here: backends are reached through the :class:`~kvroute.server.transport.Transport` given
to the proxy, and the clock is injected (``clock()`` returns monotonic seconds), so this runs the same
under tests and in production.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.blocks import hash_blocks
from kvroute.features.classes import CLASS_HEADER, resolve_class
from kvroute.features.coldstart import Prefix
from kvroute.policies.base import Policy
from kvroute.routing.guarded import Guarded
from kvroute.routing.kvview import KVView
from kvroute.server.backends import BackendState
from kvroute.server.chainmemo import ChainMemo, Piece
from kvroute.server.config import RouterConfig
from kvroute.server.tokenize import Pending, RequestTokenizer
from kvroute.server.validate import ApiError, ParsedRequest
from kvroute.views import Choice, RequestView

__all__ = ["Plan", "QuotaExceeded", "RouterCore", "RouterCounters"]

log = logging.getLogger("kvroute.server")


class QuotaExceeded(ApiError):
    """429: the request's user / API key is over its token quota; retry after ``retry_after`` s."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(429, message, etype="rate_limit_exceeded")
        self.retry_after = retry_after


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
    decision: Choice


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
        self.chains = ChainMemo(config.block_size, config.tokenizer_cache_entries)
        # Production features (kvroute.features): the policy wrapped when any is configured.
        feats = config.features
        self.guard = Guarded(policy, feats) if feats is not None and feats.any else None
        self._tags = {i: frozenset(b.tags) for i, b in enumerate(config.backends) if b.tags}
        self.preloads: list[tuple[int, Prefix]] = []  # cold-start preloads for the monitor to send
        if self.guard is not None and self.guard.warmup is not None:
            self.kv.on_cleared = self.backend_reset

    @property
    def defer_tokenize(self) -> bool:
        """Route before tokenizing new text (``config.tokenize == "defer"``, features off)."""
        return self.config.tokenize == "defer" and self.guard is None

    def split(self, req: ParsedRequest) -> Pending:
        """The prompt split at its first uncached piece (400 for content the tokenizer rejects)."""
        try:
            if req.chat:
                assert req.messages is not None
                return self.tokenizer.split_chat(req.messages)
            assert req.prompt is not None
            return self.tokenizer.split_prompt(req.prompt)
        except (TypeError, ValueError, KeyError) as exc:
            raise ApiError(400, f"cannot tokenize the request: {exc}") from None

    def tokens(self, req: ParsedRequest) -> list[int]:
        """The prompt's token ids (400 for content the tokenizer rejects)."""
        return self.tokenizer.finish(self.split(req))

    def hashed(
        self, pieces: Sequence[Piece], suffix: Sequence[int], salt: str | None
    ) -> tuple[list[int], tuple[int, ...]]:
        """The prompt's token ids and block chain from its pieces (see :mod:`.chainmemo`); 400 for
        token ids outside [0, 2**32)."""
        ids: list[int] = []
        for _, part in pieces:
            ids.extend(part)
        ids.extend(suffix)
        try:
            return ids, tuple(self.chains.chain(pieces, suffix, salt))
        except ValueError as exc:
            raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None

    def plan(
        self,
        req: ParsedRequest,
        ids: Sequence[int] | None = None,
        headers: Mapping[str, str] | None = None,
        tail_tokens: int = 0,
        hashes: Sequence[int] | None = None,
    ) -> Plan:
        """Route ``req`` (``ids``: its token ids when already computed, e.g. on a worker thread, or
        only their known leading part, followed by about ``tail_tokens`` more: then the chain covers
        the known part and the prompt length is estimated; ``headers``: the client's, for the class
        header and the API key). Raises ApiError(503) when no backend is healthy, 400 for
        untokenizable input or an unknown request class, QuotaExceeded (429) over quota. ``hashes``: the
        block hashes of ``ids`` when already computed (:meth:`hashed`)."""
        candidates = [b for b in self.backends if b.healthy]
        if not candidates:
            raise ApiError(503, "no healthy backend", etype="service_unavailable")
        if ids is None:
            ids = self.tokens(req)
        bs = self.config.block_size
        if hashes is not None:
            chain = tuple(hashes)
        else:
            try:
                chain = tuple(hash_blocks(ids, bs, extra_key=req.cache_salt))
            except ValueError as exc:
                raise ApiError(400, f"invalid token ids: {exc}", "prompt") from None
        now = self.clock()
        n_prompt = len(ids) + tail_tokens
        matched = self.kv.match(chain, now)
        cached_blocks = [matched[b.index] for b in candidates]
        cached = tuple(min(c * bs, n_prompt) for c in cached_blocks)
        stale = self.config.scrape_stale_s
        views = [b.view(now, stale) for b in candidates]
        guard = self.guard
        req_class = "default"
        key = chain[0] if chain else 0
        if guard is not None:
            req_class, key = self._features(guard, req, headers or {}, ids, chain, now)
            if self._tags:
                tags = self._tags
                views = [dataclasses.replace(v, tags=tags[v.index]) if v.index in tags else v for v in views]
        rv = RequestView(
            prompt_tokens=n_prompt,
            cached_tokens=cached,
            num_blocks=len(chain),
            block_size=bs,
            max_tokens=req.max_tokens,
            user=req.user,
            req_class=req_class,
            prefix_key=key,
        )
        if guard is not None:
            decision = guard.decide(rv, views, now)
            self.drain_log()
        else:
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

    def _features(
        self,
        guard: Guarded,
        req: ParsedRequest,
        headers: Mapping[str, str],
        ids: Sequence[int],
        chain: tuple[int, ...],
        now: float,
    ) -> tuple[str, int]:
        """Quota (429), request class (400 for an unknown one) and prefix class of ``req``."""
        feats = guard.features
        if feats.quota is not None:
            auth = headers.get("Authorization") or headers.get("authorization") or ""
            api_key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            who = (api_key or req.user) if feats.quota.key == "api_key" else (req.user or api_key)
            wait = guard.quota_wait(who, len(ids) + req.max_tokens, now)
            if wait:
                raise QuotaExceeded(
                    f"token quota exceeded for {'this API key' if who == api_key and who else 'this user'}; "
                    f"retry in {wait:.1f} s",
                    max(1, math.ceil(wait)),
                )
        req_class = "default"
        if feats.classes is not None:
            try:
                req_class = resolve_class(headers.get(CLASS_HEADER), req.user, req.model, feats.classes)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from None
        tokens = ids if req.cache_salt is None else None  # salted chains cannot be preloaded unsalted
        return req_class, guard.note(chain, self.config.block_size, now, tokens, req.model)

    def backend_reset(self, index: int) -> None:
        """Backend ``index`` restarted, was re-admitted or cleared its cache: with cold start on it
        warms up, and the frequent prefixes are queued in ``preloads``."""
        if self.guard is None:
            return
        self.preloads.extend((index, p) for p in self.guard.instance_reset(index, self.clock()))
        self.drain_log()

    def take_preloads(self) -> list[tuple[int, Prefix]]:
        out, self.preloads = self.preloads, []
        return out

    def drain_log(self) -> None:
        """Write what the features noticed (alarms, alerts, warm-ups) to the log."""
        guard = self.guard
        if guard is not None:
            while guard.log:
                log.warning("%s", guard.log.popleft())


def _retry_order(decision: Choice, indices: Sequence[int]) -> tuple[int, ...]:
    """The chosen backend first, then the others from best to worst score (stable on ties)."""
    scores = decision.scores
    sign = 1.0 if decision.lower_is_better else -1.0
    rest = sorted((p for p in range(len(indices)) if p != decision.choice), key=lambda p: sign * scores[p])
    return (indices[decision.choice], *(indices[p] for p in rest))
