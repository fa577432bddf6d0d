"""Limits (design §6.1): a P-token cap, spot instances kept out of long requests, per-user quotas.

- **P-token cap** (``p_token_cap`` tokens): an instance whose P-token for this request (uncached
  prompt tokens + prefill tokens queued there) exceeds the cap is not chosen while another is within it.
- **Spot instances**: instances tagged ``spot_tag`` (``InstanceView.tags``) are not chosen for a
  *long* request — ``prompt_tokens + max_tokens > spot_max_tokens`` — while a non-spot one is
  eligible (a preempted spot instance would lose the most work on those).
- **Quotas** (:class:`TokenBuckets`): one token bucket per key (the request's ``user`` field, or its
  API key in the router; requests with neither share the key ``"-"``), refilled at
  ``tokens_per_s`` up to ``burst``. A request costs ``prompt_tokens + max_tokens`` tokens (capped at
  ``burst``, so a big request waits for a full bucket instead of never passing). Over quota →
  rejected with the seconds until enough tokens are back (HTTP 429 with ``Retry-After`` in the router,
  counted as ``quota_rejected`` in the simulator).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.errors import UserError
from kvroute.views import InstanceView, RequestView

__all__ = ["LimitsConfig", "QuotaConfig", "TokenBuckets", "limit_mask", "narrow_mask"]

ANONYMOUS = "-"


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """``None`` turns a limit off."""

    p_token_cap: int | None = None
    spot_max_tokens: int | None = None
    spot_tag: str = "spot"

    def check(self) -> LimitsConfig:
        if self.p_token_cap is not None and self.p_token_cap < 0:
            raise UserError(f"--p-token-cap must be >= 0 (got {self.p_token_cap})")
        if self.spot_max_tokens is not None and self.spot_max_tokens < 0:
            raise UserError(f"spot max tokens must be >= 0 (got {self.spot_max_tokens})")
        return self

    @property
    def active(self) -> bool:
        return self.p_token_cap is not None or self.spot_max_tokens is not None


def narrow_mask(mask: list[bool], keep: Sequence[bool]) -> tuple[list[bool], int]:
    """``mask AND keep`` if that leaves an instance, else ``mask``; and how many it excluded."""
    new = [a and b for a, b in zip(mask, keep, strict=True)]
    if any(new):
        return new, sum(mask) - sum(new)
    return mask, 0


def limit_mask(
    request: RequestView,
    instances: Sequence[InstanceView],
    p_token: Sequence[int],
    config: LimitsConfig,
    mask: list[bool],
) -> tuple[list[bool], int, int]:
    """Apply the spot rule then the P-token cap to ``mask`` (each only if it leaves an instance);
    returns the new mask and how many instances each rule excluded."""
    spot_out = cap_out = 0
    limit = config.spot_max_tokens
    if limit is not None and request.prompt_tokens + request.max_tokens > limit:
        tag = config.spot_tag
        mask, spot_out = narrow_mask(mask, [tag not in v.tags for v in instances])
    cap = config.p_token_cap
    if cap is not None:
        mask, cap_out = narrow_mask(mask, [p <= cap for p in p_token])
    return mask, spot_out, cap_out


QUOTA_KEYS = ("user", "api_key")


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    """Per-key token bucket: refill ``tokens_per_s``, size ``burst`` tokens. ``key`` (router only):
    which identity owns the bucket, ``"user"`` (the body's ``user`` field, else the API key) or
    ``"api_key"`` (the bearer token, else the ``user`` field)."""

    tokens_per_s: float
    burst: float
    key: str = "user"

    def check(self) -> QuotaConfig:
        if not self.tokens_per_s > 0 or not self.burst > 0:
            raise UserError("quota: tokens per second and burst must be > 0")
        if self.key not in QUOTA_KEYS:
            raise UserError(f"quota: key must be one of {', '.join(QUOTA_KEYS)}, got {self.key!r}")
        return self


class TokenBuckets:
    """Token buckets keyed by user / API key. ``take`` mutates; buckets that are full again are
    dropped now and then, so memory follows the number of recently active keys."""

    PRUNE_EVERY = 4096

    def __init__(self, config: QuotaConfig) -> None:
        self.config = config.check()
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens at time, time)
        self._takes = 0
        self.admitted = 0
        self.rejected = 0

    def level(self, key: str, now: float) -> float:
        """Tokens in ``key``'s bucket at ``now`` (a new key's bucket is full)."""
        cfg = self.config
        state = self._buckets.get(key)
        if state is None:
            return cfg.burst
        tokens, at = state
        return min(cfg.burst, tokens + max(0.0, now - at) * cfg.tokens_per_s)

    def take(self, key: str | None, cost: float, now: float) -> float:
        """Charge ``cost`` tokens to ``key`` (None → the anonymous key) at ``now``. Returns 0.0 when
        admitted, else the seconds until the bucket holds enough (nothing is charged then)."""
        cfg = self.config
        k = ANONYMOUS if key is None else key
        need = min(max(cost, 0.0), cfg.burst)
        have = self.level(k, now)
        self._takes += 1
        if self._takes % self.PRUNE_EVERY == 0:
            self._prune(now)
        if have >= need:
            self._buckets[k] = (have - need, now)
            self.admitted += 1
            return 0.0
        self._buckets[k] = (have, now)
        self.rejected += 1
        return (need - have) / cfg.tokens_per_s

    def _prune(self, now: float) -> None:
        full = [k for k in self._buckets if self.level(k, now) >= self.config.burst]
        for k in full:
            del self._buckets[k]

    def __len__(self) -> int:
        return len(self._buckets)
