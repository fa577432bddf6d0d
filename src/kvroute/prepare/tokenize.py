"""Request tokenization for routing, with a per-message token cache.

Chat requests are tokenized message by message (``Tokenizer.message_tokens`` is a pure function of
``(role, content)`` for ChatML tokenizers), so the earlier turns of a conversation hit the cache and
only the new message is tokenized. The cache is a bounded LRU owned by one router (no global state).
With a model's chat template the pieces are the template's prompt cut where it is prefix-stable and
token-safe (``Tokenizer.chat_pieces``), cached under their text; a conversation the template renders
with no such cut is one uncached piece (the whole prompt tokenized, exact either way).

Long completion prompts are tokenized in *segments* of about ``SEGMENT_CHARS`` characters, each cached
under its text. A segment ends at the first *safe split* at or after ``start + SEGMENT_CHARS``: a
position ``i`` with ``text[i] == " "``, ``text[i + 1]`` a letter and ``text[i - 1]`` not whitespace.
The GPT-style pre-tokenizer regex (Qwen, Llama 3, GPT-4) always starts a new pre-token there (the
``" word"`` alternative) and no earlier pre-token reaches past ``i - 1``; BPE never merges across
pre-tokens and NFC cannot compose across a space, so the segments' tokens concatenate to exactly the
whole prompt's tokens. Split points depend only on the text before them, so prompts with an equal
prefix share their leading segments, and a conversation's earlier turns hit the cache.

Two steps, so that the router can route before the new text is tokenized: :meth:`RequestTokenizer.split`
looks a request's pieces (messages or segments) up in the cache and returns a :class:`Pending`: the
token ids of its leading cached pieces (``known``) and the pieces after them; :meth:`RequestTokenizer.finish`
tokenizes those pieces (one batch call), caches them and returns the whole prompt's ids.
``finish(split(x))`` is exactly the tokenization of ``x`` (tested).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.chat_template import ChatOptions
from kvroute.prepare.chainmemo import Piece
from kvroute.tokenizer import Tokenizer, message_text, render_message

__all__ = ["SEGMENT_CHARS", "Pending", "RequestTokenizer", "split_points"]

SEGMENT_CHARS = 512
TEMPLATE_ROLE = "\x00template"
"""The first half of a template piece's cache key (``(TEMPLATE_ROLE, text)``): no chat role or
completion segment key (role ``""``) has it."""


def split_points(text: str, every: int = SEGMENT_CHARS) -> list[int]:
    """End offsets of the segments of ``text`` (see the module docstring); the last is ``len(text)``."""
    n = len(text)
    ends = []
    start = 0
    find = text.find
    while start < n:
        i = start + every
        end = n
        while i < n - 1:
            i = find(" ", i)
            if i < 0 or i >= n - 1:
                break
            if text[i + 1].isalpha() and not text[i - 1].isspace():
                end = i
                break
            i += 1
        ends.append(end)
        start = end
    return ends


@dataclass(slots=True)
class Pending:
    """A request split at its first uncached piece (see the module docstring).

    - ``known``: token ids of the leading pieces found in the cache (or the ids the client sent);
    - ``known_pieces``: those pieces, as ``(cache key, ids)`` (key None: the client's ids);
    - ``keys``/``texts``: the pieces after them, in order: cache key (None: not cached) and text;
    - ``suffix``: ids that always follow them (the chat generation prompt);
    - ``tail_chars``: characters in ``texts`` (what is left to tokenize).
    """

    known: list[int]
    known_pieces: list[Piece] = field(default_factory=list)
    keys: list[tuple[str, str] | None] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    suffix: tuple[int, ...] = ()
    tail_chars: int = 0


_PRIOR_CHARS = 4096.0  # the tokens-per-character estimate starts as this many characters at ...
_PRIOR_RATIO = 0.25  # ... 4 characters per token (English text, BPE)


class RequestTokenizer:
    """Tokenizes prompts and chats; the piece cache holds at most ``cache_entries`` pieces (0
    disables it) and at most ``cache_tokens`` token ids in all (a piece longer than that is not
    cached): bounded by what it holds, not only by how many pieces, so a few huge prompts cannot
    grow it without bound (about 40 bytes per cached token id, text key included).

    Mutates only its own cache, its hit/miss counters and its tokens-per-character estimate; safe to
    call from several threads (the cache is locked, the tokenizer itself runs outside the lock and
    releases the GIL).
    """

    def __init__(
        self, tokenizer: Tokenizer, cache_entries: int = 65536, cache_tokens: int = 2_000_000
    ) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._max = cache_entries
        self._max_tokens = cache_tokens
        self.cached_tokens = 0  # token ids held by the cache (invariant: <= cache_tokens)
        self._lock = threading.Lock()  # the proxy may tokenize long prompts on a worker thread
        self.hits = 0
        self.misses = 0
        self._chars = _PRIOR_CHARS  # characters tokenized (plus the prior) ...
        self._tokens = _PRIOR_CHARS * _PRIOR_RATIO  # ... and the tokens they gave

    # ---- two-step interface ------------------------------------------------------------------

    def split_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> Pending:
        """Split a chat (validated mappings with a string role; ``options``: tools, documents,
        template kwargs, whose ``add_generation_prompt`` wins). Raises TypeError/ValueError for
        malformed content, ``ChatTemplateError`` when the template rejects the conversation."""
        tok = self.tokenizer
        if options is not None:
            add_generation_prompt = options.add_generation_prompt
        else:
            options = ChatOptions(add_generation_prompt=add_generation_prompt)
        if tok.template is not None:
            pieces = tok.chat_pieces(messages, options)
            if len(pieces) > 1 and self._max:
                return self._split([(TEMPLATE_ROLE, p) for p in pieces], pieces, ())
            text = "".join(pieces)  # not prefix-stable anywhere: the whole prompt, uncached
            return Pending([], [], [None], [text], (), len(text))
        if not tok.per_message_exact:  # the whole rendering is one uncached piece
            text = tok.render_chat(messages, add_generation_prompt)
            return Pending([], [], [None], [text], (), len(text))
        keys: list[tuple[str, str] | None] = [(m["role"], message_text(m.get("content"))) for m in messages]
        texts = [render_message(role, content) for role, content in keys]  # type: ignore[misc]
        suffix = tuple(tok.generation_prompt_tokens()) if add_generation_prompt else ()
        return self._split(keys, texts, suffix)

    def split_prompt(self, prompt: str | Sequence[int]) -> Pending:
        """Split a completion prompt: a string into segments (see the module docstring); token ids
        are all known."""
        if not isinstance(prompt, str):
            ids = list(prompt)
            return Pending(ids, [(None, ids)])
        if len(prompt) < 2 * SEGMENT_CHARS or not self._max:
            return Pending([], [], [None], [prompt], (), len(prompt))
        texts = []
        start = 0
        for end in split_points(prompt):
            texts.append(prompt[start:end])
            start = end
        # role "" never collides with a chat message key (roles are non-empty)
        return self._split([("", t) for t in texts], texts, ())

    def _split(
        self, keys: list[tuple[str, str] | None], texts: list[str], suffix: tuple[int, ...]
    ) -> Pending:
        known: list[int] = []
        pieces: list[Piece] = []
        cache = self._cache
        n = 0
        with self._lock:
            for key in keys:
                assert key is not None
                ids = cache.get(key)
                if ids is None:
                    break
                cache.move_to_end(key)
                known.extend(ids)
                pieces.append((key, ids))
                n += 1
            self.hits += n
        rest = texts[n:]
        return Pending(known, pieces, keys[n:], rest, suffix, sum(map(len, rest)))

    def finish(self, pending: Pending) -> list[int]:
        """The whole prompt's token ids: ``pending.known``, its pieces tokenized (cached ones from the
        cache, the others in one batch call, then cached), ``pending.suffix``."""
        ids_out = list(pending.known)
        for _, part in self.finish_pieces(pending)[len(pending.known_pieces) :]:
            ids_out.extend(part)
        ids_out.extend(pending.suffix)
        return ids_out

    def finish_pieces(self, pending: Pending) -> list[Piece]:
        """Every piece of the prompt as ``(cache key, ids)``, the known ones first (the suffix,
        ``pending.suffix``, is not a piece)."""
        keys, texts = pending.keys, pending.texts
        found: list[tuple[int, ...] | None] = [None] * len(keys)
        cache = self._cache
        with self._lock:
            for i, key in enumerate(keys):
                hit = cache.get(key) if key is not None else None
                if hit is not None:
                    cache.move_to_end(key)  # type: ignore[arg-type]
                found[i] = hit
        missing = [i for i, hit in enumerate(found) if hit is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            encoded = self.tokenizer.encode_many([texts[i] for i in missing])
            chars = 0
            tokens = 0
            with self._lock:
                for i, seg_ids in zip(missing, encoded, strict=True):
                    ids = found[i] = tuple(seg_ids)
                    chars += len(texts[i])
                    tokens += len(ids)
                    key = keys[i]
                    if key is not None and self._max and len(ids) <= self._max_tokens:
                        old = cache.get(key)
                        if old is not None:  # another thread cached it meanwhile
                            self.cached_tokens -= len(old)
                        cache[key] = ids
                        self.cached_tokens += len(ids)
                while len(cache) > self._max or self.cached_tokens > self._max_tokens:
                    self.cached_tokens -= len(cache.popitem(last=False)[1])
                self._chars += chars
                self._tokens += tokens
        out = list(pending.known_pieces)
        for key, part in zip(keys, found, strict=True):
            assert part is not None
            out.append((key, part))
        return out

    def estimate_tail(self, pending: Pending) -> int:
        """Estimated token count of what ``pending`` has left (its texts and suffix), from the
        tokens per character seen so far (a running ratio over everything tokenized)."""
        return round(pending.tail_chars * self._tokens / self._chars) + len(pending.suffix)

    # ---- one-step interface ------------------------------------------------------------------

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        options: ChatOptions | None = None,
    ) -> list[int]:
        """Token ids of the rendering of ``messages`` (validated mappings with a string role).
        Raises TypeError for malformed content."""
        return self.finish(self.split_chat(messages, add_generation_prompt, options))

    def prompt(self, prompt: str | Sequence[int]) -> Sequence[int]:
        """Token ids of a completion prompt (a string, segment by segment through the cache; token ids
        are passed through)."""
        if not isinstance(prompt, str):
            return prompt
        return self.finish(self.split_prompt(prompt))
