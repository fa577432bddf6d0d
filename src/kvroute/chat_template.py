"""A model's own Jinja chat template, rendered as Hugging Face's ``apply_chat_template`` and vLLM do.

One renderer for every part of kvroute that turns a chat into a prompt (the router, the emulated
engine, ``kvroute prompt``), so the router's block hashes are the engine's.

Loading (:func:`load_chat_template`): ``--chat-template FILE`` wins; else the tokenizer folder's
``chat_template.jinja``; else ``chat_template`` in its ``tokenizer_config.json`` (a string, or a list
of ``{"name", "template"}`` from which ``"default"`` is taken). The special tokens a template reads
(``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) come from the same ``tokenizer_config.json``.

Rendering follows the Hugging Face convention (transformers' ``chat_template_utils``): an immutable
sandbox (``ImmutableSandboxedEnvironment``) with ``trim_blocks``/``lstrip_blocks`` and the
``loopcontrols`` extension; ``tojson`` is ``json.dumps`` with ``ensure_ascii=False`` and the
``indent``/``separators``/``sort_keys`` options (not Jinja's HTML-escaping filter); globals
``raise_exception(msg)`` (the template rejects the conversation: :class:`ChatTemplateError`) and
``strftime_now(fmt)`` (the injected clock's local time); variables ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the special tokens and the request's
``chat_template_kwargs`` (e.g. ``enable_thinking``). Messages are given to the template as vLLM's
OpenAI server gives them: content parts joined with newlines into one string when the template does
not loop over ``message.content`` (``string`` format), kept as a list of parts when it does
(``openai`` format); a missing content is ``""``; tool-call ``arguments`` JSON strings are parsed
into objects; other message keys (``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``)
pass through.

Prefix stability (:meth:`ChatTemplate.render_checked`): whether the rendering of the conversation
without its last turn is a prefix of the whole prompt. Templates that render earlier messages
differently once more follow (Mistral moves the system prompt into the last user message; Qwen3
drops earlier turns' reasoning) are not, for such conversations; the router then tokenizes the whole
prompt (:meth:`kvroute.tokenizer.Tokenizer.chat_pieces`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvroute.errors import UserError

__all__ = [
    "SPECIAL_TOKEN_NAMES",
    "ChatOptions",
    "ChatTemplate",
    "ChatTemplateError",
    "chat_options",
    "load_chat_template",
]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKEN_NAMES})


class ChatTemplateError(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed on it; ``message`` is
    the template's own text."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What a chat request gives the template besides its messages (read-only by convention):
    ``tools`` and ``documents`` (lists of objects or None), ``add_generation_prompt`` and
    ``kwargs`` (the request's ``chat_template_kwargs``)."""

    tools: Sequence[Any] | None = None
    documents: Sequence[Any] | None = None
    add_generation_prompt: bool = True
    kwargs: Mapping[str, Any] = field(default_factory=dict)


def chat_options(body: Mapping[str, Any]) -> ChatOptions:
    """The :class:`ChatOptions` of an OpenAI chat request body; ValueError naming the bad field."""
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError("'tools' must be a list of objects")
    docs = body.get("documents")
    if docs is not None and not (isinstance(docs, list) and all(isinstance(d, dict) for d in docs)):
        raise ValueError("'documents' must be a list of objects")
    gen = body.get("add_generation_prompt", True)
    if not isinstance(gen, bool):
        raise ValueError("'add_generation_prompt' must be a boolean")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError("'chat_template_kwargs' must be an object")
    return ChatOptions(tools or None, docs, gen, kwargs)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(str(message))


def _loops_over_content(tree: jinja2.nodes.Template) -> bool:
    """True when some ``for`` loop iterates over an expression ending in ``content`` (``message.content``,
    ``message['content']``): the template wants content as a list of parts (vLLM's ``openai`` format)."""
    for node in tree.find_all(jinja2.nodes.For):
        it = node.iter
        while isinstance(it, jinja2.nodes.Filter) and it.node is not None:  # e.g. `content | list`
            it = it.node
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
        is_item = isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
        if is_item and getattr(getattr(it, "arg", None), "value", None) == "content":
            return True
    return False


class ChatTemplate:
    """A compiled chat template (immutable after construction; ``render`` is safe from any thread).

    ``source``: the template text; ``origin``: where it came from (for messages); ``special``: the
    special tokens' text by name; ``now``: the clock of ``strftime_now`` (local ``datetime``)."""

    def __init__(
        self,
        source: str,
        origin: str,
        special: Mapping[str, str] | None = None,
        now: Callable[[], datetime] = datetime.now,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: now().strftime(fmt)
        try:
            tree = env.parse(source)
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise UserError(f"{origin}:{exc.lineno}: invalid chat template: {exc.message}") from None
        self.source = source
        self.origin = origin
        self.special = dict(special or {})
        self.content_format = "openai" if _loops_over_content(tree) else "string"

    # ---- rendering ---------------------------------------------------------------------------

    def conversation(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the template sees them (see the module docstring); new objects, the
        caller's are not changed. TypeError/ValueError for malformed content or tool calls."""
        return [self._message(m) for m in messages]

    def _message(self, m: Mapping[str, Any]) -> dict[str, Any]:
        out = dict(m)
        content = m.get("content")
        parts: list[Any]
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = content
        else:
            raise TypeError("content must be a string or a list of content parts")
        if self.content_format == "string":
            texts = []
            for p in parts:
                if not isinstance(p, Mapping):
                    raise TypeError("content parts must be objects")
                if p.get("type") == "text":
                    if not isinstance(p.get("text"), str):
                        raise TypeError("a text content part needs a string 'text'")
                    texts.append(p["text"])
            out["content"] = "\n".join(texts)
        else:
            out["content"] = [dict(p) if isinstance(p, Mapping) else p for p in parts]
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise TypeError("tool_calls must be a list")
            out["tool_calls"] = [self._tool_call(c) for c in calls]
        return out

    @staticmethod
    def _tool_call(call: Any) -> Any:
        if not isinstance(call, Mapping):
            raise TypeError("a tool call must be an object")
        fn = call.get("function")
        if not isinstance(fn, Mapping):
            return dict(call)
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str) and args:
            try:
                fn["arguments"] = json.loads(args)
            except json.JSONDecodeError as exc:
                raise ValueError(f"tool call arguments are not JSON: {exc}") from None
        elif not args:
            fn["arguments"] = {}
        return {**call, "function": fn}

    def render_conversation(self, conv: Sequence[Mapping[str, Any]], options: ChatOptions) -> str:
        """Render messages already given as :meth:`conversation` returns them. Raises
        :class:`ChatTemplateError` with the template's message when it rejects them or fails."""
        extra = {k: v for k, v in options.kwargs.items() if k not in _RESERVED}
        try:
            return str(
                self._template.render(
                    messages=list(conv),
                    tools=list(options.tools) if options.tools else None,
                    documents=list(options.documents) if options.documents else None,
                    add_generation_prompt=options.add_generation_prompt,
                    **self.special,
                    **extra,
                )
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(exc.message or type(exc).__name__) from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ChatTemplateError(f"the chat template failed on this conversation: {exc}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions | None = None) -> str:
        """The prompt text of ``messages`` (OpenAI chat messages)."""
        return self.render_conversation(self.conversation(messages), options or ChatOptions())

    def render_checked(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> tuple[str, bool]:
        """The prompt of ``messages`` and whether the rendering is *prefix-stable* for this
        conversation: rendering its first ``n - 1`` or ``n - 2`` messages (no generation prompt)
        gives a prefix of it, so the earlier turns' text (and tokens) reappear unchanged. Two or
        three renders. A one-message conversation is prefix-stable."""
        conv = self.conversation(messages)
        full = self.render_conversation(conv, options)
        if len(conv) < 2:
            return full, True
        bare = ChatOptions(options.tools, options.documents, False, options.kwargs)
        for k in (len(conv) - 1, len(conv) - 2):
            if k < 1:
                break
            try:
                head = self.render_conversation(conv[:k], bare)
            except ChatTemplateError:  # e.g. a template that needs a user message after the system one
                continue
            if head and full.startswith(head):
                return full, True
        return full, False


def _special_tokens(config: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        v = config.get(name)
        if isinstance(v, Mapping):  # {"content": "<s>", "lstrip": ..., ...}
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read chat template {path}: {exc}") from None


def load_chat_template(
    tokenizer_dir: Path | None,
    template_file: str | os.PathLike[str] | None = None,
    now: Callable[[], datetime] = datetime.now,
) -> ChatTemplate | None:
    """The chat template for a tokenizer folder (see the module docstring), or None when neither
    ``template_file`` nor the folder has one. Raises :class:`UserError` naming the file (and line)
    for a missing, unreadable or invalid file."""
    config: dict[str, Any] = {}
    cfg_path = tokenizer_dir / "tokenizer_config.json" if tokenizer_dir is not None else None
    if cfg_path is not None and cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"invalid tokenizer config {cfg_path}: {exc}") from None
        if isinstance(loaded, dict):
            config = loaded
    special = _special_tokens(config)
    if template_file is not None:
        path = Path(template_file)
        if not path.is_file():
            raise UserError(f"chat template not found: {path}")
        return ChatTemplate(_read_text(path), str(path), special, now)
    if tokenizer_dir is None:
        return None
    jinja_file = tokenizer_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(_read_text(jinja_file), str(jinja_file), special, now)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise UserError(f"{cfg_path}: chat_template must be a string or a list of named templates")
    return ChatTemplate(source, f"{cfg_path} (chat_template)", special, now)
