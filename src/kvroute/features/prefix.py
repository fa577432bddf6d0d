"""The prefix class of a request: which shared leading prefix it belongs to.

Definition: with block chains (each block id is a chained hash of its own tokens *and* all earlier
blocks), the id of block ``K−1`` identifies the first ``K`` blocks. Two requests are in the same class
iff their first ``K`` blocks are equal. ``K = ceil(class_tokens / block_size)`` with ``class_tokens``
= 128 by default: 8 blocks of 16 tokens (vLLM's block size), or 1 block of Mooncake's 512 tokens.
Requests with fewer than ``K`` full blocks belong to no class (key 0) and are never hot.

128 tokens is short enough to name a system prompt / tool manifest / shared document by its start and
long enough to get past chat-template boilerplate that every request shares (a 16-token key, i.e. the
first block alone, puts all chat requests of a deployment in one class).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["DEFAULT_CLASS_TOKENS", "class_blocks", "prefix_class"]

DEFAULT_CLASS_TOKENS = 128
"""Default length of the class-defining prefix, tokens (rounded up to whole blocks)."""


def class_blocks(class_tokens: int, block_size: int) -> int:
    """``K``: whole blocks covering ``class_tokens`` tokens (at least 1)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return max(1, -(-class_tokens // block_size))


def prefix_class(chain: Sequence[int], k: int) -> int:
    """The class key of a request whose full blocks have ids ``chain``: a non-zero int derived from
    ``chain[k − 1]`` (distinct block ids give distinct keys), or 0 when ``len(chain) < k``."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(chain) < k:
        return 0
    return (chain[k - 1] << 1) | 1  # odd, hence never 0, and injective on ints
