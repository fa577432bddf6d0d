"""The router's backends that come and go: sources of backends → one desired list → adds and drains.

:class:`Fleet` is the server side of membership (the routing side is in
:class:`~kvroute.server.state.router.RouterState`: ``add_backend``, ``drain_backend``, ``remove_backend``):

- **Sources**: named lists of :class:`BackendSpec`: ``"static"`` (the config's ``backends`` and the
  ``--backend`` flags; replaced on a SIGHUP reload), ``"admin"`` (added through the admin API), and one
  per discovery source (``"dns://…"``, ``"file://…"``). The desired list is their union by URL (the
  first source listing a URL gives its spec; ``static`` comes first). :meth:`Fleet.set_source` replaces
  one list and reconciles when it changed.
- **Deleted through the admin API** (:meth:`Fleet.forget`): the backend leaves the admin list, and each
  other source that lists it is masked for that URL, per source: a new list from that source (a SIGHUP
  reload, a discovery answer) brings it back only if *that source's own entry* for the URL changed
  (dropped, then listed again; or listed with another spec). A reload of an unchanged file, or a
  change to other backends in it, keeps it deleted, on every replica and worker alike.
- **Reconcile** (:meth:`Fleet.reconcile`): a desired URL that is not listed is added; a listed one whose
  spec changed is updated (a ``kv_events``/``kv_replay`` change re-subscribes its KV events, the KV view
  switching mode as :meth:`KVView.set_exact` says); a draining one that is desired again is active
  again (unless the admin API drained it); an active one that is no longer desired is drained, then
  removed once idle.
- **Added at runtime**: a backend starts *unhealthy* and is health-checked at once; the first good
  check admits it (``readmit_after`` of them), and admission is its cold start
  (``RouterState.backend_reset``: warming, preloads when the ``cold_start`` feature is on). Until then it
  takes no traffic. Backends of the config at start are healthy from the start, as before.
- **Drain, then remove**: a draining backend takes no new requests; :meth:`Fleet.reap` (every
  ``REAP_INTERVAL_S`` while the loops run, and at once after a drain) removes the ones marked for
  removal whose LoadTable row of this process is zero (``BackendState.idle``), stopping their KV event
  subscriber; and each time, ``prune_upstream`` (the router's transport's ``prune``) is given the URLs
  listed now, so the pooled upstream connections of a removed backend are closed, also those a health
  check or scrape begun before the removal opened after it: nothing a removed backend held stays
  open. A backend drained through the admin API's ``/drain`` stays draining (and listed) until
  deleted or undrained.

All of it runs on the router's event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq.asyncio

from kvroute.prepare.events import EventSubscriber
from kvroute.server.config import BackendSpec
from kvroute.server.state.backends import ACTIVE, DRAINING, BackendState
from kvroute.server.state.router import RouterState
from kvroute.server.sync.monitor import Monitor

__all__ = ["ADMIN", "REAP_INTERVAL_S", "STATIC", "Changes", "Fleet"]

log = logging.getLogger("kvroute.server")

STATIC = "static"
ADMIN = "admin"
REAP_INTERVAL_S = 0.05
"""Seconds between checks for drained backends to remove."""


@dataclass(frozen=True, slots=True)
class Changes:
    """What one reconcile did, by URL: ``added``; ``drained`` (removed once idle); ``updated`` (spec
    changed; ``resubscribed`` among them: KV events changed); ``reactivated`` (was draining)."""

    added: tuple[str, ...] = ()
    drained: tuple[str, ...] = ()
    updated: tuple[str, ...] = ()
    resubscribed: tuple[str, ...] = ()
    reactivated: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.drained or self.updated or self.reactivated)

    def describe(self) -> str:
        """One line, e.g. ``+http://a:1 -http://b:2 ~http://c:3`` ("no change" when empty)."""
        parts = [f"+{u}" for u in self.added]
        parts += [f"-{u}" for u in self.drained]
        parts += [f"~{u}" + (" (kv events)" if u in self.resubscribed else "") for u in self.updated]
        parts += [f"^{u}" for u in self.reactivated]
        return " ".join(parts) if parts else "no change"


class Fleet:
    """Membership of ``core``'s backends (module docstring). ``subscribers`` is the live list of KV
    event subscribers (the exporter reads it). ``prune_upstream(urls)``: the transport keeps
    connections to ``urls`` (the listed backends' URLs) only, called at each :meth:`reap`. Loops and
    subscribers run only after :meth:`start`."""

    def __init__(
        self,
        core: RouterState,
        monitor: Monitor,
        subscribers: list[EventSubscriber],
        prune_upstream: Callable[[set[str]], None] | None = None,
    ) -> None:
        self.state = core
        self.monitor = monitor
        self.subscribers = subscribers
        self.prune_upstream = prune_upstream
        self.sources: dict[str, tuple[BackendSpec, ...]] = {STATIC: tuple(core.config.backends), ADMIN: ()}
        self.running = False
        self._zmq: zmq.asyncio.Context | None = None
        self._subs: dict[int, tuple[EventSubscriber, asyncio.Task[None]]] = {}
        self._removing: set[int] = set()  # draining, to be removed once idle
        self._held: set[int] = set()  # drained through the admin API: not reactivated by reconcile
        # source -> URL -> the spec that source listed when the admin API deleted the URL (masked)
        self._deleted: dict[str, dict[str, BackendSpec]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to the KV events of every listed exact backend; from now on, added backends are
        subscribed and health-checked at once."""
        self.running = True
        for b in self.state.live_backends():
            self._subscribe(b.index)

    async def stop(self) -> None:
        """Stop every subscriber and pending check (the backends stay as they are)."""
        self.running = False
        for index in list(self._subs):
            self._unsubscribe(index)
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    async def reap_loop(self, interval_s: float = REAP_INTERVAL_S) -> None:
        while True:
            self.reap()
            await asyncio.sleep(interval_s)

    # ---- sources --------------------------------------------------------------------------------

    def desired(self) -> list[BackendSpec]:
        """The union of the sources by URL (first listed wins; ``static`` first), without the entries
        masked by an admin deletion."""
        seen: dict[str, BackendSpec] = {}
        for name, specs in self.sources.items():
            masked = self._deleted.get(name, {})
            for s in specs:
                if masked.get(s.url) != s:
                    seen.setdefault(s.url, s)
        return list(seen.values())

    def set_source(self, name: str, specs: Sequence[BackendSpec]) -> Changes | None:
        """Replace source ``name``'s list; reconcile when it changed (None when it did not). A URL
        deleted through the admin API stays masked unless this source's own entry for it changed."""
        new = tuple(specs)
        if self.sources.get(name) == new:
            return None
        masked = self._deleted.get(name)
        if masked:
            listed = {s.url: s for s in new}
            for url in [u for u, spec in masked.items() if listed.get(u) != spec]:
                del masked[url]  # dropped or changed by its source: listing it (again) brings it back
        self.sources[name] = new
        return self.reconcile(self.desired())

    def forget(self, url: str) -> None:
        """The admin API deleted ``url``: off the admin list, and masked in every other source that
        lists it until that source's own entry for it changes (module docstring)."""
        for name, specs in self.sources.items():
            if name == ADMIN:
                self.sources[name] = tuple(s for s in specs if s.url != url)
                continue
            for s in specs:
                if s.url == url:
                    self._deleted.setdefault(name, {})[url] = s

    def deleted(self) -> dict[str, tuple[str, ...]]:
        """Source → the URLs masked in it by admin deletions (for tests and debugging)."""
        return {name: tuple(m) for name, m in self._deleted.items() if m}

    # ---- reconcile ------------------------------------------------------------------------------

    def reconcile(self, specs: Iterable[BackendSpec]) -> Changes:
        """Make the listed backends match ``specs`` (matched by URL; see the module docstring)."""
        core = self.state
        want: dict[str, BackendSpec] = {}
        for s in specs:
            want.setdefault(s.url, s)
        added: list[str] = []
        updated: list[str] = []
        resub: list[str] = []
        back: list[str] = []
        drained: list[str] = []
        for url, spec in want.items():
            b = core.find(url)
            if b is None:
                self.add(spec)
                added.append(url)
                continue
            if b.state == DRAINING and b.index not in self._held:
                core.reactivate_backend(b.index)
                self._removing.discard(b.index)
                back.append(url)
            old = core.specs[b.index]
            if old != spec:
                updated.append(url)
                if (old.kv_events, old.kv_replay) != (spec.kv_events, spec.kv_replay):
                    resub.append(url)
                self.update(b.index, spec)
        for b in core.live_backends():
            if b.url not in want and b.index not in self._removing:
                drained.append(b.url)
                self.drain(b.index, remove=True)
        return Changes(tuple(added), tuple(drained), tuple(updated), tuple(resub), tuple(back))

    # ---- one backend ----------------------------------------------------------------------------

    def add(self, spec: BackendSpec) -> BackendState:
        """Add ``spec`` (unhealthy until its first good health check, which runs now when the loops
        run). Raises ValueError for a URL already listed."""
        state = self.state.add_backend(spec, healthy=False)
        if self.running:
            self._subscribe(state.index)
            self._spawn(self.monitor.check_health(state))
        log.warning("added backend %s (index %d)", spec.url, state.index)
        return state

    def update(self, index: int, spec: BackendSpec) -> None:
        """Backend ``index`` now has ``spec``; its KV events are re-subscribed when they changed."""
        old = self.state.specs[index]
        events_changed = (old.kv_events, old.kv_replay) != (spec.kv_events, spec.kv_replay)
        if events_changed:
            self._unsubscribe(index)
        self.state.update_backend(index, spec)
        if events_changed:
            self._subscribe(index)

    def drain(self, index: int, remove: bool) -> None:
        """Backend ``index`` takes no new requests; with ``remove`` it is removed once idle (at once
        if idle now), else it stays draining (held: reconcile does not reactivate it)."""
        b = self.state.backends[index]
        if b.state not in (ACTIVE, DRAINING):
            return
        if b.state == ACTIVE:
            log.warning("draining backend %s (%d in flight)", b.url, b.waiting + b.running)
        self.state.drain_backend(index)
        if remove:
            self._removing.add(index)
            self._held.discard(index)
            self.reap()
        else:
            self._held.add(index)

    def undrain(self, index: int) -> bool:
        """A backend drained (not deleted) through the admin API takes traffic again; True if it was
        draining and not being removed."""
        if index in self._removing:
            return False
        self._held.discard(index)
        return self.state.reactivate_backend(index)

    def reap(self) -> list[BackendState]:
        """Remove the backends marked for removal that are idle now (returns them); the transport
        keeps connections to the listed backends only."""
        done = []
        for index in sorted(self._removing):
            b = self.state.backends[index]
            if b.idle:
                self._removing.discard(index)
                self._unsubscribe(index)
                self.state.remove_backend(index)
                log.warning("removed backend %s (drained)", b.url)
                done.append(b)
        if self.prune_upstream is not None:
            self.prune_upstream({b.url for b in self.state.live_backends()})
        return done

    def removing(self, index: int) -> bool:
        """True if backend ``index`` is draining to be removed."""
        return index in self._removing

    # ---- KV event subscribers --------------------------------------------------------------------

    def _subscribe(self, index: int) -> None:
        spec = self.state.specs[index]
        if not self.running or spec.kv_events is None or index in self._subs:
            return
        if self._zmq is None:
            self._zmq = zmq.asyncio.Context()
        core = self.state
        sub = EventSubscriber(self._zmq, index, spec.kv_events, spec.kv_replay, core.kv, core.clock)
        self.subscribers.append(sub)
        self._subs[index] = (sub, asyncio.create_task(sub.run()))

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s`` seconds) until every subscriber's replay on subscribe has
        ended: a router started after its engines then routes its first request on their replayed
        caches. True when all had ended in time."""
        waits = [sub.synced.wait() for sub in self.subscribers if not sub.synced.is_set()]
        if not waits:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*waits)
        except TimeoutError:
            return False
        return True

    def _unsubscribe(self, index: int) -> None:
        """Stop backend ``index``'s subscriber: once cancelled, its task applies no more batches
        (it resumes only to close its socket)."""
        entry = self._subs.pop(index, None)
        if entry is None:
            return
        sub, task = entry
        task.cancel()
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        with contextlib.suppress(ValueError):
            self.subscribers.remove(sub)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
