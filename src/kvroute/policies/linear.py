"""Linear combination baseline from the LMetric paper (§4.4): the additive alternative to P × BS.

score(i) = λ · norm(P-token(i)) + (1 − λ) · norm(BS(i)), lowest wins, where P-token and BS are
exactly LMetric's (P-token = prompt − cached + queued prefill tokens; BS = running + waiting) and
norm is min-max across the candidate instances ((x − min) / (max − min); all equal → 0).
λ in [0, 1]. ``linear`` alone uses λ = 0.7, the paper's best value for chat workloads (≈ 0.55 for
API workloads). Ties → lower BS, then lower ``InstanceView.index``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.policies.base import argbest, check_inputs, minmax_normalise
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["DEFAULT_LAMBDA", "LinearCombo"]

DEFAULT_LAMBDA = 0.7


class LinearCombo:
    """λ·norm(P-token) + (1 − λ)·norm(BS); see the module docstring."""

    def __init__(self, lam: float = DEFAULT_LAMBDA, name: str | None = None) -> None:
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lambda must be in [0, 1], got {lam!r}")
        self.lam = lam
        self.name = name if name is not None else f"linear:{lam:g}"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose the instance minimising the normalised linear score."""
        check_inputs(request, instances)
        prompt = request.prompt_tokens
        p_token = tuple(
            float(prompt - c + i.queued_prefill_tokens)
            for c, i in zip(request.cached_tokens, instances, strict=True)
        )
        bs = tuple(float(i.running + i.waiting) for i in instances)
        lam = self.lam
        scores = tuple(
            lam * p + (1.0 - lam) * b
            for p, b in zip(minmax_normalise(p_token), minmax_normalise(bs), strict=True)
        )
        return Choice(
            choice=argbest([scores, bs], instances),
            scores=scores,
            policy=self.name,
            detail={"p_token": p_token, "bs": bs},
        )
