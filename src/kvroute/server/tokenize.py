"""Request tokenization for routing, with a per-message token cache.

Chat requests are tokenized message by message (``Tokenizer.message_tokens`` is a pure function of
``(role, content)`` for ChatML tokenizers), so the earlier turns of a conversation hit the cache and
only the new message is tokenized. The cache is a bounded LRU owned by one router (no global state).

Long completion prompts are tokenized in *segments* of about ``SEGMENT_CHARS`` characters, each cached
under its text. A segment ends at the first *safe split* at or after ``start + SEGMENT_CHARS``: a
position ``i`` with ``text[i] == " "``, ``text[i + 1]`` a letter and ``text[i - 1]`` not whitespace.
The GPT-style pre-tokenizer regex (Qwen, Llama 3, GPT-4) always starts a new pre-token there (the
``" word"`` alternative) and no earlier pre-token reaches past ``i - 1``; BPE never merges across
pre-tokens and NFC cannot compose across a space, so the segments' tokens concatenate to exactly the
whole prompt's tokens. Split points depend only on the text before them, so prompts with an equal
prefix share their leading segments, and a conversation's earlier turns hit the cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvroute.tokenizer import Tokenizer, message_text

__all__ = ["SEGMENT_CHARS", "RequestTokenizer", "split_points"]

SEGMENT_CHARS = 512


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


class RequestTokenizer:
    """Tokenizes prompts and chats; ``cache_entries`` bounds the per-message cache (0 disables it).

    Mutates only its own cache and hit/miss counters; safe to call from several threads (the cache
    is locked, the tokenizer itself runs outside the lock and releases the GIL).
    """

    def __init__(self, tokenizer: Tokenizer, cache_entries: int = 65536) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._max = cache_entries
        self._lock = threading.Lock()  # the proxy may tokenize long prompts on a worker thread
        self.hits = 0
        self.misses = 0

    def _cached(self, key: tuple[str, str], encode: Callable[[], Sequence[int]]) -> tuple[int, ...]:
        """The cached ids under ``key``, or ``encode()`` remembered there (LRU, ``cache_entries``)."""
        cache = self._cache
        with self._lock:
            ids = cache.get(key)
            if ids is not None:
                cache.move_to_end(key)
                self.hits += 1
                return ids
            self.misses += 1
        ids = tuple(encode())  # outside the lock: the tokenizer is the slow part
        if self._max:
            with self._lock:
                cache[key] = ids
                if len(cache) > self._max:
                    cache.popitem(last=False)
        return ids

    def _message(self, role: str, content: str) -> tuple[int, ...]:
        return self._cached((role, content), lambda: self.tokenizer.message_tokens(role, content))

    def chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the ChatML rendering of ``messages`` (validated mappings with a string role).
        Raises TypeError for malformed content."""
        tok = self.tokenizer
        if not tok.per_message_exact:
            return tok.encode_chat(messages, add_generation_prompt)
        ids: list[int] = []
        for m in messages:
            ids.extend(self._message(m["role"], message_text(m.get("content"))))
        if add_generation_prompt:
            ids.extend(tok.generation_prompt_tokens())
        return ids

    def prompt(self, prompt: str | Sequence[int]) -> Sequence[int]:
        """Token ids of a completion prompt (a string, segment by segment through the cache; token ids
        are passed through)."""
        if not isinstance(prompt, str):
            return prompt
        if len(prompt) < 2 * SEGMENT_CHARS or not self._max:
            return self.tokenizer.encode(prompt)
        segments = []
        start = 0
        for end in split_points(prompt):
            segments.append(prompt[start:end])
            start = end
        # role "" never collides with a chat message key (roles are non-empty)
        found: list[tuple[int, ...] | None] = []
        cache = self._cache
        with self._lock:
            for text in segments:
                hit = cache.get(("", text))
                if hit is not None:
                    cache.move_to_end(("", text))
                found.append(hit)
        missing = [i for i, hit in enumerate(found) if hit is None]
        self.hits += len(segments) - len(missing)
        self.misses += len(missing)
        if missing:  # one batch call: the tokenizer encodes the segments in parallel, without offsets
            encoded = self.tokenizer.encode_many([segments[i] for i in missing])
            with self._lock:
                for i, seg_ids in zip(missing, encoded, strict=True):
                    found[i] = cache[("", segments[i])] = tuple(seg_ids)
                while len(cache) > self._max:
                    cache.popitem(last=False)
        ids: list[int] = []
        for part in found:
            assert part is not None
            ids.extend(part)
        return ids
