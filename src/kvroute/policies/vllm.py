"""vLLM v1 data-parallel load balancer (``DPLBAsyncMPClient.get_core_engine_for_request``).

Source checked: vllm/v1/engine/core_client.py.

- ``variant="v1"`` (the classic rule, vLLM 0.9–0.11 and the LMetric paper's baseline):
  score = 4·waiting + running (requests), lowest wins.
- ``variant="new"`` (recent vLLM main): score = max(client_count·inflight, waiting + running)
  + waiting·6·max(0, kv_usage − 0.5). With one router, the client's in-flight count equals the
  router-side running + waiting, so here score = (running + waiting) + 6·waiting·max(0, kv_usage − 0.5):
  waiting requests are penalised only when the KV pool is more than half full.

vLLM breaks ties by scanning from a rotating start index; here ties go to the lower
``InstanceView.index`` (deterministic). vLLM's optimistic "+1 waiting after routing" is the caller's
bookkeeping (``InstanceView.waiting`` already counts routed-but-not-started requests).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["VLLM_VARIANTS", "VllmBalancer"]

VLLM_VARIANTS = ("v1", "new")


class VllmBalancer:
    """vLLM's DP balancer; see the module docstring for both score formulas (units: requests)."""

    def __init__(self, variant: str = "v1") -> None:
        if variant not in VLLM_VARIANTS:
            raise ValueError(f"vllm variant must be one of {VLLM_VARIANTS}, got {variant!r}")
        self.variant = variant
        self.name = "vllm" if variant == "v1" else f"vllm:{variant}"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose the instance with the lowest vLLM load score."""
        check_inputs(request, instances)
        if self.variant == "v1":
            scores = tuple(float(4 * i.waiting + i.running) for i in instances)
        else:
            scores = tuple(
                float(i.running + i.waiting) + i.waiting * 6.0 * max(0.0, i.kv_usage - 0.5) for i in instances
            )
        return Choice(choice=argbest([scores], instances), scores=scores, policy=self.name)
