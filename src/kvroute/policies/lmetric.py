"""LMetric: score = P-token × (BS + 1), lowest wins (arXiv 2603.15202; blitz-serving/blitz-router).

- P-token(i) = prompt_tokens − cached_tokens[i] + queued_prefill_tokens(i), in tokens: the prefill work
  the request would wait behind plus its own uncached prefill if routed to instance i.
- BS(i) = running(i) + waiting(i), in requests. The authors' router multiplies by (BS + 1) so idle
  instances do not all tie at 0.
- score(i) = P-token(i) × (BS(i) + 1) ** bs_weight. ``bs_weight`` = 1 (the paper's policy, no
  hyperparameter) uses plain integer multiplication; other weights serve load-adaptive weighting.
- Ties: lower BS, then lower ``InstanceView.index``.

This sits on the request path, so ``choose`` avoids per-instance objects beyond the result columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["LMetric"]


class LMetric:
    """The LMetric policy. ``bs_weight`` (>= 0) is the exponent on (BS + 1); 1.0 is the paper's policy."""

    __slots__ = ("_w", "bs_weight", "name")

    def __init__(self, bs_weight: float = 1.0, name: str = "lmetric") -> None:
        if not bs_weight >= 0.0:  # also rejects NaN
            raise ValueError(f"bs_weight must be >= 0, got {bs_weight!r}")
        self.bs_weight = float(bs_weight)
        self._w: float | None = None if self.bs_weight == 1.0 else self.bs_weight
        self.name = name

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Pick the instance minimising P-token × (BS + 1) ** bs_weight; see the module docstring."""
        cached = request.cached_tokens
        n = len(instances)
        if n == 0 or len(cached) != n:
            raise ValueError(f"need a non-empty instance list matching cached_tokens ({len(cached)} vs {n})")
        prompt = request.prompt_tokens
        # Lengths were checked above, so strict zips would only cost time.
        insts = instances
        p_token = [prompt - c + inst.queued_prefill_tokens for c, inst in zip(cached, insts, strict=False)]
        bs = [inst.running + inst.waiting for inst in instances]
        w = self._w
        scores: list[float]
        if w is None:
            scores = list(map(mul, p_token, [b + 1 for b in bs]))
        else:
            scores = [p * (b + 1) ** w for p, b in zip(p_token, bs, strict=False)]
        best_s = min(scores)
        best = scores.index(best_s)
        if scores.count(best_s) > 1:  # rare: break ties by lower BS, then lower InstanceView.index
            best = min(
                (i for i in range(best, n) if scores[i] == best_s),
                key=lambda i: (bs[i], instances[i].index),
            )
        return Choice(
            choice=best,
            scores=tuple(scores),
            policy=self.name,
            lower_is_better=True,
            detail={"p_token": tuple(p_token), "bs": tuple(bs)},
        )
