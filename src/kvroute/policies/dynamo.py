"""NVIDIA Dynamo KV router cost (temperature 0: deterministic lowest cost).

Source checked: Dynamo docs, "Routing Concepts" (components/router/routing-concepts):
  raw_prefill_blocks = active_prefill_blocks + incoming_prompt_blocks
  adjusted_prefill_blocks = max(raw_prefill_blocks − overlap_credit_blocks, 0)
  decode_blocks = active_decode_blocks + incoming_active_blocks
  cost = prefill_load_scale · adjusted_prefill_blocks + decode_blocks   (older docs:
  cost = overlap_score_weight · prefill_blocks + decode_blocks; both default to 1)

Mapping onto the views (all in KV blocks of ``request.block_size`` tokens, fractional allowed):

- active_prefill_blocks = queued_prefill_tokens / block_size
- incoming_prompt_blocks − overlap_blocks = (prompt_tokens − cached_tokens[i]) / block_size
  (the docs compute new prefill tokens = input tokens − overlap blocks × block size, then divide)
- active_decode_blocks = ``InstanceView.decode_blocks``
- incoming_active_blocks = ceil(prompt_tokens / block_size), the same for every instance (it shifts
  every cost equally; kept so the scores match Dynamo's).

Only device-local overlap is credited (no host/disk tiers). Ties → lower ``InstanceView.index``
(Dynamo picks randomly among equal-cost workers).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["DynamoKv", "dynamo_terms"]


def dynamo_terms(
    request: RequestView, instances: Sequence[InstanceView]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per instance (adjusted prefill blocks, decode blocks) as the module docstring maps them."""
    bsz = max(request.block_size, 1)
    prompt = request.prompt_tokens
    incoming = float(-(-prompt // bsz))
    prefill = tuple(
        max((i.queued_prefill_tokens + prompt - c) / bsz, 0.0)
        for c, i in zip(request.cached_tokens, instances, strict=True)
    )
    return prefill, tuple(i.decode_blocks + incoming for i in instances)


class DynamoKv:
    """Dynamo's KV-router cost with ``prefill_load_scale`` (default 1.0)."""

    name = "dynamo"

    def __init__(self, prefill_load_scale: float = 1.0) -> None:
        self.prefill_load_scale = prefill_load_scale

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose the instance with the lowest projected prefill + decode block cost."""
        check_inputs(request, instances)
        prefill, decode = dynamo_terms(request, instances)
        scale = self.prefill_load_scale
        scores = tuple(scale * p + d for p, d in zip(prefill, decode, strict=True))
        return Choice(
            choice=argbest([scores], instances),
            scores=scores,
            policy=self.name,
            detail={"prefill_blocks": prefill, "decode_blocks": decode},
        )
