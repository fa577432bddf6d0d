"""kvroute's emulated engine as a Ray Serve deployment body: one :class:`EngineModel` per replica.

The same engine model, request validation (:mod:`kvroute.emulator.protocol`) and driver
(:class:`~kvroute.emulator.driver.EngineDriver`, the model under the wall clock) as
``kvroute engine``; only the transport differs: a handle call with an OpenAI body instead of HTTP.
Decorate it where it is deployed (``serve.deployment(EmulatedEngine)``), as the example and the tests
do, so that Ray is imported only there.

``__call__(body)`` is a generator (call the handle with ``.options(stream=True)``): it yields the
first token as ``{"id", "text", "first": True}``, then one item with the rest of the text,
``usage`` (with ``prompt_tokens_details.cached_tokens``) and ``replica`` (the replica's unique id)
when the request finishes. Two items,
not one per token: each streamed item is a Ray object transfer, and per-token items would measure
Ray's overhead on a small machine rather than the routing. A malformed body yields one
``{"error": {...}, "status": 4xx}`` item (the emulator's OpenAI error JSON).

``record_routing_stats()`` reports what :mod:`kvroute.integrations.ray_serve` reads (see
:data:`kvroute.integrations.inflight.STAT_KEYS`): the model's load now, the wall ``time`` of the
snapshot, ``usage`` (``[internal request id, cached tokens]`` of the last finished requests),
``requests`` (``[internal request id, prefill tokens left]`` of each request the snapshot's
``running`` and ``waiting`` count, read at the same instant: the router then knows which of its
requests the snapshot counts, whatever the transport's delays), ``ttft_p50_s`` (the median engine-side time from a request's submission to its first token over the
last requests, seconds: the router's estimate of where a request's prefill ends) and,
with ``kv_events=True``, ``kv_events_endpoint``: a ZMQ PUB socket (vLLM's wire format) on a free
loopback port of the replica's machine, which makes the routers' view of this replica exact.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator
from typing import Any

from kvroute.blocks import hash_blocks
from kvroute.emulator.driver import EngineDriver
from kvroute.emulator.protocol import ApiError, GenerateRequest, parse_chat, parse_completion
from kvroute.emulator.publisher import KVEventPublisher
from kvroute.emulator.server import FILLER_WORDS
from kvroute.engine import cost as costmod
from kvroute.engine.model import EngineModel
from kvroute.engine.types import EngineConfig, EngineRequest, OutputKind
from kvroute.integrations.prompts import body_of
from kvroute.tokenizer import load_tokenizer

__all__ = ["EmulatedEngine"]

_USAGE_KEPT = 256  # finished requests reported in routing stats (newest last)
_TTFT_KEPT = 64  # first-token times behind ttft_p50_s (the latest requests)


class EmulatedEngine:
    """One emulated engine replica (module docstring). ``kv_blocks``: KV pool size in blocks (None:
    what the profile's GPU holds); ``time_scale``: model seconds per wall second."""

    def __init__(
        self,
        profile: str | None = None,
        kv_blocks: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 4096,
        time_scale: float = 1.0,
        default_max_tokens: int = 256,
        model_name: str = "kvroute-emulated",
        kv_events: bool = False,
    ) -> None:
        prof = costmod.get_profile(profile or costmod.DEFAULT_PROFILE)
        if kv_blocks is None:
            kv_blocks = costmod.kv_capacity_tokens(prof.gpu, prof.model) // block_size
        self.config = EngineConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            num_kv_blocks=kv_blocks,
            block_size=block_size,
            max_model_len=min(kv_blocks * block_size, 262144),
            report_tokens=True,
        )
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.tokenizer = load_tokenizer()
        self.model = EngineModel(self.config, prof.cost)
        self.publisher: KVEventPublisher | None = None
        self._endpoint: str | None = None
        if kv_events:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self._endpoint = f"tcp://127.0.0.1:{port}"
            self.publisher = KVEventPublisher(self._endpoint)
        pub = self.publisher
        self.driver = EngineDriver(
            self.model, time_scale, publish=(lambda ev: pub.publish(ev)) if pub is not None else None
        )
        self._started = False
        self._usage: deque[list[Any]] = deque(maxlen=_USAGE_KEPT)
        self._ttfts: deque[float] = deque(maxlen=_TTFT_KEPT)  # seconds, submission → first token
        self._keys: dict[str, str] = {}  # engine request id → Ray's internal request id, while live
        self._filler = [self.tokenizer.encode(" " + w)[0] for w in FILLER_WORDS]
        self.served = 0

    def _start(self) -> None:
        if not self._started:  # the replica's event loop runs by now
            if self.publisher is not None:
                self.publisher.start()
            self.driver.start()
            self._started = True

    def _parse(self, body: Any) -> GenerateRequest:
        if not isinstance(body, dict):  # a pydantic request (Ray Serve LLM passes those) or similar
            found = body_of([body], {})
            body = dict(found) if found is not None else body
        if isinstance(body, dict) and "messages" in body:
            return parse_chat(
                body, self.tokenizer, self.model_name, self.config.max_model_len, self.default_max_tokens
            )
        return parse_completion(body, self.tokenizer, self.model_name, self.config.max_model_len)

    async def __call__(self, body: Any) -> AsyncGenerator[dict[str, Any], None]:
        self._start()
        try:
            req = self._parse(body)
        except ApiError as exc:
            yield {**exc.body(), "status": exc.status}
            return
        from ray import serve

        ctx = serve.context._get_serve_request_context()
        key = ctx._internal_request_id or ctx.request_id or uuid.uuid4().hex
        rid = f"ray-{uuid.uuid4().hex}"
        hashes = tuple(hash_blocks(req.prompt_ids, self.config.block_size))
        submitted = time.monotonic()
        queue = self.driver.submit(
            EngineRequest(rid, len(req.prompt_ids), req.max_tokens, hashes, req.prompt_ids)
        )
        self._keys[rid] = key
        cached, sent, done = 0, 0, False
        try:
            while not done:
                out = await queue.get()
                if out.kind is OutputKind.ABORTED:
                    yield {
                        "error": {"message": "aborted by the engine", "type": "server_error"},
                        "status": 500,
                    }
                    return
                if out.kind is OutputKind.FIRST_TOKEN:
                    cached = out.num_cached_tokens
                    self._ttfts.append(time.monotonic() - submitted)
                    yield {"id": rid, "text": self._text(0, 1), "first": True}
                    sent = 1
                done = out.kind is OutputKind.FINISHED
            self._usage.append([key, cached])
            self.served += 1
            usage = {
                "prompt_tokens": len(req.prompt_ids),
                "completion_tokens": req.max_tokens,
                "total_tokens": len(req.prompt_ids) + req.max_tokens,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            replica = serve.get_replica_context().replica_id.unique_id
            yield {"id": rid, "text": self._text(sent, req.max_tokens), "usage": usage, "replica": replica}
        finally:
            self._keys.pop(rid, None)
            if not done:
                self.driver.abort(rid)

    def _text(self, start: int, stop: int) -> str:
        f = self._filler
        return self.tokenizer.decode([f[i % len(f)] for i in range(start, stop)])

    def record_routing_stats(self) -> dict[str, Any]:
        """Load now (module docstring); Ray Serve calls it every ``request_routing_stats_period_s``."""
        load = self.model.load()
        keys = self._keys
        stats: dict[str, Any] = {
            "running": load.running,
            "waiting": load.waiting,
            "queued_prefill_tokens": load.queued_prefill_tokens,
            "kv_usage": load.kv_usage,
            "kv_capacity_blocks": load.kv_capacity_blocks,
            "max_num_batched_tokens": self.model.config.max_num_batched_tokens,
            "max_num_seqs": self.model.config.max_num_seqs,
            "time": time.time(),
            "usage": list(self._usage),
            "requests": [[keys[r], left] for r, left in self.model.in_flight() if r in keys],
            "served": self.served,
        }
        if self._ttfts:
            stats["ttft_p50_s"] = statistics.median(self._ttfts)
        if self._endpoint is not None:
            stats["kv_events_endpoint"] = self._endpoint
        return stats
