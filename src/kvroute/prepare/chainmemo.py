"""Block hashes of prompts made of cached pieces, memoised along the pieces' path.

A prompt reaches the router as *pieces* (chat messages, or segments of a long completion prompt;
see :mod:`kvroute.prepare.tokenize`), most of them seen before: a conversation's earlier turns, a
shared system prompt. The hash of a block depends on every token before it, so the hashes of the
blocks that *end inside* piece ``i`` depend only on pieces ``0..i``. :class:`ChainMemo` stores them
under ``(node of pieces 0..i-1, key of piece i)``, where a node names a path of pieces from the root
(one root per extra key, e.g. ``cache_salt``). A prompt whose leading pieces were seen in this order
gets their hashes from the memo and hashes only the rest, starting at the last full block.

Invariant (tested): ``chain(pieces, suffix, key) == hash_blocks(concat(parts) + suffix, block_size,
key)``. Bounded LRU of at most ``entries`` edges covering at most ``tokens`` tokens in all (an edge
holds its piece's key and the hashes of the blocks ending in it: bounded by size, not only by count);
not thread-safe (the router's event loop only).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from kvroute.blocks import hash_blocks

__all__ = ["ChainMemo", "Piece"]

PieceKey = tuple[str, str]
Piece = tuple[PieceKey | None, Sequence[int]]  # (cache key or None: not memoisable, token ids)
_Node = int | tuple[str, str | bytes | None]


class ChainMemo:
    """See the module docstring. ``hits``/``misses`` count pieces served from / added to the memo."""

    def __init__(self, block_size: int, entries: int = 65536, tokens: int = 2_000_000) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self._max = entries
        self._max_tokens = tokens
        self.tokens = 0  # tokens covered by the edges' pieces (invariant: <= the bound)
        # (parent node, piece key) -> (child node, hashes of the blocks ending in it, piece tokens)
        self._edges: OrderedDict[tuple[_Node, PieceKey], tuple[int, tuple[int, ...], int]] = OrderedDict()
        self._ids = itertools.count(1)
        self.hits = 0
        self.misses = 0

    def chain(
        self, pieces: Sequence[Piece], suffix: Sequence[int] = (), extra_key: str | bytes | None = None
    ) -> list[int]:
        """Hashes of the full blocks of the pieces' tokens followed by ``suffix``."""
        bs = self.block_size
        edges = self._edges
        node: _Node = ("root", extra_key)
        chain: list[int] = []
        pos = 0  # tokens covered by the pieces walked so far
        i = 0
        for key, part in pieces:
            if key is None:
                break
            hit = edges.get((node, key))
            if hit is None:
                break
            edges.move_to_end((node, key))
            node, blocks, _ = hit
            chain.extend(blocks)
            pos += len(part)
            i += 1
        self.hits += i
        start = len(chain) * bs  # == pos // bs * bs: the last full block boundary
        tokens: list[int] = []
        if pos > start:  # the partial block the walked pieces left open
            back = pos - start
            for _, part in reversed(pieces[:i]):
                take = min(back, len(part))
                tokens[:0] = part[len(part) - take :]
                back -= take
                if not back:
                    break
        for _, part in pieces[i:]:
            tokens.extend(part)
        tokens.extend(suffix)
        new = hash_blocks(tokens, bs, extra_key, chain[-1] if chain else None)
        if self._max:
            self._remember(pieces, i, node, pos, len(chain), new)
        chain.extend(new)
        return chain

    def _remember(
        self, pieces: Sequence[Piece], i: int, node: _Node, pos: int, first: int, new: list[int]
    ) -> None:
        """Add edges for pieces ``i..`` (up to the first one without a key); ``new[k - first]`` is
        the hash of global block ``k``."""
        bs = self.block_size
        edges = self._edges
        for key, part in pieces[i:]:
            if key is None:
                break
            end = pos + len(part)
            lo, hi = pos // bs, end // bs  # blocks ending inside this piece
            if hi - first > len(new):  # ends in the suffix's blocks or beyond: not this piece's alone
                break
            child = next(self._ids)
            old = edges.get((node, key))
            if old is not None:
                self.tokens -= old[2]
            edges[(node, key)] = (child, tuple(new[lo - first : hi - first]), len(part))
            self.tokens += len(part)
            self.misses += 1
            node, pos = child, end
        while len(edges) > self._max or self.tokens > self._max_tokens:
            self.tokens -= edges.popitem(last=False)[1][2]
