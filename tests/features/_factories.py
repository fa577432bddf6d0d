"""Tiny builders for feature tests."""

from __future__ import annotations

import dataclasses

from kvroute.views import InstanceView, RequestView


def insts(*bs: int, kv: float = 0.0, **per: object) -> list[InstanceView]:
    """One idle-prefill InstanceView per BS value (all of it running); index = position."""
    return [InstanceView(index=i, running=b, kv_usage=kv) for i, b in enumerate(bs)]


def req(prompt: int, cached: list[int] | tuple[int, ...], **kw: object) -> RequestView:
    r = RequestView(prompt_tokens=prompt, cached_tokens=tuple(cached), num_blocks=prompt // 16, block_size=16)
    return dataclasses.replace(r, **kw) if kw else r
