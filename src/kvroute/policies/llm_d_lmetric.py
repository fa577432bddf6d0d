"""llm-d ``lmetric-scorer``: PToken × (in-flight requests + 1) on the precise KV view, lowest wins.

Source: llm-d/llm-d-router PR #2351 ("feat(epp): add LMetric scorer for precise-prefix-cache-routing",
open, read 2026-12-02; its README ``pkg/epp/framework/plugins/scheduling/scorer/lmetric/README.md``).
The PR's formula, per endpoint i:

- PToken(i) = (totalBlocks − matchBlocks(i)) × blockSizeTokens, in tokens: totalBlocks = the prompt's
  full blocks (``request.num_blocks``, or prompt_tokens // block_size), matchBlocks(i) = the leading
  blocks the precise prefix index (fed by the engines' KV events) holds for i
  (``request.cached_tokens[i] // block_size``).
- BS(i) = in-flight requests + 1; in-flight = requests dispatched to i and not finished, which is
  ``running + waiting`` in the router's load view.
- cost(i) = PToken(i) × BS(i); the scorer normalises so that the lowest cost scores highest and the
  max-score picker takes it. Alone in its profile (the PR's perf config), that is: lowest cost wins.

What it leaves out against kvroute's ``lmetric``: the prefill already queued on the endpoint
(``queued_prefill_tokens``) and the partial last block. The KV view is whatever the driver runs (the
PR pairs it with precise-prefix-cache routing: run it with the exact view, the simulator's default).
kvroute's core caps the match one block short of a prompt of whole blocks (the engine computes at
least one token), so such a prompt keeps PToken ≥ one block here where the PR's reaches 0. Ties →
lower ``InstanceView.index`` (llm-d's picker shuffles ties).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["LlmDLMetric"]


class LlmDLMetric:
    """llm-d's ``lmetric-scorer`` (module docstring)."""

    name = "llm-d-lmetric"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Lowest (total blocks − matched blocks) × block size × (running + waiting + 1)."""
        check_inputs(request, instances)
        bsz = max(request.block_size, 1)
        total = request.num_blocks or request.prompt_tokens // bsz
        p_token = tuple(float(max(total - c // bsz, 0) * bsz) for c in request.cached_tokens)
        bs = tuple(float(v.running + v.waiting + 1) for v in instances)
        scores = tuple(p * b for p, b in zip(p_token, bs, strict=True))
        return Choice(
            choice=argbest([scores], instances),
            scores=scores,
            policy=self.name,
            detail={"p_token": p_token, "bs": bs},
        )
