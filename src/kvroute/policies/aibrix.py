"""AIBrix ``prefix-cache`` routing.

Sources checked: vllm-project/aibrix pkg/plugins/gateway/algorithms/README.md and prefix_cache.go;
the LMetric authors' port (blitz-router router/src/policies/aibrix/prefix_cache.rs).

load(i) = running + waiting: AIBrix counts the gateway's in-flight requests per pod, which is what
the router sees as running + waiting.

1. If max(load) − min(load) > ``imbalance_abs_count`` (8) → least loaded (ties → higher match %,
   then lower index).
2. Otherwise, among instances with a prefix match (cached_tokens > 0), sorted by match % descending
   then load ascending (then lower index), take the first with load ≤ mean + ``std_factor`` (1) · σ,
   where mean and σ (sample standard deviation, n − 1; 0 for one instance) are over all instances.
3. No match, or none under the bound → least loaded.

Newer AIBrix replaced step 1 with a gate (max > 2·(mean + 1) and gap ≥ 8 restricts matching to the
least-loaded pods); this implements the earlier rule the LMetric paper compares against.

Scores: match % (higher is better); ``detail`` carries ``load`` and ``imbalanced``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["AibrixPrefixCache"]


class AibrixPrefixCache:
    """AIBrix prefix-cache router with defaults imbalance 8 requests and 1 standard deviation."""

    name = "aibrix"

    def __init__(self, imbalance_abs_count: int = 8, std_factor: float = 1.0) -> None:
        self.imbalance_abs_count = imbalance_abs_count
        self.std_factor = std_factor

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Apply the three steps of the module docstring."""
        n = check_inputs(request, instances)
        load = tuple(float(i.running + i.waiting) for i in instances)
        prompt = request.prompt_tokens
        match = tuple(c / prompt if prompt > 0 else 0.0 for c in request.cached_tokens)
        imbalanced = max(load) - min(load) > self.imbalance_abs_count
        neg_match = tuple(-m for m in match)
        least_loaded = argbest([load, neg_match], instances)
        choice = least_loaded
        if not imbalanced:
            mean = sum(load) / n
            sigma = math.sqrt(sum((x - mean) ** 2 for x in load) / (n - 1)) if n > 1 else 0.0
            bound = mean + self.std_factor * sigma
            ranked = sorted(
                (pos for pos in range(n) if request.cached_tokens[pos] > 0),
                key=lambda pos: (-match[pos], load[pos], instances[pos].index),
            )
            choice = next((pos for pos in ranked if load[pos] <= bound), least_loaded)
        return Choice(
            choice=choice,
            scores=match,
            policy=self.name,
            lower_is_better=False,
            detail={"load": load, "imbalanced": (1.0 if imbalanced else 0.0,)},
        )
