"""Multi-turn streamed chat against an OpenAI-compatible URL: conversations that grow turn by turn.

A :class:`ChatLoad` is ``conversations`` conversations of ``turns`` turns each. Conversation ``c``
opens with one of ``system_prompts`` shared system prompts (``system_tokens`` words) and sends its
turn ``t`` at ``start_c + t * gap_s`` seconds (``start_c`` spread evenly over the first gap), so the
offered rate is ``conversations / gap_s`` requests per second from the first second to the last.
Turn ``t``'s body holds the system prompt, every earlier user message and the assistant replies as
streamed back, then a new user message of a random length in ``user_tokens``: each turn extends the
conversation's previous prompt, as a chat client's history does. A turn whose previous reply has
not ended by its send time waits for it (a conversation is sequential); the wait is reported as lag.

Text comes from :class:`~kvroute.loadgen.text.BlockText` words (one token each), a pure function of
``(salt, ids)``: two loads with the same structure seed and different salts have identical lengths,
sharing pattern and arrival times but no text in common, so that runs through different routers in
front of the same engines never hit each other's cache.

Client-side times (seconds, ``time.perf_counter``): TTFT = first SSE chunk carrying content − send
time; e2e = end of stream − send time. ``cached_tokens`` and ``prompt_tokens`` are the engine's
``usage``. Every request is ``stream`` with ``stream_options.include_usage``, ``max_tokens`` =
``output_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvroute.loadgen.text import BlockText
from kvroute.metrics import LatencyRecorder

__all__ = ["ChatLoad", "ChatResult", "ChatTurn", "run_chat"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class ChatTurn:
    """One request of a conversation. ``arrival``: seconds after the start; ``user_tokens``: words of
    this turn's new user message."""

    conv: int
    turn: int
    arrival: float
    system: int
    user_tokens: int


@dataclass(frozen=True, slots=True)
class ChatLoad:
    """The structure of a multi-turn chat load (see the module doc). Rates in requests per second,
    times in seconds, sizes in tokens."""

    conversations: int
    turns: int = 4
    gap_s: float = 1.0
    system_prompts: int = 8
    system_tokens: int = 1024
    user_tokens: tuple[int, int] = (32, 256)
    output_tokens: int = 4

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("conversations, turns and system_prompts must be >= 1")
        if self.gap_s <= 0 or self.output_tokens < 1:
            raise ValueError("gap_s must be > 0 and output_tokens >= 1")
        lo, hi = self.user_tokens
        if not 1 <= lo <= hi:
            raise ValueError("user_tokens must be (lo, hi) with 1 <= lo <= hi")

    @property
    def rate(self) -> float:
        """Offered requests per second."""
        return self.conversations / self.gap_s

    @property
    def duration_s(self) -> float:
        """Seconds from the first planned send to the last."""
        return (self.turns - 1) * self.gap_s + (self.conversations - 1) * self.gap_s / self.conversations

    def plan(self, seed: int) -> list[list[ChatTurn]]:
        """Each conversation's turns, in order; a pure function of ``seed``."""
        rng = random.Random(seed)
        lo, hi = self.user_tokens
        out = []
        for c in range(self.conversations):
            start = c * self.gap_s / self.conversations
            system = rng.randrange(self.system_prompts)
            out.append(
                [
                    ChatTurn(c, t, start + t * self.gap_s, system, rng.randint(lo, hi))
                    for t in range(self.turns)
                ]
            )
        return out


@dataclass
class ChatResult:
    """What one run measured. ``lag_s``: the largest delay of a send behind its planned time."""

    requests: int = 0
    unfinished: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    recorder: LatencyRecorder = field(default_factory=LatencyRecorder)
    wall_seconds: float = 0.0
    lag_s: float = 0.0

    def error(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1
        self.unfinished += 1


def _mix(*parts: int) -> int:
    x = 0x243F6A8885A308D3
    for p in parts:
        x = ((x ^ (p & _MASK64)) * 0x100000001B3) & _MASK64
        x ^= x >> 29
    return x


async def _send(session: aiohttp.ClientSession, url: str, body: bytes, result: ChatResult) -> str | None:
    """One streamed chat request; returns the reply text, or None when it failed (counted)."""
    t0 = time.perf_counter()
    first = 0.0
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    buf = b""
    try:
        async with session.post(
            url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
        ) as r:
            if r.status != 200:
                await r.read()
                result.error(f"http_{r.status}")
                return None
            async for data in r.content.iter_any():
                buf += data
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
                    if choices:
                        text = (choices[0].get("delta") or {}).get("content")
                        if text:
                            parts.append(text)
                            if not first:
                                first = time.perf_counter()
                    if obj.get("usage"):
                        usage = obj["usage"]
        end = time.perf_counter()
    except (aiohttp.ClientError, OSError, RuntimeError, orjson.JSONDecodeError) as exc:
        result.error(type(exc).__name__)
        return None
    if not first or usage is None:
        result.error("no_tokens" if not first else "no_usage")
        return None
    details = usage.get("prompt_tokens_details") or {}
    result.recorder.add(
        t0,
        first,
        end,
        int(usage["prompt_tokens"]),
        int(details.get("cached_tokens") or 0),
        int(usage["completion_tokens"]),
    )
    return "".join(parts)


async def _conversation(
    session: aiohttp.ClientSession,
    target: Callable[[ChatTurn], str],
    turns: list[ChatTurn],
    load: ChatLoad,
    text: BlockText,
    model: str,
    salt: int,
    start: float,
    result: ChatResult,
) -> None:
    messages: list[dict[str, str]] = []
    for turn in turns:
        if not messages:
            system = text.block(_mix(salt, 1, turn.system), load.system_tokens)
            messages.append({"role": "system", "content": system})
        user = text.block(_mix(salt, 2, turn.conv, turn.turn), turn.user_tokens)
        messages.append({"role": "user", "content": user})
        body = orjson.dumps(
            {
                "model": model,
                "messages": messages,
                "max_tokens": load.output_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        delay = start + turn.arrival - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            result.lag_s = max(result.lag_s, -delay)
        result.requests += 1
        reply = await _send(session, target(turn), body, result)
        if reply is None:
            result.unfinished += len(turns) - 1 - turn.turn  # the rest of this conversation is lost
            result.requests += len(turns) - 1 - turn.turn
            return
        messages.append({"role": "assistant", "content": reply})


async def run_chat(
    target: str | Callable[[ChatTurn], str],
    load: ChatLoad,
    text: BlockText,
    model: str,
    seed: int,
    salt: int,
    drain_timeout_s: float = 60.0,
) -> ChatResult:
    """Run ``load.plan(seed)`` with text salted by ``salt`` against ``target`` (a base URL without
    ``/v1``, or a function of the turn giving one); see the module doc."""
    pick = (lambda _t: target) if isinstance(target, str) else target
    result = ChatResult()
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=drain_timeout_s)
    plan = load.plan(seed)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        tasks = [
            asyncio.create_task(_conversation(session, pick, turns, load, text, model, salt, start, result))
            for turns in plan
        ]
        deadline = load.duration_s + drain_timeout_s
        _done, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            result.errors["timeout"] = result.errors.get("timeout", 0) + len(pending)
            total = load.conversations * load.turns
            result.unfinished = total - result.recorder.finished
            result.requests = total
        result.wall_seconds = time.perf_counter() - start
    return result
