"""Validation of client request bodies and OpenAI-style error bodies.

Nothing here raises anything but :class:`ApiError`, whose ``status`` (400, 413, 503, ...) and message
end up in an OpenAI-style JSON error: ``{"error": {"message", "type", "param", "code"}}``.

Nesting is bounded without recursion: a body nested deeper than :data:`MAX_DEPTH` levels (objects and
arrays) is refused with a 400 by an iterative walk (:func:`check_depth`), before anything that recurses
(the chat template, the prompt's shape) sees it; orjson itself refuses more than 1024 levels, which is
a 400 too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvroute.chat_template import ChatOptions, chat_options

__all__ = [
    "MAX_DEPTH",
    "ApiError",
    "ParsedRequest",
    "body_too_large",
    "check_depth",
    "error_body",
    "parse_request",
    "too_long",
]

MAX_DEPTH = 64
"""Levels of JSON objects and arrays a request body may nest (the body itself is level 1)."""

_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
}


class ApiError(Exception):
    """An error for the client: HTTP ``status`` and a one-line message (never a traceback).
    ``close``: the answer closes the client's connection (what is left of its request is unread).
    Picklable (it crosses from the parse worker process)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        etype: str | None = None,
        code: str | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.etype = etype or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.code = code  # OpenAI's string code (e.g. "model_not_found"); None: the status
        self.close = close

    def __reduce__(self) -> tuple[type[ApiError], tuple[object, ...]]:  # subclasses: as an ApiError
        return ApiError, (self.status, self.message, self.param, self.etype, self.code, self.close)


def error_body(err: ApiError) -> bytes:
    """The OpenAI-style JSON body for ``err``."""
    return orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": err.etype,
                "param": err.param,
                "code": err.status if err.code is None else err.code,
            }
        }
    )


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What routing needs from a validated body. ``prompt``: str or token ids (completions);
    ``messages``: the chat messages (chat); ``max_tokens``: 0 when absent; ``chat_options``: what
    the chat template sees besides the messages (tools, documents, template kwargs)."""

    chat: bool
    stream: bool
    model: str | None
    max_tokens: int
    user: str | None
    prompt: str | Sequence[int] | None = None
    messages: Sequence[Mapping[str, Any]] | None = None
    cache_salt: str | None = None
    chat_options: ChatOptions | None = None


def check_depth(raw: bytes, body: object, limit: int = MAX_DEPTH) -> None:
    """ApiError(400) when ``body`` (parsed from ``raw``) nests objects/arrays deeper than ``limit``.
    Iterative; skipped when ``raw`` holds too few brackets to nest that deep (the common case)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return
    stack: list[tuple[object, int]] = [(body, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            raise ApiError(400, f"the request body is nested more than {limit} levels deep")
        children: Iterable[object] = obj.values() if isinstance(obj, dict) else obj  # type: ignore[assignment]
        for child in children:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))


def _opt_int(body: Mapping[str, Any], key: str) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"'{key}' must be an integer", key)
    if v < 0:
        raise ApiError(400, f"'{key}' must be >= 0", key)
    return v


def _opt_str(body: Mapping[str, Any], key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ApiError(400, f"'{key}' must be a string", key)
    return v


def body_too_large(limit: int) -> ApiError:
    """The 413 of a request body over ``limit`` bytes (announced by its Content-Length, or read)."""
    return ApiError(413, f"request body is larger than {limit} bytes")


def too_long(tokens: int, cap: int) -> ApiError:
    """The 400 of a prompt of ``tokens`` tokens over the router's ``cap``."""
    return ApiError(
        400,
        f"the prompt has {tokens} tokens; this router takes at most {cap} (the backends' context length)",
        "prompt",
        code="context_length_exceeded",
    )


def _prompt(value: Any, cap: int) -> str | Sequence[int]:
    while True:  # a batch of batches: route on the first (a loop: nesting is bounded, not recursed)
        if isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            break
        if cap and len(value) > cap and isinstance(value[0], int):  # token ids: before checking each
            raise too_long(len(value), cap)
        if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
            return value
        if all(isinstance(t, str) for t in value):
            return value[0]  # a batch of prompts: route on the first
        if not all(isinstance(t, list) for t in value):
            break
        value = value[0]
    raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")


def _messages(value: Any) -> list[Mapping[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", "messages")
        if not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}].role must be a string", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or (
                    part.get("type") == "text" and not isinstance(part.get("text"), str)
                ):
                    raise ApiError(400, f"messages[{i}].content has a malformed part", "messages")
    return value


def parse_request(raw: bytes, chat: bool, max_prompt_tokens: int = 0) -> ParsedRequest:
    """Parse and check a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body.
    ``max_prompt_tokens``: a token-id prompt longer than this is a 400 (:func:`too_long`), checked
    before its ids are (0: no cap here; text is capped once tokenized)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    check_depth(raw, body)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "'stream' must be a boolean", "stream")
    max_tokens = _opt_int(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _opt_int(body, "max_tokens")
    model = _opt_str(body, "model")
    user = _opt_str(body, "user")
    salt = _opt_str(body, "cache_salt")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    if chat:
        if "messages" not in body:
            raise ApiError(400, "'messages' is required", "messages")
        try:
            options = chat_options(body)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        return ParsedRequest(
            True,
            stream,
            model,
            max_tokens or 0,
            user,
            messages=_messages(body["messages"]),
            cache_salt=salt,
            chat_options=options,
        )
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt")
    return ParsedRequest(
        False,
        stream,
        model,
        max_tokens or 0,
        user,
        prompt=_prompt(body["prompt"], max_prompt_tokens),
        cache_salt=salt,
    )
