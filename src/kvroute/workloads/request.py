"""The workload request: what traces and synthetic generators produce, and the simulator and the
load generator consume."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    - ``arrival``: seconds since the workload's start (already divided by any rate scale).
    - ``prompt_len``/``output_len``: tokens (output_len >= 1).
    - ``block_ids``: chained ids of the prompt's *full* blocks of ``block_size`` tokens; equal leading
      ids mean an equal prefix (trace hash ids are used as is; synthetic workloads make their own).
      ``len(block_ids) == prompt_len // block_size``.
    - ``session``: conversation / agent id (-1 if none); ``user`` and ``req_class`` feed quotas and
      request classes.
    """

    req_id: int
    arrival: float
    prompt_len: int
    output_len: int
    block_ids: tuple[int, ...]
    block_size: int
    session: int = -1
    user: str | None = None
    req_class: str = "default"


Workload = Iterator[Request]
"""A stream of requests in non-decreasing arrival order."""
