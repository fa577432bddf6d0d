"""Tiny builders for policy tests."""

from __future__ import annotations

from kvroute.views import InstanceView, RequestView


def make_instances(*loads: tuple[int, ...], **common: object) -> list[InstanceView]:
    """One InstanceView per tuple ``(running, waiting[, queued_prefill_tokens])``; index = position."""
    out = []
    for i, load in enumerate(loads):
        running, waiting, *rest = load
        queued = rest[0] if rest else 0
        out.append(InstanceView(index=i, running=running, waiting=waiting, queued_prefill_tokens=queued))
    return out


def make_request(prompt: int, cached: tuple[int, ...] | list[int], block_size: int = 16) -> RequestView:
    """A request of ``prompt`` tokens with the given per-instance cached prefix (tokens)."""
    return RequestView(
        prompt_tokens=prompt,
        cached_tokens=tuple(cached),
        num_blocks=prompt // block_size,
        block_size=block_size,
    )
