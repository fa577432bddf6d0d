"""The KV transfer of prefill/decode disaggregation, as one pure model for every driver.

A prefill instance (P) computes a prompt's KV; a decode instance (D) reads the blocks it lacks over a
link (NIXL pull in vLLM) before it computes the first token itself. The emulated engine (D waits this
long before it decodes), the simulator (the D leg starts this long after P finished) and the router (the
conditional skip of P) all ask this module, so they agree.

- :class:`TransferModel`: seconds to move ``tokens`` tokens of KV = ``latency_s`` + tokens × KV bytes
  per token / link bandwidth. KV bytes per token come from the model config
  (:attr:`kvroute.engine.modelconfig.ModelShape.kv_bytes_per_token`), the bandwidth from a flag.
- :func:`prefill_seconds`: what an engine's own cost model says computing ``tokens`` prompt tokens
  after ``context`` cached ones takes, chunk by chunk (``max_num_batched_tokens``), with no other work in
  the step (a lower bound on a busy engine).
- :func:`prefill_locally`: the conditional-disaggregation test: skip P when D computes its uncached
  remainder no slower than the transfer of that remainder takes.

Units: seconds, tokens, bytes, bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.engine.types import CostModel

__all__ = ["DEFAULT_BANDWIDTH_GBPS", "TransferModel", "prefill_locally", "prefill_seconds"]

# 25 GB/s: one 200 Gb/s RDMA NIC per GPU (ConnectX-6/7 class), the usual inter-node P/D link. A flag
# (``--kv-transfer-bandwidth``) overrides it; an NVLink pair is ~10x more.
DEFAULT_BANDWIDTH_GBPS = 25.0


@dataclass(frozen=True, slots=True)
class TransferModel:
    """A point-to-point KV link. ``kv_bytes_per_token``: bytes of KV one token occupies over all layers
    (what P sends per token); ``bandwidth_bytes_per_s`` > 0; ``latency_s`` >= 0: fixed cost per
    transfer (handshake, notification)."""

    kv_bytes_per_token: float
    bandwidth_bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.kv_bytes_per_token > 0:
            raise ValueError("kv_bytes_per_token must be positive")
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError("the link bandwidth must be positive")
        if not self.latency_s >= 0:
            raise ValueError("the transfer latency must be >= 0")

    @classmethod
    def from_gbps(cls, kv_bytes_per_token: float, gbps: float, latency_s: float = 0.0) -> TransferModel:
        """A link of ``gbps`` gigabytes (1e9 bytes) per second."""
        return cls(kv_bytes_per_token, gbps * 1e9, latency_s)

    def seconds(self, tokens: int) -> float:
        """Seconds to move the KV of ``tokens`` tokens (0 tokens: nothing moves, 0 s)."""
        if tokens <= 0:
            return 0.0
        return self.latency_s + tokens * self.kv_bytes_per_token / self.bandwidth_bytes_per_s


def prefill_seconds(cost: CostModel, tokens: int, context: int, chunk: int) -> float:
    """Seconds the cost model gives ``tokens`` prompt tokens computed after ``context`` tokens already
    in KV, in chunks of at most ``chunk`` tokens, one chunk per step and nothing else in the step."""
    if tokens <= 0:
        return 0.0
    if chunk <= 0:
        raise ValueError("chunk must be positive")
    total = 0.0
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        total += cost.step_time([(n, context + done)], 0, 0)
        done += n
    return total


def prefill_locally(
    uncached_tokens: int, cached_tokens: int, cost: CostModel, transfer: TransferModel, chunk: int
) -> tuple[bool, float, float]:
    """Whether D should prefill the request itself: ``(skip P, D's prefill seconds, transfer seconds)``.
    D's prefill is of its ``uncached_tokens`` after its ``cached_tokens``; the transfer moves the same
    tokens, after which D still computes the last prompt token again (vLLM's NIXL consumer), so that
    step is added to the transfer's side."""
    local = prefill_seconds(cost, uncached_tokens, cached_tokens, chunk)
    moved = transfer.seconds(uncached_tokens)
    last = prefill_seconds(cost, 1, cached_tokens + max(uncached_tokens - 1, 0), chunk)
    return local <= moved + last, local, moved + last
