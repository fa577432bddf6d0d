"""Open-loop replay of a workload against an OpenAI-compatible URL, streaming every response.

Each request is sent at its arrival time (seconds after the start) whatever the state of earlier ones,
as ``POST /v1/completions`` with ``stream``, ``stream_options.include_usage``, ``max_tokens`` =
``output_len`` and ``ignore_eos``. Client-side times (seconds, ``time.perf_counter``): TTFT = first
SSE event carrying text − send time; e2e = end of stream − send time; TPOT = (e2e − TTFT) /
(output tokens − 1). ``kv_hit_rate`` = Σ ``usage.prompt_tokens_details.cached_tokens`` / Σ prompt
tokens. A request that errors or does not finish counts as unfinished.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvroute.loadgen.text import BlockText
from kvroute.metrics import LatencyRecorder
from kvroute.workloads.request import Request

__all__ = ["BenchResult", "fetch_model", "run_bench"]


@dataclass
class BenchResult:
    requests: int = 0
    unfinished: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    recorder: LatencyRecorder = field(default_factory=LatencyRecorder)
    wall_seconds: float = 0.0
    last_arrival: float = 0.0

    def summary(self, policy: str, instances: int | None) -> dict[str, Any]:
        """The `sim`-compatible JSON object (plus ``wall_seconds``, ``errors``, ``throughput_rps``)."""
        out: dict[str, Any] = {
            "policy": policy,
            "instances": instances,
            "requests": self.requests,
            "unfinished": self.unfinished,
            **self.recorder.summary(),
            "wall_seconds": self.wall_seconds,
            "throughput_rps": (self.requests - self.unfinished) / self.wall_seconds
            if self.wall_seconds
            else 0.0,
            "errors": dict(self.errors),
        }
        return out


async def fetch_model(session: aiohttp.ClientSession, url: str) -> str:
    """The first model id served at ``url`` (``/v1/models``)."""
    async with session.get(url + "/v1/models") as r:
        data = await r.json(content_type=None)
    models = data.get("data") or []
    if r.status != 200 or not models:
        raise RuntimeError(f"{url}/v1/models returned no model (status {r.status})")
    return str(models[0]["id"])


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, result: BenchResult, prompt_len: int
) -> None:
    t0 = time.perf_counter()
    first = 0.0
    tokens = 0
    usage: dict[str, Any] | None = None
    buf = b""
    try:
        async with session.post(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            if r.status != 200:
                await r.read()
                result.errors[f"http_{r.status}"] = result.errors.get(f"http_{r.status}", 0) + 1
                result.unfinished += 1
                return
            async for chunk in r.content.iter_any():
                buf += chunk
                while True:
                    i = buf.find(b"\n\n")
                    if i < 0:
                        break
                    event, buf = buf[:i], buf[i + 2 :]
                    if not event.startswith(b"data: ") or event == b"data: [DONE]":
                        continue
                    obj = orjson.loads(event[6:])
                    if "error" in obj:
                        raise RuntimeError("error event")
                    choices = obj.get("choices") or ()
                    if choices and choices[0].get("text"):
                        tokens += 1
                        if not first:
                            first = time.perf_counter()
                    if obj.get("usage"):
                        usage = obj["usage"]
        end = time.perf_counter()
    except (aiohttp.ClientError, OSError, RuntimeError, orjson.JSONDecodeError) as exc:
        key = type(exc).__name__
        result.errors[key] = result.errors.get(key, 0) + 1
        result.unfinished += 1
        return
    if not first:
        result.unfinished += 1
        result.errors["no_tokens"] = result.errors.get("no_tokens", 0) + 1
        return
    out_tokens = int(usage["completion_tokens"]) if usage else tokens
    prompt = int(usage["prompt_tokens"]) if usage else prompt_len
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = int(details.get("cached_tokens") or 0)
    result.recorder.add(t0, first, end, prompt, cached, out_tokens)


async def run_bench(
    url: str,
    requests: Iterable[Request],
    text: BlockText,
    model: str | None = None,
    drain_timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
) -> BenchResult:
    """Replay ``requests`` against ``url`` (base URL without ``/v1``) open-loop; see the module doc."""
    result = BenchResult()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=drain_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if model is None:
            model = await fetch_model(session, url)
        tasks: set[asyncio.Task[None]] = set()
        start = time.perf_counter()
        for req in requests:
            prompt = text.prompt(req.block_ids, req.block_size, req.prompt_len, req.req_id)
            body = orjson.dumps(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": req.output_len,
                    "min_tokens": req.output_len,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            )
            delay = start + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            result.requests += 1
            result.last_arrival = req.arrival
            task = asyncio.create_task(_one(session, url, body, result, req.prompt_len))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if progress is not None:
                progress(result.requests, result.recorder.finished)
        if tasks:
            _done, pending = await asyncio.wait(set(tasks), timeout=drain_timeout_s)
            for t in pending:
                t.cancel()
            result.unfinished += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        result.wall_seconds = time.perf_counter() - start
    return result
