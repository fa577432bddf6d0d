"""SGLang model gateway ``cache_aware`` policy.

Source checked: sgl-project/sglang sgl-model-gateway/src/policies/cache_aware.rs.

load(i) = running + waiting (the gateway's in-flight requests per worker).

1. Imbalanced if (max_load − min_load) > ``balance_abs_threshold`` (64) AND
   max_load > ``balance_rel_threshold`` (1.5) · min_load → least loaded instance.
2. Otherwise match_rate(i) = cached_tokens[i] / prompt_tokens; if the best match_rate >
   ``cache_threshold`` (0.3) → the instance with the best match (ties → least loaded).
3. Otherwise → least loaded (older gateways picked the worker with the smallest radix tree).

Differences: the gateway's approximate tree matches characters of the request text and stores
the routing history; here the match is the router's cached-prefix view in tokens (block
granularity). All remaining ties → lower ``InstanceView.index``.

Scores: ``match_rate`` (higher is better) when step 2 decides, else ``load`` (lower is better);
``detail`` always carries both and ``imbalanced`` (1.0 or 0.0).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["SglangCacheAware"]


class SglangCacheAware:
    """SGLang cache_aware with the gateway defaults (abs 64, rel 1.5, cache threshold 0.3)."""

    name = "sglang"

    def __init__(
        self,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
    ) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Apply the three-step rule of the module docstring."""
        check_inputs(request, instances)
        load = tuple(float(i.running + i.waiting) for i in instances)
        prompt = request.prompt_tokens
        match = tuple(c / prompt if prompt > 0 else 0.0 for c in request.cached_tokens)
        lo, hi = min(load), max(load)
        imbalanced = (hi - lo) > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        detail = {"load": load, "match_rate": match, "imbalanced": (1.0 if imbalanced else 0.0,)}
        if not imbalanced and max(match) > self.cache_threshold:
            neg_load = tuple(-x for x in load)
            choice = argbest([match, neg_load], instances, lower_is_better=False)
            return Choice(choice=choice, scores=match, policy=self.name, lower_is_better=False, detail=detail)
        return Choice(choice=argbest([load], instances), scores=load, policy=self.name, detail=detail)
