"""Drives one :class:`~kvroute.engine.model.EngineModel` with the wall clock on asyncio.

An :class:`~kvroute.engine.host.EngineHost` on a :class:`~kvroute.emulator.clock.WallClock`
(model time = wall seconds since ``start`` × ``time_scale``) does the stepping: it wakes at the
wall time at which the model's step in progress ends, advances the model, and hands the outputs
here (each goes to its request's queue and feeds the metrics) and the KV events to ``publish``.
Requests join at the model time of their arrival: the host first completes the steps that ended
before it, so a request never joins a step that began before it arrived. Model steps follow each
other back to back in model time, so a busy event loop delays outputs on the wall clock but never
stretches the modelled timeline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.emulator.clock import WallClock
from kvroute.emulator.metrics import EngineMetrics
from kvroute.engine.host import EngineHost
from kvroute.engine.model import EngineModel
from kvroute.engine.types import EngineOutput, EngineRequest, KVEvent, OutputKind, ReqId

__all__ = ["EngineDriver"]


@dataclass(slots=True)
class _Track:
    queue: asyncio.Queue[EngineOutput]
    arrival: float  # model seconds
    prompt_len: int
    last_time: float = 0.0
    tokens: int = 0  # output tokens reported so far


class EngineDriver:
    """Owns the model's clock. Methods are called from the event loop's thread only."""

    def __init__(
        self,
        model: EngineModel,
        time_scale: float = 1.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: EngineMetrics | None = None,
        publish: Callable[[list[KVEvent]], object] | None = None,
    ) -> None:
        self.model = model
        self.clock = WallClock(time_scale, clock)  # raises ValueError unless time_scale > 0
        self.time_scale = time_scale
        self._metrics = metrics
        self._tracks: dict[ReqId, _Track] = {}
        self.host = EngineHost(model, self.clock, self._dispatch_all, publish)

    def now(self) -> float:
        """Current model time in seconds (never decreases)."""
        return self.clock.now()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start stepping on the running loop; model time 0 is now."""
        self.clock.start()
        self.host.poll()

    async def stop(self) -> None:
        """Stop stepping; outstanding requests stay unanswered (their handlers are being closed)."""
        self.clock.close()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> asyncio.Queue[EngineOutput]:
        """Add a request now; its outputs (FIRST_TOKEN, TOKEN…, FINISHED or ABORTED; PREEMPTED when
        it happens) arrive on the returned queue. Raises ValueError from the model (e.g. duplicate id)."""
        if req.req_id in self._tracks:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        now = self.clock.now()
        track = self._tracks[req.req_id] = _Track(q, now, req.prompt_len, now)
        try:
            track.arrival = track.last_time = self.host.add(req)
        except ValueError:
            del self._tracks[req.req_id]
            raise
        return q

    def abort(self, req_id: ReqId) -> bool:
        """Abort a request (client gone): frees its blocks now. False if it already ended."""
        self._tracks.pop(req_id, None)
        return self.host.abort(req_id)

    def release(self, req_id: ReqId) -> bool:
        """Free the blocks a finished ``hold_blocks`` request kept (P/D lease over). False if none."""
        return self.host.release(req_id)

    def known(self, req_id: ReqId) -> bool:
        """Whether ``req_id`` is in use: submitted and not ended, or holding blocks."""
        return req_id in self._tracks or self.model.held(req_id) > 0

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._tracks)

    # -- outputs -------------------------------------------------------------------------------
    def _dispatch_all(self, outs: list[EngineOutput]) -> None:
        for out in outs:
            self._dispatch(out)

    def _dispatch(self, out: EngineOutput) -> None:
        track = self._tracks.get(out.req_id)
        if track is None:
            return  # aborted by us: nobody is listening
        m = self._metrics
        if out.kind in (OutputKind.FIRST_TOKEN, OutputKind.TOKEN, OutputKind.FINISHED):
            new = out.num_output_tokens - track.tokens
            if new > 0 and m is not None:
                if track.tokens == 0:
                    m.observe_first_token(out.time - track.arrival, track.prompt_len)
                    if new > 1:
                        m.observe_tokens(0.0, new - 1)
                else:
                    m.observe_tokens((out.time - track.last_time) / new, new)
            if new > 0:
                track.tokens = out.num_output_tokens
                track.last_time = out.time
        if out.kind is OutputKind.FINISHED:
            if m is not None:
                m.observe_finished(out.time - track.arrival)
            del self._tracks[out.req_id]
        elif out.kind is OutputKind.ABORTED:
            del self._tracks[out.req_id]
        track.queue.put_nowait(out)
