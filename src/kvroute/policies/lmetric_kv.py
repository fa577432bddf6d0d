"""LMetric-KV: LMetric's score scaled by the KV pressure of the instance (kvroute's variant, not the paper's).

``lmetric`` counts requests in BS whatever KV they hold: on unique-prompt traffic near saturation
(the ``api`` workload at its knee) it keeps filling instances whose KV pool is almost full, which then
preempt sequences and recompute them. This variant multiplies the paper's score by the inverse of the
free fraction of the KV pool, the same blow-up as a queue's 1 / (1 − utilisation):

    score(i) = P-token(i) × (BS(i) + 1) × C(i) / (C(i) − D(i))

- P-token, BS: as in :class:`~kvroute.policies.lmetric.LMetric` (tokens, requests).
- C(i) = ``kv_capacity_blocks``, D(i) = ``decode_blocks`` (the engine's blocks in use at the last
  load copy plus those of the requests routed since: :class:`~kvroute.views.InstanceView`), both in
  blocks, so the factor is dimensionless and >= 1. With D >= C (the pool is committed beyond its
  size) the free space counts as one block (factor C). With C unknown (0) the factor is 1: the
  policy is plain ``lmetric``.
- No hyperparameter: on an empty pool the factor is 1 and the score is the paper's; it doubles at half
  full and grows without bound as the pool fills.
- Ties: lower BS, then lower ``InstanceView.index`` (as ``lmetric``).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["LMetricKV", "kv_pressure"]


def kv_pressure(view: InstanceView) -> float:
    """C / (C − D) for ``view`` (>= 1; 1 when the capacity is unknown); see the module docstring."""
    cap = view.kv_capacity_blocks
    if cap <= 0:
        return 1.0
    return cap / max(1, cap - view.decode_blocks)


class LMetricKV:
    """score = P-token × (BS + 1) × C / (C − D), lowest wins; see the module docstring."""

    __slots__ = ("name",)

    def __init__(self, name: str = "lmetric-kv") -> None:
        self.name = name

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Pick the instance with the lowest score (units: token-requests, scaled by a pure number)."""
        n = check_inputs(request, instances)
        prompt = request.prompt_tokens
        p_token = [
            prompt - c + v.queued_prefill_tokens
            for c, v in zip(request.cached_tokens, instances, strict=True)
        ]
        bs = [v.running + v.waiting for v in instances]
        kv = [kv_pressure(v) for v in instances]
        scores = [p * (b + 1) * k for p, b, k in zip(p_token, bs, kv, strict=True)]
        best_s = min(scores)
        best = min((i for i in range(n) if scores[i] == best_s), key=lambda i: (bs[i], instances[i].index))
        return Choice(
            choice=best,
            scores=tuple(scores),
            policy=self.name,
            lower_is_better=True,
            detail={
                "p_token": tuple(map(float, p_token)),
                "bs": tuple(map(float, bs)),
                "kv_pressure": tuple(kv),
            },
        )
