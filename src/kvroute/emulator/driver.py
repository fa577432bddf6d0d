"""Drives one :class:`~kvroute.engine.model.EngineModel` with the wall clock on asyncio.

Model time (seconds) = (clock() − start) × ``time_scale``. One task sleeps until the wall time at
which the model's step in progress ends (or until a request arrives or leaves), calls
``advance``, hands each output to its request's queue, feeds the metrics and publishes the KV
events. Requests join at the model time of their arrival: before adding one the driver first
advances the model to that time, so a request never joins a step that began before it arrived.
Model steps follow each other back to back in model time, so a busy event loop delays outputs on
the wall clock but never stretches the modelled timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.emulator.metrics import EngineMetrics
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
        if not time_scale > 0:
            raise ValueError("time_scale must be positive")
        self.model = model
        self.time_scale = time_scale
        self._clock = clock
        self._metrics = metrics
        self._publish = publish
        self._t0 = clock()
        self._last = 0.0
        self._tracks: dict[ReqId, _Track] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- clock ---------------------------------------------------------------------------------
    def now(self) -> float:
        """Current model time in seconds (never decreases)."""
        self._last = max(self._last, (self._clock() - self._t0) * self.time_scale)
        return self._last

    def _wall_delay(self, model_t: float) -> float:
        """Wall seconds from now until model time ``model_t``."""
        return self._t0 + model_t / self.time_scale - self._clock()

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the stepping task on the running loop; model time 0 is now."""
        self._t0 = self._clock()
        self._last = 0.0
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvroute-engine-driver")

    async def stop(self) -> None:
        """Stop stepping; outstanding requests stay unanswered (their handlers are being closed)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- requests ------------------------------------------------------------------------------
    def submit(self, req: EngineRequest) -> asyncio.Queue[EngineOutput]:
        """Add a request now; its outputs (FIRST_TOKEN, TOKEN…, FINISHED or ABORTED; PREEMPTED when
        it happens) arrive on the returned queue. Raises ValueError from the model (e.g. duplicate id)."""
        now = self.now()
        self._advance(now)
        self.model.add_request(req, now)
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._tracks[req.req_id] = _Track(q, now, req.prompt_len, now)
        self._flush_events()
        self._wake.set()
        return q

    def abort(self, req_id: ReqId) -> bool:
        """Abort a request (client gone): frees its blocks now. False if it already ended."""
        self._tracks.pop(req_id, None)
        now = self.now()
        self._advance(now)
        done = self.model.abort(req_id, now)
        self._flush_events()
        self._wake.set()
        return done

    @property
    def active(self) -> int:
        """Requests submitted and not yet finished or aborted."""
        return len(self._tracks)

    # -- stepping ------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()
            t = self.model.next_time()
            if t is None:
                await self._wake.wait()
                continue
            delay = self._wall_delay(t)
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                if self._wall_delay(t) > 1e-9:
                    continue  # woken early by a request: re-plan
            self._advance(max(self.now(), t))
            await asyncio.sleep(0)  # let handlers run between steps even when the loop lags

    def _advance(self, now: float) -> None:
        self._last = max(self._last, now)
        for out in self.model.advance(now):
            self._dispatch(out)
        self._flush_events()

    def _flush_events(self) -> None:
        events = self.model.take_events()
        if events and self._publish is not None:
            self._publish(events)

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
