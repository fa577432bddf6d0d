"""vllm-project/router ``smetric``: session affinity under a TTFT-SLO gate, else (pending + own cost) × load.

Source: vllm-project/router ``src/policies/smetric.rs`` and ``SMetricConfig`` in ``src/config/types.rs``
(commit 8bef731, read 2026-12-02). ``select_prefill`` there, per available worker i in round-robin
order (the start rotates by one per request), with L = the prompt's length:

- hit(i): the prefix of the prompt the router's *own* tree says i holds (routing history; inserted
  for the chosen worker on every decision); n(i) = L − hit(i).
- cost(i) = ceil(c_lin · n + c_att · n · (L − n / 2)): the prefill cost of the new part, attention
  growing with the context it attends to.
- queued(i) = pending(i) + cost(i); pending(i) = the costs of the requests dispatched to i whose first
  token has not come back (released at the first token, or when the request ends without one).
- rate(i) = ``prefill_rate`` if configured, else learned: the 0.9 quantile of the last 64 samples of
  cost / (first token − dispatch) on i, once there are 8 (None before: the gate passes).
- meets(i) = rate is None or queued(i) / rate ≤ slack · (ttft_slo_base + ttft_slo_per_token · L).
- score(i) = queued(i) × load(i) (co-located workers; load = the worker's in-flight requests, here
  ``running + waiting``, *without* + 1: idle workers all score 0).
- min = the first worker with the strictly lowest score in the rotated order; prev = the first with
  the strictly longest hit.
- **Gate**: route to prev if the turn gate passes, hit(prev) > hit_ratio · (what the previous turn
  sent), and (meets(prev) or no worker meets); else to min.

kvroute's mapping, where the views lack what the Rust router reads:

- L, hit and costs are in tokens (the Rust router counts characters); hit = the leading blocks of
  ``request.chain`` in :class:`~kvroute.policies.history.HistoryTable` (no TTL, 4 Mi blocks; the Rust
  tree keeps 64 Mi characters per tenant), times ``block_size``, at most L.
- The request carries no turn structure: the turn gate passes when some worker's hit is > 0 (a
  follow-up the router has seen), and "what the previous turn sent" is the longest hit, so the ratio
  test holds whenever the gate does. Stickiness is then decided by the TTFT gate alone.
- Configuration (the commit's ``SMetricConfig`` has no defaults; these are those of a later
  revision of the file in the code index): c_lin 1, c_att 0 (cost = new tokens), prefill rate learned,
  slack 1, hit_ratio 0.5, TTFT SLO 1.0 s + 0.0625 ms per prompt token.

Scores: ``queued × load`` (lower is better; the gate may override the minimum, ``detail["stick"]``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.policies.base import check_inputs
from kvroute.policies.history import HistoryTable
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["RATE_MIN_SAMPLES", "RATE_WINDOW", "SMetricConfig", "VllmRouterSMetric"]

RATE_WINDOW = 64
"""Samples of cost per second to first token kept per worker."""
RATE_MIN_SAMPLES = 8
"""Samples a worker needs before its learned rate is used."""
RATE_QUANTILE = 0.9


@dataclass(frozen=True, slots=True)
class SMetricConfig:
    """The policy's settings (module docstring): costs in tokens, rates in tokens/s, times in s."""

    c_lin: float = 1.0
    c_att: float = 0.0
    prefill_rate: float | None = None
    slack: float = 1.0
    hit_ratio: float = 0.5
    ttft_slo_base_s: float = 1.0
    ttft_slo_per_token_s: float = 0.0625e-3
    table_blocks: int = 1 << 22


@dataclass(slots=True)
class _Worker:
    """One worker's pending prefill cost and its rate samples."""

    pending: int = 0
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))
    rate: float | None = None

    def record(self, rate: float) -> None:
        self.samples.append(rate)
        if len(self.samples) >= RATE_MIN_SAMPLES:
            ordered = sorted(self.samples)
            self.rate = ordered[round((len(ordered) - 1) * RATE_QUANTILE)]


class _SMetricHold:
    """One request's cost in its worker's pending work, until its first token (a rate sample) or end."""

    __slots__ = ("cost", "learn", "queued", "since", "worker")

    def __init__(self, worker: _Worker, cost: int, since: float, learn: bool) -> None:
        self.worker = worker
        self.cost = cost
        self.since = since
        self.learn = learn
        self.queued = True
        worker.pending += cost

    def _release(self) -> bool:
        if not self.queued:
            return False
        self.queued = False
        w = self.worker
        w.pending = max(0, w.pending - self.cost)
        return True

    def first_token(self, now: float) -> None:
        if self._release() and self.learn and self.cost > 0 and now > self.since:
            self.worker.record(self.cost / (now - self.since))

    def finished(self, now: float) -> None:
        self._release()


class VllmRouterSMetric:
    """vllm-project/router's ``smetric`` (module docstring)."""

    name = "vllm-router-smetric"

    def __init__(self, config: SMetricConfig | None = None) -> None:
        self.config = config or SMetricConfig()
        self.table = HistoryTable(self.config.table_blocks, None)
        self._workers: dict[int, _Worker] = {}
        self._rr = 0

    def _worker(self, instance: int) -> _Worker:
        w = self._workers.get(instance)
        if w is None:
            w = self._workers[instance] = _Worker()
        return w

    def rate(self, instance: int) -> float | None:
        """The prefill rate the gate uses for ``instance`` (tokens/s; None: not known yet)."""
        cfg = self.config
        return cfg.prefill_rate if cfg.prefill_rate is not None else self._worker(instance).rate

    def cost(self, prompt: int, hit: int) -> int:
        """ceil(c_lin · n + c_att · n · (L − n / 2)) for n = L − hit new tokens of L."""
        n = float(prompt - hit)
        cfg = self.config
        return math.ceil(cfg.c_lin * n + cfg.c_att * n * (prompt - n / 2.0))

    def _hits(self, request: RequestView, indices: Sequence[int]) -> list[int]:
        bsz = max(request.block_size, 1)
        prompt = request.prompt_tokens
        return [min(m * bsz, prompt) for m in self.table.match(request.chain, indices, request.now)]

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """The gate or the minimum of (pending + cost) × load (module docstring)."""
        n = check_inputs(request, instances)
        cfg = self.config
        prompt = request.prompt_tokens
        hits = self._hits(request, [v.index for v in instances])
        costs = [self.cost(prompt, h) for h in hits]
        queued = [self._worker(v.index).pending + c for v, c in zip(instances, costs, strict=True)]
        budget = cfg.slack * (cfg.ttft_slo_base_s + cfg.ttft_slo_per_token_s * prompt)
        meets = []
        for v, q in zip(instances, queued, strict=True):
            rate = self.rate(v.index)
            meets.append(rate is None or q / rate <= budget)
        scores = tuple(float(q * (v.running + v.waiting)) for q, v in zip(queued, instances, strict=True))
        start = self._rr % n
        self._rr += 1
        order = [(start + k) % n for k in range(n)]
        best = order[0]
        prev = order[0]
        for p in order[1:]:
            if scores[p] < scores[best]:
                best = p
            if hits[p] > hits[prev]:
                prev = p
        longest = hits[prev]
        stick = longest > 0 and longest > cfg.hit_ratio * longest and (meets[prev] or not any(meets))
        return Choice(
            choice=prev if stick else best,
            scores=scores,
            policy=self.name,
            detail={
                "hit": tuple(float(h) for h in hits),
                "queued": tuple(float(q) for q in queued),
                "meets": tuple(1.0 if m else 0.0 for m in meets),
                "stick": (1.0 if stick else 0.0,),
            },
        )

    def dispatched(self, request: RequestView, position: int, instance: int, now: float) -> _SMetricHold:
        """The chosen worker's cost joins its pending work; the prompt joins the tree for it."""
        hit = self._hits(request, [instance])[0]
        self.table.add(request.chain, instance, now)
        learn = self.config.prefill_rate is None
        return _SMetricHold(self._worker(instance), self.cost(request.prompt_tokens, hit), now, learn)
