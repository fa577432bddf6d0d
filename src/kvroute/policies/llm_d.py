"""llm-d default scheduling profile: weighted scorers, highest total wins.

Source checked: llm-d/llm-d-inference-scheduler pkg/epp/config/loader/defaults.go (queue ×2,
kv-cache-utilization ×2, prefix-cache ×3, max-score picker).

Per instance (each scorer in [0, 1]):

- prefix = matched blocks / request blocks, matched = cached_tokens // block_size, request blocks =
  ``num_blocks`` (or prompt_tokens // block_size when 0); 0 for a request with no full block.
- queue = (maxQ − q) / (maxQ − minQ) with q = ``waiting`` (requests); all equal → 1.
- kv = 1 − kv_usage.
- total = 3·prefix + 2·queue + 2·kv; highest wins.

llm-d's max-score picker breaks ties at random; here ties go to the lower ``InstanceView.index``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["LlmD"]


class LlmD:
    """llm-d default weighted-scorer profile (weights: prefix 3, queue 2, kv-utilisation 2)."""

    name = "llm-d"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self.weights = (prefix_weight, queue_weight, kv_weight)

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose the instance with the highest weighted score."""
        check_inputs(request, instances)
        bsz = max(request.block_size, 1)
        total_blocks = request.num_blocks or request.prompt_tokens // bsz
        if total_blocks > 0:
            prefix = tuple(min((c // bsz) / total_blocks, 1.0) for c in request.cached_tokens)
        else:
            prefix = tuple(0.0 for _ in instances)
        qs = [i.waiting for i in instances]
        q_min, q_max = min(qs), max(qs)
        span = q_max - q_min
        queue = tuple((q_max - q) / span if span else 1.0 for q in qs)
        kv = tuple(1.0 - i.kv_usage for i in instances)
        wp, wq, wk = self.weights
        scores = tuple(wp * p + wq * q + wk * k for p, q, k in zip(prefix, queue, kv, strict=True))
        return Choice(
            choice=argbest([scores], instances, lower_is_better=False),
            scores=scores,
            policy=self.name,
            lower_is_better=False,
            detail={"prefix": prefix, "queue": queue, "kv": kv},
        )
