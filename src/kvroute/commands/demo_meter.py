"""The main job's arms on level ground, and what each arm cost the process that runs them.

`kvroute demo` runs the router and the load generator in one process (one event loop), arm after arm;
each arm gets fresh engines and a fresh router, but this process carries over from one arm to the
next. Two things it carries would otherwise tilt the comparison by the arms' order:

- the load generator's prompt text: the first arm to send a block makes its text (a few microseconds
  per token) and caches it, so on the default job the first arm's client spent ≈ 0.4 ms more CPU per
  request on the same event loop as the router than every later arm's;
- the cyclic garbage collector: what earlier arms left alive stays on the heap, so every full
  collection in a later arm walks it again (a pause of the whole event loop).

:func:`level` removes both before an arm (every prompt block made once, before any arm; a full
collection, then everything alive frozen out of the collector's walks), and :class:`ArmMeter` records
what the arm cost this process: CPU seconds (router, load generator and the tokenizer thread
together), collector passes and pauses, and prompt blocks the load generator still had to make (0 once
levelled). These are the figures that tell a policy's own router cost from the machine's.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from kvroute.loadgen.text import BlockText
from kvroute.workloads.request import Request

__all__ = ["ArmCost", "ArmMeter", "level", "unlevel"]


def level(text: BlockText, requests: Iterable[Request]) -> None:
    """Before an arm: make (and cache) the text of every prompt block of ``requests``, run a full
    collection and freeze everything alive (``gc.freeze``), so the arm's full collections walk only what
    the arm itself allocates. Mutates ``text``'s cache and the collector's state (:func:`unlevel`
    undoes the freeze)."""
    for r in requests:
        for b in r.block_ids:
            text.block(b, r.block_size)
    gc.collect()
    gc.freeze()


def unlevel() -> None:
    """After the job: give what :func:`level` froze back to the collector."""
    gc.unfreeze()


@dataclass(frozen=True)
class ArmCost:
    """What one arm cost this process.

    - ``cpu_s``: CPU seconds of this process (all its threads: router, load generator, tokenizer);
    - ``gc_passes``: cyclic-collector passes of every generation; ``gc_full``: full (generation-2) ones;
    - ``gc_pause_s``: wall seconds the collector held the event loop, all passes together;
    - ``text_blocks``: prompt blocks whose text the load generator had to make during the arm.
    """

    cpu_s: float
    gc_passes: int
    gc_full: int
    gc_pause_s: float
    text_blocks: int


class ArmMeter:
    """A context manager around one arm: on exit, :attr:`cost` holds what the arm cost (see
    :class:`ArmCost`). It adds a ``gc.callbacks`` entry while open and removes it on exit."""

    def __init__(self, text: BlockText) -> None:
        self._text = text
        self._cpu0 = 0.0
        self._made0 = 0
        self._passes = 0
        self._full = 0
        self._pause_s = 0.0
        self._started = 0.0
        self.cost: ArmCost | None = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        self._pause_s += time.perf_counter() - self._started
        self._passes += 1
        if info.get("generation") == 2:
            self._full += 1

    def __enter__(self) -> ArmMeter:
        self._cpu0 = time.process_time()
        self._made0 = self._text.made
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        gc.callbacks.remove(self._on_gc)
        self.cost = ArmCost(
            cpu_s=time.process_time() - self._cpu0,
            gc_passes=self._passes,
            gc_full=self._full,
            gc_pause_s=self._pause_s,
            text_blocks=self._text.made - self._made0,
        )
