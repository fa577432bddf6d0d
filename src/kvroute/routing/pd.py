"""The P/D routing step: one request → a prefill instance (or none) and a decode instance, with why.

Prefill/decode disaggregation routes each request twice through the one routing core
(:class:`~kvroute.routing.core.RoutingCore`), once per pool; the live router (``kvroute serve
--prefill … --decode …``) and the simulator (:mod:`kvroute.sim.pd`) both call :meth:`PDRouter.route`.

1. **D** is chosen by the policy's *load term* over the decode instances: the same policy, asked about
   a request that every D holds equally (no chain, one prompt token: D computes only the last prompt
   token after the transfer), so cache terms tie and what is left decides (for lmetric: (1 + queued
   prefill) × BS; for llm-d's scorers: queue and KV usage).
2. **Conditional disaggregation**: D's own cached prefix of the prompt comes from D's KV view. When D
   computes the uncached remainder no slower than the transfer of it would take, by the engine model's
   cost model and the transfer model (:func:`kvroute.engine.transfer.prefill_locally`), P is skipped and
   D prefills locally (``reason="local_prefill"``).
3. **P** is chosen by the policy over the prefill instances with the full request: P-token counts the
   prefill queued on each P, the KV view is P's (from P's events).

Pure: no I/O, no clock (``now`` is given), no globals; mutates only the cores (policy and feature state).
Units: tokens, seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvroute.engine.transfer import TransferModel, prefill_locally
from kvroute.engine.types import CostModel
from kvroute.routing.core import Decision, RouteRequest, RoutingCore
from kvroute.views import InstanceView

__all__ = ["PD_REASONS", "PDDecision", "PDRouter"]

PD_REASONS = ("disaggregated", "local_prefill", "no_prefill_instance", "refused")


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Both choices for one request.

    - ``decode``: the D decision (its ``instance`` is None only when refused).
    - ``prefill``: the P decision, or None when P is skipped.
    - ``reason``: ``disaggregated`` (P then D), ``local_prefill`` (the conditional skip: D prefills),
      ``no_prefill_instance`` (the P pool is empty), ``refused`` (a quota said no).
    - ``decode_cached_tokens``: the prompt tokens D's KV view says D holds (full blocks, capped as the
      core caps them); ``local_prefill_s``: D's modelled prefill of the rest; ``transfer_s``: the
      modelled transfer of the rest plus D's last-token step (0 and 0 when not compared).
    """

    decode: Decision
    prefill: Decision | None
    reason: str
    decode_cached_tokens: int
    local_prefill_s: float = 0.0
    transfer_s: float = 0.0

    @property
    def skipped(self) -> bool:
        return self.prefill is None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able explanation of both choices and why."""
        return {
            "reason": self.reason,
            "decode_cached_tokens": self.decode_cached_tokens,
            "local_prefill_ms": self.local_prefill_s * 1e3,
            "transfer_ms": self.transfer_s * 1e3,
            "prefill": None if self.prefill is None else self.prefill.to_dict(),
            "decode": self.decode.to_dict(),
        }


class PDRouter:
    """Routes over a prefill core and a decode core (module docstring). ``cost``: the engine model's
    cost model (D's prefill time); ``transfer``: the link; ``chunk``: D's ``max_num_batched_tokens``;
    ``conditional=False`` never skips P (always disaggregate)."""

    def __init__(
        self,
        prefill: RoutingCore,
        decode: RoutingCore,
        cost: CostModel,
        transfer: TransferModel,
        chunk: int,
        conditional: bool = True,
    ) -> None:
        if chunk <= 0:
            raise ValueError("chunk must be positive")
        self.prefill = prefill
        self.decode = decode
        self.cost = cost
        self.transfer = transfer
        self.chunk = chunk
        self.conditional = conditional

    def route(
        self,
        req: RouteRequest,
        prefill_views: Sequence[InstanceView],
        decode_views: Sequence[InstanceView],
        now: float,
        exclude_prefill: frozenset[int] = frozenset(),
    ) -> PDDecision:
        """Choose D among ``decode_views`` (non-empty) and P among ``prefill_views`` less
        ``exclude_prefill`` (indices already tried), or skip P. Mutates the cores' policy state."""
        d_req = replace(req, chain=(), prompt_tokens=1, token_ids=None)
        d = self.decode.route(d_req, decode_views, now)
        if d.instance is None:
            return PDDecision(d, None, "refused", 0)
        prompt = req.prompt_tokens
        bs = self.decode.block_size
        cap = (prompt - 1) // bs if prompt > 0 else 0
        d_cached = min(self.decode.kv.match(req.chain, now)[d.instance], cap) * bs
        local = moved = 0.0
        if self.conditional:
            skip, local, moved = prefill_locally(
                prompt - d_cached, d_cached, self.cost, self.transfer, self.chunk
            )
            if skip:
                return PDDecision(d, None, "local_prefill", d_cached, local, moved)
        views = [v for v in prefill_views if v.index not in exclude_prefill]
        if not views:
            return PDDecision(d, None, "no_prefill_instance", d_cached, local, moved)
        p = self.prefill.route(req, views, now)
        if p.instance is None:
            return PDDecision(d, p, "refused", d_cached, local, moved)
        return PDDecision(d, p, "disaggregated", d_cached, local, moved)
