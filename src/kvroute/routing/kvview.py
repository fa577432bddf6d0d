"""The router's KV view: which backend caches which prefix blocks, per backend exact or approximate.

Part of the routing core: the live router feeds it from ZMQ KV events and HTTP responses, the simulator
from its engine models' events (delivered after the event delay) and its simulated responses, through
the same methods, so the simulator simulates what the router sees.

- **Approximate** (default): routing history in an :class:`~kvroute.index.ApproxPrefixIndex` — the
  routed backend is assumed to hold the prompt's blocks (LRU capacity per backend, TTL). Routing
  history is recorded for *every* backend, so a backend whose event stream breaks can fall back to it.
- **Exact**: a backend with a KV-event endpoint feeds a :class:`~kvroute.index.PrefixIndex` from its
  ``BlockStored``/``BlockRemoved``/``AllBlocksCleared`` events. Engine block hashes are private, so
  ``BlockStored`` blocks are re-hashed from their ``token_ids`` with the router's own chain
  (:func:`kvroute.blocks.hash_blocks` after the parent's router hash); a per-backend map engine hash →
  router hash serves ``BlockRemoved`` and later parents. Blocks whose parent is unknown are skipped.
  A block cached for a LoRA adapter (``BlockStored.lora_name``) is re-hashed with that adapter as
  extra key (:func:`kvroute.blocks.extra_key`), as the router hashes a request for the adapter, so
  adapter blocks never match base-model requests; a block with a ``lora_id`` but no name (older
  engines) is skipped (its name is unknown). The blocks' ``extra_keys`` (vLLM 0.32) are honoured the
  same way (:func:`kvroute.blocks.event_key`): a ``cache_salt`` in a prompt's first block is recorded
  as that salt's chain, so a salted prefix matches only requests with the same salt (which the
  request side hashes into their first block, as vLLM), and blocks with multimodal or embedding
  keys are recorded under keys no text request has. Events whose blocks are not the router's blocks (SGLang
  sends one event per *page*, 1 token by default; an engine may use a larger block size) are
  **re-blocked**: each engine block keeps the router hash of the last full router block before its
  end and the tokens after it, and stores the router blocks it completes; its ``BlockRemoved``
  removes those (engines evict a prefix's last blocks first, so the blocks before stay cached).
  **A router block is held while any engine block holds it** (a count per router hash and backend):
  two engine blocks that differ only after their first router blocks (a conversation's turn whose
  last engine block was completed by generated tokens, and the next turn's prompt, whose same block
  carries the re-rendered reply instead; two chats under one ``cache_salt`` or system prompt whose
  first engine blocks share only their leading tokens) both complete the shared router blocks, and
  the eviction of one must not drop what the other still holds (seen on vLLM 0.32 with 128-token
  engine blocks and 16-token router blocks: predicted 0 or 256 cached tokens, served 640 to 2,176).
  With ``rehash=False`` the engine's block hashes *are* the router's (the simulator's engines hash
  with the workload's block ids, as traces carry them) and are stored as they are.
- **Recovering**: after a sequence gap that replay could not fill, the backend's exact entries are
  cleared and, for ``recovery_s`` seconds, its match is ``max(exact, approximate)`` (new events are
  exact; the history covers what was cached before the gap); then it is exact again.

Shortfall evidence (:meth:`KVView.on_usage`): a response whose real ``cached_tokens`` is below half
the prediction and short by at least one engine block is counted per backend (``shortfalls``); on a
backend with KV events it drops that backend's routing history (but the request's own prompt), and
the exact entries are left to the events (vLLM publishes ``AllBlocksCleared`` only with its next
step, so the requests routed between a reset and that step are mispredicted; the ones after are not).

Correction in approximate mode (:meth:`KVView.on_usage`): when a response reports
``usage.prompt_tokens_details.cached_tokens``, the router compares it with its prediction for that
backend: fewer cached blocks than predicted means the backend evicts sooner than believed, so its LRU
capacity shrinks by 10% (evicting its oldest entries at once); more than predicted grows it by the
missed blocks (up to the configured capacity). Additive increase, multiplicative decrease.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import groupby

from kvroute.blocks import event_key, extra_key, hash_blocks
from kvroute.engine.types import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvroute.index import ApproxPrefixIndex, PrefixIndex

__all__ = ["KVView"]

_SHRINK = 0.9


_Page = tuple[int | None, tuple[int, ...], tuple[int, ...]]
_Keys = str | bytes | None | list[str | bytes | None]  # one key for all of an event's blocks, or one each


def _block_keys(ev: BlockStored) -> _Keys:
    """The router's extra key of each of ``ev``'s blocks (:func:`kvroute.blocks.event_key`): one key
    when they all have the same (the common case), else a list with one per block."""
    if ev.extra_keys is None or not any(ev.extra_keys):
        return extra_key(ev.lora_name)
    keys = [event_key(ev.lora_name, k) for k in ev.extra_keys]
    return keys[0] if keys.count(keys[0]) == len(keys) else keys


class KVView:
    """See the module docstring. ``now`` arguments are monotonic seconds and must not decrease.

    ``history=False`` keeps no routing history for exact backends (:meth:`on_routed` then only feeds
    approximate ones): right where an event stream cannot break (the simulator), and it saves the
    history's cost there. ``rehash``: see the module docstring.

    Mutated by ``on_routed`` (approximate history), ``on_usage`` (capacity correction),
    ``apply_events``/``reset`` (exact view), ``add_backend``/``remove_backend``/``set_exact``
    (membership); ``match`` mutates nothing.
    """

    def __init__(
        self,
        num_backends: int,
        block_size: int,
        capacity_blocks: int,
        ttl_s: float | None,
        recovery_s: float,
        exact_backends: Iterable[int] = (),
        *,
        rehash: bool = True,
        history: bool = True,
    ) -> None:
        self.num_backends = num_backends
        self.block_size = block_size
        self.max_capacity = capacity_blocks
        self.recovery_s = recovery_s
        self.approx = ApproxPrefixIndex(capacity_blocks, ttl_s)
        self.exact = PrefixIndex()
        self._exact_set = frozenset(exact_backends)
        self._hash_maps: dict[int, dict[int, int]] = {i: {} for i in self._exact_set}
        # re-blocked engine blocks: engine hash -> (router hash of the last full block before its end
        # or None, the tokens after that block, the router blocks it completed)
        self._pages: dict[int, dict[int, _Page]] = {}
        # engine hash -> copies beyond the first: vLLM's block pool may cache one hash in several blocks
        # (BlockStored for each) and sends BlockRemoved for each copy it evicts, while others stay
        self._copies: dict[int, dict[int, int]] = {}
        # router hash -> how many distinct engine hashes (in ``_hash_maps`` or ``_pages``) hold it;
        # a router block leaves the exact index when this reaches 0
        self._refs: dict[int, dict[int, int]] = {}
        self._recover_until: dict[int, float] = {}
        self._removed: set[int] = set()  # backends gone for good (indices are never reused)
        self._last_now = float("-inf")
        self.rehash = rehash
        self.history = history
        self.skipped_blocks = 0  # BlockStored blocks dropped (unknown parent, no tokens, block size)
        self.corrections = 0
        self.shortfalls: dict[int, int] = {}  # per backend: responses far below the prediction
        # Called with the backend index on AllBlocksCleared (cold start: the backend warms up again).
        self.on_cleared: Callable[[int], None] | None = None
        # Per backend: the engine's own block size, tokens, as learned (BlockStored.block_size, the
        # engine's cache_config_info); absent: assumed equal to ``block_size``.
        self.engine_blocks: dict[int, int] = {}
        # Called with (backend, engine block size) when a backend's learned size changes.
        self.on_engine_block_size: Callable[[int, int], None] | None = None

    def _now(self, now: float) -> float:
        # The approximate index refuses time going backwards; keep ours monotone.
        if now < self._last_now:
            now = self._last_now
        self._last_now = now
        return now

    def engine_block_size(self, backend: int) -> int:
        """The engine block size of ``backend`` in tokens (the router's own until one is learned)."""
        return self.engine_blocks.get(backend, self.block_size)

    def set_engine_block_size(self, backend: int, tokens: int) -> None:
        """``backend``'s engine caches in blocks of ``tokens`` (from its metrics or events); calls
        ``on_engine_block_size`` when that changes what was known. Ignores ``tokens < 1``."""
        if tokens >= 1 and self.engine_blocks.get(backend) != tokens:
            self.engine_blocks[backend] = tokens
            if self.on_engine_block_size is not None:
                self.on_engine_block_size(backend, tokens)

    def cached_tokens(self, backend: int, matched_blocks: int, prompt_tokens: int) -> int:
        """The prompt tokens ``backend`` will serve from its cache, given ``matched_blocks`` router
        blocks of the prompt known cached there: vLLM hits whole engine blocks only, and never the
        prompt's last token (it always computes one), so the matched prefix is cut to
        ``prompt_tokens - 1`` and then down to whole engine blocks. Pure."""
        tokens = min(matched_blocks * self.block_size, prompt_tokens - 1)
        if tokens <= 0:
            return 0
        ebs = self.engine_blocks.get(backend, self.block_size)
        return tokens - tokens % ebs

    def mode(self, backend: int, now: float) -> str:
        """``"approx"``, ``"exact"`` or ``"recovering"``."""
        if backend not in self._exact_set:
            return "approx"
        until = self._recover_until.get(backend)
        return "recovering" if until is not None and now < until else "exact"

    def add_backend(self, exact: bool) -> int:
        """A backend joins (empty cache); returns its index (the next one)."""
        index = self.num_backends
        self.num_backends += 1
        if exact:
            self._exact_set = self._exact_set | {index}
            self._hash_maps[index] = {}
        return index

    def remove_backend(self, backend: int) -> None:
        """Backend ``backend`` left for good: drop its exact and approximate entries (its index is
        never reused; :meth:`match` reports 0 for it from now on)."""
        self.exact.clear(backend)
        self.approx.clear(backend)
        self._exact_set = self._exact_set - {backend}
        self._hash_maps.pop(backend, None)
        self._pages.pop(backend, None)
        self._copies.pop(backend, None)
        self._refs.pop(backend, None)
        self._recover_until.pop(backend, None)
        self.engine_blocks.pop(backend, None)
        self._removed.add(backend)

    def set_exact(self, backend: int, exact: bool, now: float) -> None:
        """Switch ``backend`` between exact (KV events) and approximate (routing history). To exact:
        its exact view starts empty and is recovering (``max(exact, approximate)``) for
        ``recovery_s`` seconds, as after a gap. To approximate: its exact entries are dropped."""
        if exact == (backend in self._exact_set):
            return
        if exact:
            self._exact_set = self._exact_set | {backend}
            self.reset(backend, now)
        else:
            self.exact.clear(backend)
            self._exact_set = self._exact_set - {backend}
            self._hash_maps.pop(backend, None)
            self._pages.pop(backend, None)
            self._copies.pop(backend, None)
            self._refs.pop(backend, None)
            self._recover_until.pop(backend, None)

    def match(self, chain: Sequence[int], now: float) -> list[int]:
        """Cached-prefix length in blocks of ``chain`` on every backend (list indexed by backend)."""
        n = self.num_backends
        if not self._exact_set:
            return self.approx.match(chain, n)
        exact = self.exact.match(chain, n)
        recovering = self._recovering(now) if self._recover_until else ()
        if not recovering and len(self._exact_set) + len(self._removed) == n:  # no history needed
            return exact
        out = self.approx.match(chain, n)
        for i in self._exact_set:
            out[i] = max(exact[i], out[i]) if i in recovering else exact[i]
        return out

    def _recovering(self, now: float) -> list[int]:
        """Backends still recovering at ``now``; forgets the windows that have ended."""
        until = self._recover_until
        for i in [i for i, t in until.items() if now >= t]:
            del until[i]
        return list(until)

    def on_routed(self, backend: int, chain: Sequence[int], now: float) -> None:
        """A request with block ``chain`` was sent to ``backend`` (records the routing history)."""
        if chain and (self.history or backend not in self._exact_set):
            self.approx.assign(backend, chain, self._now(now))

    def on_usage(
        self, backend: int, chain: Sequence[int], cached_tokens: int, predicted_blocks: int, now: float
    ) -> None:
        """The engine reported ``cached_tokens`` for a request predicted to hit ``predicted_blocks``
        on ``backend``: adjust that backend's approximate capacity (approximate mode only); on any
        backend, a shortfall is evidence (:meth:`_shortfall`)."""
        if self._shortfall(backend, chain, cached_tokens, predicted_blocks, now):
            return
        if backend in self._exact_set and self.mode(backend, now) == "exact":
            return
        reported = min(cached_tokens // self.block_size, len(chain))
        if reported == predicted_blocks:
            return
        cap = self.approx.capacity(backend)
        if reported < predicted_blocks:
            new = max(len(chain), int(self.approx.num_blocks(backend) * _SHRINK))
            new = min(new, cap)
        else:
            new = min(self.max_capacity, cap + (reported - predicted_blocks))
        if new != cap:
            self.corrections += 1
            self.approx.set_capacity(backend, new)

    def _shortfall(
        self, backend: int, chain: Sequence[int], cached_tokens: int, predicted_blocks: int, now: float
    ) -> bool:
        """A real ``cached_tokens`` far below the prediction (below half of it, and short by at least
        one engine block) is evidence that ``backend`` lost what the view says it holds: a
        prefix-cache reset (vLLM publishes its ``AllBlocksCleared`` only with its next step), or
        evictions. Counted per backend in ``shortfalls``. On a backend with KV events (True is
        returned) its routing history, which believed the lost blocks too, is dropped but for this
        request's prompt in whole engine blocks (the engine just computed it); its exact entries are
        left to the events, which are authoritative and already on their way (the late clear comes
        with the step that served this request, a BlockRemoved with its eviction, a lost batch is a
        sequence gap). An approximate backend's capacity correction handles it (False)."""
        predicted = predicted_blocks * self.block_size
        ebs = self.engine_block_size(backend)
        if not (cached_tokens * 2 < predicted and predicted - cached_tokens >= ebs):
            return False
        self.shortfalls[backend] = self.shortfalls.get(backend, 0) + 1
        if backend not in self._exact_set:
            return False
        held = chain[: len(chain) * self.block_size // ebs * ebs // self.block_size]
        self.approx.clear(backend)
        if held:
            self.approx.assign(backend, held, self._now(now))
        return True

    def expire(self, now: float) -> int:
        """Drop approximate entries past their TTL; returns how many."""
        return self.approx.expire(self._now(now))

    # ---- exact view ----------------------------------------------------------------------------

    def begin_sync(self, backend: int) -> None:
        """``backend``'s exact view is being filled from a replay (a router started after its
        engines): until :meth:`end_sync` (or :meth:`reset`) its match is ``max(exact, approximate)``."""
        self._recover_until[backend] = float("inf")

    def end_sync(self, backend: int, now: float) -> None:
        """The replay caught up: ``backend`` is exact again (unless a reset made it recover)."""
        if self._recover_until.get(backend) == float("inf"):
            self._recover_until[backend] = now

    def reset(self, backend: int, now: float) -> None:
        """The event stream of ``backend`` has an unrecoverable gap: clear its exact entries and use
        ``max(exact, approximate)`` for ``recovery_s`` seconds."""
        self.exact.clear(backend)
        self._hash_maps.setdefault(backend, {}).clear()
        self._pages.pop(backend, None)
        self._copies.pop(backend, None)
        self._refs.pop(backend, None)
        self._recover_until[backend] = now + self.recovery_s

    def apply_events(self, backend: int, events: Sequence[KVEvent]) -> None:
        """Apply one decoded event batch of ``backend`` to the exact view."""
        hmap = self._hash_maps.setdefault(backend, {})
        for ev in events:
            if isinstance(ev, BlockStored):
                if self.rehash:
                    self._count_copies(backend, hmap, ev.block_hashes)
                self._stored(backend, hmap, ev)
            elif isinstance(ev, BlockRemoved):
                if not self.rehash:
                    self.exact.remove(backend, ev.block_hashes)
                    continue
                gone = self._last_copies(backend, ev.block_hashes)
                ours = [h for h in map(hmap.pop, gone, [None] * len(gone)) if h is not None]
                pages = self._pages.get(backend)
                if pages and len(ours) < len(gone):
                    for eh in gone:
                        page = pages.pop(eh, None)
                        if page is not None:
                            ours.extend(page[2])
                if ours:
                    self.exact.remove(backend, self._released(backend, ours))
            elif isinstance(ev, AllBlocksCleared):
                self.exact.clear(backend)
                hmap.clear()
                self._pages.pop(backend, None)
                self._copies.pop(backend, None)
                self._refs.pop(backend, None)
                if self.on_cleared is not None:
                    self.on_cleared(backend)

    def _count_copies(self, backend: int, hmap: dict[int, int], hashes: Sequence[int]) -> None:
        """A BlockStored of engine hashes already held: one more copy each."""
        pages = self._pages.get(backend)
        for eh in hashes:
            if eh in hmap or (pages is not None and eh in pages):
                copies = self._copies.setdefault(backend, {})
                copies[eh] = copies.get(eh, 0) + 1

    def _held(self, backend: int, ours: Sequence[int]) -> None:
        """One more engine block (a new engine hash, not a copy) holds each router block of ``ours``."""
        refs = self._refs.setdefault(backend, {})
        for h in ours:
            refs[h] = refs.get(h, 0) + 1

    def _released(self, backend: int, ours: Sequence[int]) -> list[int]:
        """An engine block holding ``ours`` is gone: the router blocks no engine block holds any more."""
        refs = self._refs.get(backend, {})
        free = []
        for h in ours:
            n = refs.get(h, 0) - 1
            if n > 0:
                refs[h] = n
            else:
                refs.pop(h, None)
                free.append(h)
        return free

    def _last_copies(self, backend: int, hashes: Sequence[int]) -> Sequence[int]:
        """The engine hashes of a BlockRemoved whose last copy went (the others: one copy less)."""
        copies = self._copies.get(backend)
        if not copies:
            return hashes
        gone = []
        for eh in hashes:
            n = copies.get(eh, 0)
            if n > 1:
                copies[eh] = n - 1
            elif n == 1:
                del copies[eh]
            else:
                gone.append(eh)
        return gone

    def _stored(self, backend: int, hmap: dict[int, int], ev: BlockStored) -> None:
        if ev.block_size > self.engine_blocks.get(backend, 0):  # SGLang: a node's last page may be shorter
            self.set_engine_block_size(backend, ev.block_size)
        if not self.rehash:
            self.exact.store(backend, ev.block_hashes)
            return
        n = len(ev.block_hashes)
        bs = self.block_size
        ebs = ev.block_size
        if len(ev.token_ids) != n * ebs or (ev.lora_id is not None and ev.lora_name is None):
            self.skipped_blocks += n
            return
        keys = _block_keys(ev)
        tail: tuple[int, ...] = ()
        if ev.parent_block_hash is None:
            parent = None
        else:
            parent = hmap.get(ev.parent_block_hash)
            if parent is None:
                page = self._pages.get(backend, {}).get(ev.parent_block_hash)
                if page is None:
                    self.skipped_blocks += n
                    return
                parent, tail, _ = page
        if ebs != bs or tail:
            self._reblocked(backend, ev, parent, tail, keys)
            return
        if isinstance(keys, list):  # the blocks' keys differ: hash each run of equal keys
            ours = []
            start = 0
            for key, run in groupby(keys):
                end = start + len(list(run))
                ours += hash_blocks(ev.token_ids[start * bs : end * bs], bs, key, parent=parent)
                parent, start = ours[-1], end
        else:
            ours = hash_blocks(ev.token_ids, bs, keys, parent=parent)
        new = [oh for eh, oh in zip(ev.block_hashes, ours, strict=True) if eh not in hmap]
        if new:
            self._held(backend, new)
        for eh, oh in zip(ev.block_hashes, ours, strict=True):
            hmap[eh] = oh
        self.exact.store(backend, ours)

    def _reblocked(
        self,
        backend: int,
        ev: BlockStored,
        parent: int | None,
        tail: tuple[int, ...],
        keys: _Keys,
    ) -> None:
        """Store ``ev``'s engine blocks, whose size is not the router's, as the router blocks they
        complete (see the module docstring); ``parent``/``tail``: the state after the parent block."""
        bs = self.block_size
        ebs = ev.block_size
        pages = self._pages.setdefault(backend, {})
        stored: list[int] = []
        for i, eh in enumerate(ev.block_hashes):
            tokens = tail + tuple(ev.token_ids[i * ebs : (i + 1) * ebs])
            full = len(tokens) // bs
            done: tuple[int, ...] = ()
            if full:
                key = keys[i] if isinstance(keys, list) else keys
                done = tuple(hash_blocks(tokens[: full * bs], bs, key, parent=parent))
                parent = done[-1]
                stored.extend(done)
            tail = tokens[full * bs :]
            if done and eh not in pages:  # a copy of a held engine block holds nothing more
                self._held(backend, done)
            pages[eh] = (parent, tail, done)
        if stored:
            self.exact.store(backend, stored)
