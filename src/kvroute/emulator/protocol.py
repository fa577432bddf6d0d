"""OpenAI-API request validation and response bodies, shaped as vLLM's OpenAI server sends them.

Errors follow vLLM's ``ErrorResponse``: ``{"error": {"message", "type", "param", "code"}}`` where
``type`` is ``BadRequestError``/``NotFoundError`` and ``code`` the HTTP status as an int.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvroute.chat_template import ChatTemplateError, chat_options
from kvroute.tokenizer import Tokenizer, message_text

COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest default
SYSTEM_FINGERPRINT = "kvroute-emulated"
"""vLLM 0.32 puts ``system_fingerprint`` ("vllm-VERSION-HASH") in whole responses and the usage chunk."""


class ApiError(Exception):
    """A request the API refuses; rendered by :meth:`body` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @property
    def err_type(self) -> str:
        return {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed"}.get(
            self.status, "InternalServerError"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.err_type,
                "param": self.param,
                "code": self.status,
            }
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """A validated generation request. ``max_tokens`` is the number of tokens to emit (the emulator
    always generates exactly that many, as with ``ignore_eos``)."""

    kind: Literal["chat", "completion"]
    prompt_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str
    cache_salt: str | None = None


# ---- field helpers ------------------------------------------------------------------------------


def _opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"'{name}' must be a boolean", name)
    return v


def _opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"'{name}' must be an integer", name)
    if v < minimum:
        raise bad(f"'{name}' must be at least {minimum}, got {v}", name)
    return v


def _opt_number(body: Mapping[str, Any], name: str, minimum: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise bad(f"'{name}' must be a number", name)
    if v < minimum:
        raise bad(f"'{name}' must be at least {minimum}, got {v}", name)
    return float(v)


def cache_salt(body: Mapping[str, Any]) -> str | None:
    """The request's ``cache_salt`` (vLLM: prefix-cache isolation, hashed into the prompt's first
    block); 400 unless absent, null or a non-empty string, as vLLM answers."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    return salt


def check_model(body: Mapping[str, Any], served: str | Sequence[str]) -> str:
    """The requested model: one of ``served`` (the base model first, then LoRA adapters); 404 for
    another name; absent means the base model."""
    names = (served,) if isinstance(served, str) else tuple(served)
    model = body.get("model")
    if model is None:
        return names[0]
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model not in names:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def _common(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """Checks shared by both endpoints; returns ``(stream, include_usage)``."""
    n = _opt_int(body, "n", 1)
    if n is not None and n > 1:
        raise bad(f"n > 1 is not supported by this server (got n={n})", "n")
    for name in ("best_of",):
        v = _opt_int(body, name, 1)
        if v is not None and v > 1:
            raise bad(f"{name} > 1 is not supported by this server", name)
    _opt_number(body, "temperature", 0.0)
    _opt_number(body, "top_p", 0.0)
    _opt_bool(body, "ignore_eos")
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("Stream options can only be defined when `stream=True`.", "stream_options")
        include_usage = bool(_opt_bool(opts, "include_usage"))
    return stream, include_usage


def _max_tokens(body: Mapping[str, Any], default: int) -> int:
    mct = _opt_int(body, "max_completion_tokens", 1)
    mt = _opt_int(body, "max_tokens", 1)
    if mct is not None:
        return mct
    return mt if mt is not None else default


def check_length(prompt_len: int, max_tokens: int, max_model_len: int, what: str) -> None:
    """vLLM's context-length checks, worded as vLLM words them."""
    if prompt_len >= max_model_len:
        raise bad(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{prompt_len} input tokens. Please reduce the length of the input {what}."
        )
    if prompt_len + max_tokens > max_model_len:
        raise bad(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            f"completion). Please reduce the length of the messages or completion."
        )


def _check_ids(ids: list[Any], tok: Tokenizer, param: str) -> tuple[int, ...]:
    size = tok.vocab_size
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise bad(f"'{param}' token ids must be integers", param)
        if not 0 <= i < size:
            raise bad(f"token id {i} is out of vocabulary (size {size})", param)
    return tuple(ids)


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """``messages`` as ``[{"role", "content"}]`` with text content; 400 when malformed."""
    if raw is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad(f"messages[{i}].role must be a non-empty string", "messages")
        try:
            content = message_text(m.get("content"))
        except TypeError as exc:
            raise bad(f"messages[{i}].content: {exc}", "messages") from None
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(body: Mapping[str, Any], tok: Tokenizer) -> tuple[int, ...]:
    """Token ids of a chat body's prompt (``messages``, ``tools``, ``documents``,
    ``add_generation_prompt``, ``chat_template_kwargs``), rendered by the tokenizer's chat template
    (:mod:`kvroute.chat_template`, the router's renderer) or ChatML; 400 with the template's message
    when it rejects the conversation."""
    messages = parse_messages(body.get("messages"))
    try:
        options = chat_options(body)
    except ValueError as exc:
        raise bad(str(exc)) from None
    try:
        if tok.template is not None:  # the template sees the messages as sent (tool calls, parts)
            return tuple(tok.encode_chat(body["messages"], options=options))
        return tuple(tok.encode_chat(messages, options=options))
    except ChatTemplateError as exc:
        raise bad(exc.message, "messages") from None
    except (TypeError, ValueError) as exc:
        raise bad(f"messages: {exc}", "messages") from None


def parse_chat(
    body: Any, tok: Tokenizer, served: str | Sequence[str], max_model_len: int, default_max_tokens: int
) -> GenerateRequest:
    """Validate a ``/v1/chat/completions`` body. ``default_max_tokens`` applies when the request
    sets neither ``max_tokens`` nor ``max_completion_tokens`` (capped by the remaining context)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = check_model(body, served)
    stream, include_usage = _common(body)
    for name in ("add_generation_prompt", "continue_final_message"):
        _opt_bool(body, name)
    ids = chat_prompt_ids(body, tok)
    if not ids:
        raise bad("the rendered prompt is empty", "messages")
    max_tokens = _max_tokens(body, max(1, min(default_max_tokens, max_model_len - len(ids))))
    check_length(len(ids), max_tokens, max_model_len, "messages")
    return GenerateRequest("chat", ids, max_tokens, stream, include_usage, model, cache_salt(body))


def parse_completion(
    body: Any, tok: Tokenizer, served: str | Sequence[str], max_model_len: int
) -> GenerateRequest:
    """Validate a ``/v1/completions`` body: ``prompt`` is text, token ids, or a one-element list of
    either (several prompts in one request are refused)."""
    if not isinstance(body, dict):
        raise bad("request body must be a JSON object")
    model = check_model(body, served)
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("'prompt' is required", "prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tuple(tok.encode(prompt))
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad("several prompts in one request are not supported by this server", "prompt")
    elif isinstance(prompt, list):
        ids = _check_ids(prompt, tok, "prompt")
    else:
        raise bad("'prompt' must be a string or an array of token ids", "prompt")
    if not ids:
        raise bad("Prompt cannot be empty", "prompt")
    stream, include_usage = _common(body)
    if _opt_bool(body, "echo"):
        raise bad("echo is not supported by this server", "echo")
    max_tokens = _max_tokens(body, COMPLETION_DEFAULT_MAX_TOKENS)
    check_length(len(ids), max_tokens, max_model_len, "prompt")
    return GenerateRequest("completion", ids, max_tokens, stream, include_usage, model, cache_salt(body))


# ---- response bodies ----------------------------------------------------------------------------


def render_body(req: GenerateRequest, body: Mapping[str, Any], rid: str) -> dict[str, Any]:
    """The answer of ``/v1/chat/completions/render`` and ``/v1/completions/render``: vLLM's
    ``GenerateRequest`` (its tokens-in/tokens-out request model) for the prompt as the engine would
    run it: the rendered ``token_ids`` and the sampling parameters (``max_tokens`` as the engine
    resolved it). Routers read ``token_ids`` to score prefixes without a tokenizer of their own."""
    return {
        "request_id": rid,
        "token_ids": list(req.prompt_ids),
        "features": None,
        "sampling_params": {"max_tokens": req.max_tokens},
        "model": req.model,
        "stream": False,
        "stream_options": None,
        "cache_salt": req.cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
    }


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int, block_size: int, created: bool = True
) -> dict[str, Any]:
    """vLLM 0.32's usage with ``--enable-prompt-tokens-details``: ``cached_tokens`` (the prefix-cache
    hit), ``created_cache_tokens`` (the prompt tokens this request added to the cache: its full
    blocks, ``block_size`` tokens each, minus the hit; vLLM's completions endpoint leaves it unset:
    ``created`` False) and ``multimodal_tokens`` (None: text only)."""
    made = max(0, prompt_tokens // block_size * block_size - cached_tokens) if created else None
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": made,
            "multimodal_tokens": None,
        },
    }


def chunk(
    req: GenerateRequest, rid: str, created: int, text: str | None, finish: str | None, first: bool = False
) -> dict[str, Any]:
    """One streamed chunk: for chat a ``delta`` (the first carries the role), for completions
    ``text``."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": text}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenerateRequest, rid: str, created: int, use: dict[str, Any]) -> dict[str, Any]:
    """The stream's last chunk; vLLM leaves the unset ``multimodal_tokens`` out of it (its chunks
    are serialised without None fields), unlike the whole response's usage."""
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    details = {k: v for k, v in use["prompt_tokens_details"].items() if v is not None}
    use = {**use, "prompt_tokens_details": details}
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [],
        "usage": use,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }


def full_response(
    req: GenerateRequest, rid: str, created: int, text: str, finish: str, use: dict[str, Any]
) -> dict[str, Any]:
    if req.kind == "chat":
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": [],
        }
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": req.model,
        "choices": [choice],
        "usage": use,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
