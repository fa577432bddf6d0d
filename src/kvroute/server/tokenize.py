"""Request tokenization for routing, with a per-message token cache.

Chat requests are tokenized message by message (``Tokenizer.message_tokens`` is a pure function of
``(role, content)`` for ChatML tokenizers), so the earlier turns of a conversation hit the cache and
only the new message is tokenized. The cache is a bounded LRU owned by one router (no global state).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.tokenizer import Tokenizer, message_text

__all__ = ["RequestTokenizer"]


class RequestTokenizer:
    """Tokenizes prompts and chats; ``cache_entries`` bounds the per-message cache (0 disables it).

    Mutates only its own cache and hit/miss counters.
    """

    def __init__(self, tokenizer: Tokenizer, cache_entries: int = 65536) -> None:
        self.tokenizer = tokenizer
        self._cache: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()
        self._max = cache_entries
        self.hits = 0
        self.misses = 0

    def _message(self, role: str, content: str) -> tuple[int, ...]:
        key = (role, content)
        cache = self._cache
        ids = cache.get(key)
        if ids is not None:
            cache.move_to_end(key)
            self.hits += 1
            return ids
        self.misses += 1
        ids = tuple(self.tokenizer.message_tokens(role, content))
        if self._max:
            cache[key] = ids
            if len(cache) > self._max:
                cache.popitem(last=False)
        return ids

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
        """Token ids of a completion prompt (a string, or token ids passed through)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return prompt
