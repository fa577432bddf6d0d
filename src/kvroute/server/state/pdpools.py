"""The P/D router's bookkeeping of one instance (a prefill or a decode engine): the requests routed to
it and not answered yet, with the new prefill tokens of those not started, and its last scraped
``/metrics``. Its :meth:`PDInstance.view` is the routing core's :class:`~kvroute.views.InstanceView`:
BS = requests in flight, queued prefill = their new tokens until started, ``decode_blocks`` = the
engine's blocks in use at the last scrape (``kv_usage`` × pool size) plus the prompt blocks of the
requests routed to it since that scrape began and not started yet (*pending*): the same sum as the
single-pool router's (:mod:`kvroute.server.state.backends`) and the simulator's
(:mod:`kvroute.views`; the P/D simulator's views are always current, this rule with nothing
pending). Before the first scrape: the blocks of every request in flight. Unlike the
single-pool router, a scrape counts however old it is (the P/D router has no staleness limit), and
the router is one process (no other writer's pending blocks). Mutated by the router's handler and its
scrape loop only (one event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute.routing.kvview import KVView
from kvroute.server.state.backends import ScrapedMetrics
from kvroute.views import InstanceView

__all__ = ["ROLES", "PDBackend", "PDChanges", "PDInstance", "PDMembership"]


@dataclass(frozen=True, slots=True)
class PDBackend:
    """One engine of a pool: ``url`` (no trailing slash); ``kv_events``: its ZMQ KV event endpoint
    (None: the approximate view from routing history)."""

    url: str
    kv_events: str | None = None


@dataclass(slots=True)
class PDInstance:
    """The router's bookkeeping of one instance: requests in flight → new prefill tokens (0 once
    started), → prompt blocks; the pending ones → when they were routed (monotonic seconds); the last
    scrape (its ``at``: when it began)."""

    index: int
    backend: PDBackend
    inflight: dict[str, int] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    scraped: ScrapedMetrics | None = None
    blocks: dict[str, int] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)

    def view(self, block_size: int = 0) -> InstanceView:
        """The instance's view (module docstring); its pool and blocks in use in blocks of
        ``block_size`` tokens, the router's
        (:meth:`~kvroute.server.state.backends.ScrapedMetrics.pool`)."""
        waiting = len(self.inflight) - len(self.started)
        queued = sum(n for r, n in self.inflight.items() if r not in self.started)
        s = self.scraped
        if s is None:
            pool, in_use, kv_usage = 0, sum(self.blocks.values()), 0.0
        else:
            pool, in_use = s.pool(block_size)
            kv_usage = s.kv_usage
            in_use += sum(self.blocks.get(r, 0) for r, at in self.pending.items() if at >= s.at)
        return InstanceView(
            index=self.index,
            running=len(self.started),
            waiting=waiting,
            queued_prefill_tokens=queued,
            kv_usage=kv_usage,
            kv_capacity_blocks=pool,
            decode_blocks=in_use,
        )

    def add(self, rid: str, new_tokens: int, blocks: int = 0, at: float = 0.0) -> None:
        """Request ``rid`` routed here at ``at`` (monotonic seconds): ``new_tokens`` to prefill,
        ``blocks`` prompt blocks, pending until it starts or a scrape begun after ``at`` lands."""
        self.inflight[rid] = new_tokens
        self.blocks[rid] = blocks
        self.pending[rid] = at

    def scrape(self, got: ScrapedMetrics) -> None:
        """Record a scrape (begun at ``got.at``): the requests routed before it leave ``pending``."""
        self.scraped = got
        for rid in [r for r, at in self.pending.items() if at < got.at]:
            del self.pending[rid]

    def start(self, rid: str) -> None:
        if rid in self.inflight:
            self.started.add(rid)
            self.pending.pop(rid, None)

    def done(self, rid: str) -> None:
        self.inflight.pop(rid, None)
        self.blocks.pop(rid, None)
        self.pending.pop(rid, None)
        self.started.discard(rid)


ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class PDChanges:
    """What one reconcile did: ``joined`` and ``left`` as (role, instance), in order."""

    joined: tuple[tuple[str, PDInstance], ...] = ()
    left: tuple[tuple[str, PDInstance], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.joined or self.left)

    def describe(self) -> str:
        parts = [f"+{r} {i.backend.url}" for r, i in self.joined]
        parts += [f"-{r} {i.backend.url}" for r, i in self.left]
        return ", ".join(parts)


class PDMembership:
    """The P/D router's instances per role: the static ones (flags, config file), which stay, and
    those each discovery source lists now. ``pools[role]`` maps an instance's index (its index in
    that role's :class:`~kvroute.routing.kvview.KVView`, never reused) to its bookkeeping, in join
    order. ``kvs[role]`` allocates the indices. Mutated by the router's event loop only.

    Invariants: a URL is in at most one role (static first, then the first source to list it; a
    source listing a URL the other role holds is logged by the caller via :attr:`conflicts`); an
    instance leaves only when no static entry and no source lists it any more (requests in flight
    keep their own reference and finish)."""

    def __init__(self, static: dict[str, tuple[PDBackend, ...]], kvs: dict[str, KVView]) -> None:
        self.kvs = kvs
        self.static = {r: tuple(static.get(r, ())) for r in ROLES}
        self.sources: dict[str, dict[str, tuple[PDBackend, ...]]] = {}
        self.pools: dict[str, dict[int, PDInstance]] = {r: {} for r in ROLES}
        self.conflicts: list[str] = []
        self.reconcile()

    def urls(self, role: str) -> list[str]:
        return [i.backend.url for i in self.pools[role].values()]

    def set_source(self, key: str, listed: dict[str, tuple[PDBackend, ...]]) -> PDChanges:
        """Source ``key`` lists ``listed`` (role → backends) now; reconcile."""
        self.sources[key] = {r: tuple(listed.get(r, ())) for r in ROLES}
        return self.reconcile()

    def _desired(self) -> dict[str, dict[str, PDBackend]]:
        want: dict[str, dict[str, PDBackend]] = {r: {} for r in ROLES}
        owner: dict[str, str] = {}
        self.conflicts = []
        lists = [self.static, *self.sources.values()]
        for listing in lists:
            for role in ROLES:
                for b in listing[role]:
                    have = owner.get(b.url)
                    if have is None:
                        owner[b.url] = role
                        want[role][b.url] = b
                    elif have != role:
                        self.conflicts.append(f"{b.url} is listed as {have} and as {role}: kept as {have}")
        return want

    def reconcile(self) -> PDChanges:
        want = self._desired()
        joined: list[tuple[str, PDInstance]] = []
        left: list[tuple[str, PDInstance]] = []
        for role in ROLES:
            pool = self.pools[role]
            kv = self.kvs[role]
            for idx, inst in list(pool.items()):
                b = want[role].get(inst.backend.url)
                if b is None or b.kv_events != inst.backend.kv_events:
                    del pool[idx]
                    kv.remove_backend(idx)
                    left.append((role, inst))
            have = {i.backend.url for i in pool.values()}
            for url, b in want[role].items():
                if url not in have:
                    inst = PDInstance(kv.add_backend(exact=b.kv_events is not None), b)
                    pool[inst.index] = inst
                    joined.append((role, inst))
        return PDChanges(tuple(joined), tuple(left))
