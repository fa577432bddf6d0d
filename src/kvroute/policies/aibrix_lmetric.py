"""AIBrix ``l-metric-local``: (pending uncached + new uncached tokens) × (pending requests + 1), lowest wins.

Source: vllm-project/aibrix ``pkg/plugins/gateway/algorithms/l_metric_local.go`` (commit 2519ad5,
read 2026-12-02) and its prefix table ``pkg/utils/prefixcacheindexer/hash.go`` (commit 0871c21).

Per candidate pod i, with T = the prompt's tokens:

- match %(i) = (k + 1) · 100 // B for the deepest block k (0-based) of the prompt's B full blocks that
  the gateway's *own* prefix table lists for i (``seqSearchPrefix``; 0 when none); hit(i) =
  T · match % // 100 and new(i) = T − hit(i), in tokens (Go's integer arithmetic).
- pending tokens P(i), pending requests R(i): the gateway's own counters. A request routed to i adds
  its new(i) (measured at dispatch, before its blocks are added to the table) and 1; both come off
  only when the request *finishes* (``DoneRequestCount``/``DoneRequestTrace``), never at its first
  token, and never below 0.
- score(i) = (P(i) + new(i)) × (R(i) + 1); lowest wins; ties at random (``rand.Intn`` there, the
  policy's seeded RNG here).

What it leaves out against kvroute's ``lmetric``: the engine's own view. The prefix table is routing
history (:class:`~kvroute.policies.history.HistoryTable`: one LRU of 200,000 blocks over all pods, 20
minutes idle TTL, no knowledge of engine evictions), so ``request.cached_tokens`` (the router's KV
view) is not read; pending tokens are released at finish, so prefill already done still counts while
the request decodes; the engine's queue length is not read either.

kvroute differences, by necessity: blocks are kvroute's KV blocks of ``request.block_size`` tokens
(AIBrix hashes 4-byte chunks of a character "tokenizer" by default); the table is per policy object
(AIBrix shares one per gateway process).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.policies.base import check_inputs
from kvroute.policies.history import AIBRIX_TABLE_BLOCKS, AIBRIX_TABLE_TTL_S, HistoryTable
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["AibrixLMetric", "aibrix_hit_tokens"]


def aibrix_hit_tokens(prompt_tokens: int, matched_blocks: int, total_blocks: int) -> int:
    """Tokens AIBrix counts as cached: T · ((matched · 100) // B) // 100 (0 without a full block)."""
    if total_blocks <= 0 or matched_blocks <= 0:
        return 0
    return prompt_tokens * (matched_blocks * 100 // total_blocks) // 100


@dataclass(slots=True)
class _Pending:
    """One pod's pending counters (tokens, requests)."""

    tokens: int = 0
    requests: int = 0


class _AibrixHold:
    """One dispatched request's share of a pod's pending counters, released at finish only."""

    __slots__ = ("_done", "pending", "tokens")

    def __init__(self, pending: _Pending, tokens: int) -> None:
        self.pending = pending
        self.tokens = tokens
        self._done = False
        pending.tokens += tokens
        pending.requests += 1

    def first_token(self, now: float) -> None:
        """Nothing: l-metric-local releases nothing before the request finishes."""

    def finished(self, now: float) -> None:
        if self._done:
            return
        self._done = True
        p = self.pending
        p.tokens = max(0, p.tokens - self.tokens)
        p.requests = max(0, p.requests - 1)


class AibrixLMetric:
    """AIBrix ``l-metric-local`` (module docstring); ``rng`` breaks ties."""

    name = "aibrix-lmetric"

    def __init__(
        self,
        rng: random.Random,
        table_blocks: int = AIBRIX_TABLE_BLOCKS,
        table_ttl_s: float | None = AIBRIX_TABLE_TTL_S,
    ) -> None:
        self.rng = rng
        self.table = HistoryTable(table_blocks, table_ttl_s)
        self._pending: dict[int, _Pending] = {}

    def pending(self, instance: int) -> tuple[int, int]:
        """(pending tokens, pending requests) of ``instance``."""
        p = self._pending.get(instance)
        return (0, 0) if p is None else (p.tokens, p.requests)

    def _new_tokens(self, request: RequestView, instances: Sequence[int]) -> list[int]:
        chain = request.chain
        matched = self.table.match(chain, instances, request.now)
        total = len(chain)
        prompt = request.prompt_tokens
        return [prompt - aibrix_hit_tokens(prompt, m, total) for m in matched]

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Lowest (P + new) × (R + 1); ties at random."""
        check_inputs(request, instances)
        new = self._new_tokens(request, [v.index for v in instances])
        pend = [self.pending(v.index) for v in instances]
        scores = tuple(float((p + t) * (r + 1)) for t, (p, r) in zip(new, pend, strict=True))
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        choice = tied[0] if len(tied) == 1 else tied[self.rng.randrange(len(tied))]
        return Choice(
            choice=choice,
            scores=scores,
            policy=self.name,
            detail={
                "new_tokens": tuple(float(t) for t in new),
                "pending_tokens": tuple(float(p) for p, _ in pend),
                "pending_requests": tuple(float(r) for _, r in pend),
            },
        )

    def dispatched(self, request: RequestView, position: int, instance: int, now: float) -> _AibrixHold:
        """``PostRouteUpdate`` + ``AddRequestCount``: the new tokens on ``instance`` by the table (before
        this request's blocks join it), the blocks added, the pod's counters raised."""
        tokens = self._new_tokens(request, [instance])[0]
        self.table.add(request.chain, instance, now)
        pending = self._pending.get(instance)
        if pending is None:
            pending = self._pending[instance] = _Pending()
        return _AibrixHold(pending, tokens)
