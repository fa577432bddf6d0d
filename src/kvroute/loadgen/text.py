"""Deterministic prompt text from block ids, with token blocks that survive tokenization.

Each block id maps to a fixed string of exactly ``block_size`` words; every word is one vocabulary
token of the form ``" word"`` (a space then ASCII lowercase letters). The byte-level BPE pre-tokenizer
of Qwen/GPT-style tokenizers splits text before every ``" word"``, and BPE never merges across those
splits, so the concatenation of block strings tokenizes to the concatenation of their tokens: block
``k`` of the text is exactly tokens ``k*block_size .. (k+1)*block_size-1``. Equal leading block ids
therefore give equal leading token blocks, which is what a prefix cache sees.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvroute.tokenizer import Tokenizer

__all__ = ["BlockText"]

_WORD = re.compile(r"^ [a-z]{3,12}$")
_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class BlockText:
    """Text for block ids under ``tokenizer``. ``words`` single-token words are taken from the
    vocabulary in id order (deterministic for a given tokenizer). Caches block strings it made
    (bounded by ``cache_blocks``); ``made`` counts the blocks whose text it had to make (cache misses)."""

    def __init__(self, tokenizer: Tokenizer, words: int = 4096, cache_blocks: int = 200_000) -> None:
        self.tokenizer = tokenizer
        vocab: list[str] = []
        for tid in range(min(tokenizer.vocab_size, 150_000)):
            s = tokenizer.decode([tid])
            if _WORD.match(s) and tokenizer.encode(s) == [tid]:
                vocab.append(s)
                if len(vocab) >= words:
                    break
        if len(vocab) < 256:
            raise ValueError("the tokenizer has too few single-token ' word' entries for synthetic prompts")
        self.vocab = vocab
        self._cache: dict[tuple[int, int], str] = {}
        self._cache_max = cache_blocks
        self.made = 0

    def _words(self, seed: int, n: int) -> str:
        vocab = self.vocab
        m = len(vocab)
        out = []
        x = seed & _MASK64
        for _ in range(n):
            x = _splitmix64(x)
            out.append(vocab[x % m])
        return "".join(out)

    def block(self, block_id: int, block_size: int) -> str:
        """The text of one block: exactly ``block_size`` tokens, a pure function of the id and size."""
        key = (block_id, block_size)
        s = self._cache.get(key)
        if s is None:
            s = self._words(_splitmix64(block_id * 2654435761 + block_size), block_size)
            self.made += 1
            if len(self._cache) < self._cache_max:
                self._cache[key] = s
        return s

    def prompt(self, block_ids: Sequence[int], block_size: int, prompt_len: int, salt: int) -> str:
        """Prompt text of ``prompt_len`` tokens: the blocks' texts, then ``prompt_len - len(block_ids) *
        block_size`` tail words derived from ``salt`` (e.g. the request id) so that tails differ."""
        parts = [self.block(b, block_size) for b in block_ids]
        tail = prompt_len - len(block_ids) * block_size
        if tail > 0:
            parts.append(self._words(_splitmix64(salt ^ 0x5DEECE66D), tail))
        return "".join(parts)
