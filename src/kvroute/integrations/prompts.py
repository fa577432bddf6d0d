"""An OpenAI request body, as a Ray Serve handle call carries it → the core's :class:`RouteRequest`.

Ray Serve LLM's ingress calls the model deployment's handle with the request object (a pydantic
model with ``messages`` or ``prompt``); plain deployments are usually called with a dict. Both are
accepted: a mapping, anything with ``model_dump()``, or an object with ``messages``/``prompt``
attributes. Chats are tokenized message by message through :class:`RequestTokenizer` (the earlier
turns of a conversation hit its cache), completions as text or token ids; the ids become the block
chain with :func:`kvroute.blocks.hash_blocks` (only full blocks). A body with neither field, or a
malformed one, routes by load alone (an empty chain): a router must route what the deployment will
reject, so that the deployment answers with its own error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.blocks import hash_blocks
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.routing.core import RouteRequest

__all__ = ["PromptChains", "body_of"]


def body_of(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The OpenAI body among a handle call's arguments: the first positional argument (or ``body``/
    ``request`` keyword) that is a mapping, has ``model_dump()``, or has ``messages``/``prompt``."""
    for arg in [*args, kwargs.get("body"), kwargs.get("request")]:
        if arg is None:
            continue
        if isinstance(arg, Mapping):
            return arg
        dump = getattr(arg, "model_dump", None)
        if callable(dump):
            out = dump()
            if isinstance(out, Mapping):
                return out
        fields = {k: getattr(arg, k) for k in ("messages", "prompt", "max_tokens") if hasattr(arg, k)}
        if "messages" in fields or "prompt" in fields:
            return fields
    return None


def _messages(raw: Any) -> list[dict[str, Any]] | None:
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for m in raw:
        if not isinstance(m, Mapping):
            m = getattr(m, "model_dump", lambda: None)()
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            return None
        out.append({"role": m["role"], "content": m.get("content")})
    return out


class PromptChains:
    """Body → :class:`RouteRequest` (block chain at ``block_size``, prompt tokens, max tokens).

    Mutates only the tokenizer's piece cache. ``user`` and the request class come from the body's
    ``user`` field and its ``kvroute_class`` field when present (the features read them)."""

    def __init__(self, tokenizer: RequestTokenizer, block_size: int) -> None:
        self.tokenizer = tokenizer
        self.block_size = block_size

    def route_request(self, body: Mapping[str, Any] | None) -> RouteRequest:
        ids = self._ids(body) if body is not None else None
        if not ids:
            return RouteRequest(chain=(), prompt_tokens=1)
        assert body is not None
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        user = body.get("user")
        req_class = body.get("kvroute_class")
        return RouteRequest(
            chain=tuple(hash_blocks(ids, self.block_size)),
            prompt_tokens=len(ids),
            max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
            user=user if isinstance(user, str) else None,
            req_class=req_class if isinstance(req_class, str) else "default",
            model=body.get("model") if isinstance(body.get("model"), str) else None,
            token_ids=ids,
        )

    def _ids(self, body: Mapping[str, Any]) -> list[int] | None:
        try:
            if "messages" in body:
                msgs = _messages(body["messages"])
                if msgs is None:
                    return None
                gen = body.get("add_generation_prompt", True)
                return self.tokenizer.chat(msgs, gen if isinstance(gen, bool) else True)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tokenizer.prompt(prompt))
            if isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                return list(prompt)
        except (TypeError, ValueError):
            return None
        return None
