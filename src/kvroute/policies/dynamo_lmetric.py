"""Dynamo ``--router-selection-policy lmetric``: adjusted prefill blocks × (decode blocks + 1), lowest wins.

Source: ai-dynamo/dynamo PR #11028 ("[feat] Add optional LMetric worker selection policy to KV
router", open, read 2026-12-02; issue #11029). The PR keeps the KV router's terms and replaces the
additive cost ``prefill_load_scale · adjusted_prefill_blocks + decode_blocks`` (kvroute's ``dynamo``,
:mod:`kvroute.policies.dynamo`) by their product:

    cost(i) = adjusted_prefill_blocks(i) × (decode_blocks(i) + 1)

with the same terms as :class:`~kvroute.policies.dynamo.DynamoKv`, in KV blocks of
``request.block_size`` tokens (fractional):

- adjusted_prefill_blocks(i) = max(queued_prefill_tokens(i) + prompt_tokens − cached_tokens[i], 0) /
  block_size: the active prefill on the worker plus this request's uncached prompt (the PR requires
  prefill-token tracking for this policy);
- decode_blocks(i) = ``decode_blocks`` (active decode blocks) + ceil(prompt_tokens / block_size)
  (the request's own blocks).

What it leaves out against kvroute's ``lmetric``: load is counted in KV blocks held, not in requests
(BS), so many short sequences weigh less than one long one. Ties → lower ``InstanceView.index``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs
from kvroute.policies.dynamo import dynamo_terms
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["DynamoLMetric"]


class DynamoLMetric:
    """Dynamo's ``lmetric`` worker selection (module docstring)."""

    name = "dynamo-lmetric"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Lowest adjusted prefill blocks × (decode blocks + 1)."""
        check_inputs(request, instances)
        prefill, decode = dynamo_terms(request, instances)
        scores = tuple(p * (d + 1.0) for p, d in zip(prefill, decode, strict=True))
        return Choice(
            choice=argbest([scores], instances),
            scores=scores,
            policy=self.name,
            detail={"prefill_blocks": prefill, "decode_blocks": decode},
        )
