"""Alibaba Bailian production scheduler (as reimplemented by the LMetric authors).

Source checked: blitz-serving/blitz-router router/src/policies/bailian.rs.

Per instance i (scores in [0, 1] per term; higher is better):

- hit(i) = cached_tokens[i] / prompt_tokens (fraction; 0 for an empty prompt)
- bs(i) = running + waiting (requests)
- tokens(i) = queued_prefill_tokens + decode_blocks · block_size (tokens of outstanding work on the
  instance: queued prefill plus the KV held by running sequences) — our stand-in for the reference
  router's per-instance "all tokens" counter (assumption)

``normalise="max"`` (default, the formula as specified for kvroute):
  score = α·hit + β·(1 − bs/max_bs) + γ·(1 − tokens/max_tokens),
  with max_bs / max_tokens the maxima across the candidate instances (a 0/0 ratio counts as 0).
``normalise="minmax"`` (what blitz-router's code does): every term is min-max normalised across
instances, hit as (hit − min)/(max − min), the load terms as (max − x)/(max − min), with the span
floored at 1e-6 (all equal → 0).

α/β/γ = 0.7/0.15/0.15. The instance is *sampled* with probability score / Σ scores using the
injected RNG (one ``rng.random()`` per call); if every score is 0, uniformly (``rng.randrange``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvroute.policies.base import check_inputs
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["BAILIAN_NORMALISATIONS", "Bailian"]

BAILIAN_NORMALISATIONS = ("max", "minmax")
_EPS = 1e-6


def _ratio_to_max(values: Sequence[float]) -> tuple[float, ...]:
    top = max(values)
    return tuple(v / top if top > 0 else 0.0 for v in values)


def _minmax_up(values: Sequence[float]) -> tuple[float, ...]:
    """(v − min) / max(span, 1e-6), clamped to [0, 1]: higher value → higher term."""
    lo = min(values)
    span = max(max(values) - lo, _EPS)
    return tuple(min(max((v - lo) / span, 0.0), 1.0) for v in values)


def _minmax_down(values: Sequence[float]) -> tuple[float, ...]:
    """(max − v) / max(span, 1e-6), clamped to [0, 1]: lower value → higher term."""
    hi = max(values)
    span = max(hi - min(values), _EPS)
    return tuple(min(max((hi - v) / span, 0.0), 1.0) for v in values)


class Bailian:
    """Weighted hit/load score, sampled in proportion to the score with the injected RNG."""

    def __init__(
        self,
        rng: random.Random,
        alpha: float = 0.7,
        beta: float = 0.15,
        gamma: float = 0.15,
        normalise: str = "max",
    ) -> None:
        if normalise not in BAILIAN_NORMALISATIONS:
            raise ValueError(f"normalise must be one of {BAILIAN_NORMALISATIONS}, got {normalise!r}")
        self._rng = rng
        self.weights = (alpha, beta, gamma)
        self.normalise = normalise
        self.name = "bailian" if normalise == "max" else f"bailian:{normalise}"

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Score every instance, then sample one in proportion to its score."""
        n = check_inputs(request, instances)
        prompt = request.prompt_tokens
        hit = tuple(c / prompt if prompt > 0 else 0.0 for c in request.cached_tokens)
        bs = tuple(float(i.running + i.waiting) for i in instances)
        bsz = request.block_size
        tokens = tuple(float(i.queued_prefill_tokens + i.decode_blocks * bsz) for i in instances)
        if self.normalise == "max":
            hit_term = hit
            bs_term = tuple(1.0 - r for r in _ratio_to_max(bs))
            tok_term = tuple(1.0 - r for r in _ratio_to_max(tokens))
        else:
            hit_term = _minmax_up(hit)
            bs_term = _minmax_down(bs)
            tok_term = _minmax_down(tokens)
        a, b, g = self.weights
        scores = tuple(
            max(a * h + b * x + g * t, 0.0) for h, x, t in zip(hit_term, bs_term, tok_term, strict=True)
        )
        total = sum(scores)
        if total <= 0.0:
            choice = self._rng.randrange(n)
        else:
            r = self._rng.random() * total
            choice = n - 1
            acc = 0.0
            for pos, s in enumerate(scores):
                acc += s
                if r < acc:
                    choice = pos
                    break
        return Choice(
            choice=choice,
            scores=scores,
            policy=self.name,
            lower_is_better=False,
            detail={"hit": hit, "bs": bs, "tokens": tokens},
        )
