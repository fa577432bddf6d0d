"""Backend discovery: DNS names and watched files → lists of backends → :class:`~kvroute.server.sync.fleet.Fleet`.

Sources (``config.discover``, ``--discover``; checked every ``config.discover_interval_s`` seconds):

- ``dns://NAME:PORT``: ``NAME``'s A and AAAA records (the event loop's ``getaddrinfo``), each address
  a backend ``http://ADDR:PORT`` (IPv6 in brackets): what a Kubernetes headless Service lists, one
  address per ready pod. KV events: ``config.discover_kv_events`` with ``{host}`` replaced by the
  address (e.g. ``tcp://{host}:5557``), else the approximate KV view. A failed lookup keeps the current
  list (logged once when lookups start failing, once when they work again).
- ``file://PATH``: a YAML file listing backends as the config's ``backends:`` does (a list, or a
  mapping with ``backends:``), or plain text with one URL per line (``#`` starts a comment). Re-read
  when its modification time changes; an unreadable or invalid file keeps the current list (logged
  once per change of state).

Each source's list replaces its own entry in the fleet (:meth:`Fleet.set_source`), which reconciles
the union of all sources when a list changed; discovery never removes the static backends.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from kvroute.server.config import BackendSpec, RouterConfig, parse_backend_url
from kvroute.server.sync.fleet import Fleet

__all__ = [
    "Discovery",
    "DnsSource",
    "FileSource",
    "ParseBackends",
    "Resolver",
    "make_source",
    "parse_backends_text",
]

log = logging.getLogger("kvroute.server")

Resolver = Callable[[str, int], Awaitable[list[tuple[str, int]]]]
"""``(name, port) → [(address, port), ...]``; raises OSError when the name does not resolve."""


async def resolve_getaddrinfo(name: str, port: int) -> list[tuple[str, int]]:
    """A and AAAA records of ``name`` through the running loop's ``getaddrinfo``, in its order,
    without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    out: list[tuple[str, int]] = []
    for family, _type, _proto, _canon, addr in infos:
        if family in (socket.AF_INET, socket.AF_INET6):
            item = (str(addr[0]), int(addr[1]))
            if item not in out:
                out.append(item)
    return out


class DnsSource:
    """``dns://NAME:PORT`` (module docstring). ``resolve`` is the seam tests replace."""

    def __init__(
        self, name: str, port: int, kv_events: str | None = None, resolve: Resolver = resolve_getaddrinfo
    ) -> None:
        self.name = name
        self.port = port
        self.kv_events = kv_events
        self.resolve = resolve
        self.key = f"dns://{name}:{port}"
        self.failing = False

    async def poll(self) -> tuple[BackendSpec, ...] | None:
        """The backends the name lists now; None when the lookup failed (keep the current list)."""
        try:
            addrs = await self.resolve(self.name, self.port)
        except (OSError, UnicodeError) as exc:
            if not self.failing:
                log.warning("discovery %s: lookup failed, keeping the current backends: %s", self.key, exc)
            self.failing = True
            return None
        if self.failing:
            log.warning("discovery %s: lookups work again (%d addresses)", self.key, len(addrs))
        self.failing = False
        specs = []
        for addr, port in addrs:
            host = f"[{addr}]" if ":" in addr else addr
            events = self.kv_events.format(host=host) if self.kv_events else None
            specs.append(BackendSpec(f"http://{host}:{port}", events))
        return tuple(specs)


ParseBackends = Callable[[str, str], tuple[BackendSpec, ...]]
"""``(text, where) → backends``; raises UserError naming ``where``. The YAML reader is
``kvroute.commands.settings.backends_from_text`` (flag and YAML parsing live in ``commands``), which
``kvroute serve`` passes in; the default, :func:`parse_backends_text`, reads plain lines only."""


def parse_backends_text(text: str, where: str) -> tuple[BackendSpec, ...]:
    """Backends listed in ``text``, one URL per line (``#`` starts a comment); UserError naming
    ``where`` for a line that is not a URL."""
    specs = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            try:
                specs.append(BackendSpec(parse_backend_url(line)))
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
    return tuple(specs)


class FileSource:
    """``file://PATH`` (module docstring)."""

    def __init__(self, path: str, parse: ParseBackends = parse_backends_text) -> None:
        self.path = Path(path)
        self.parse = parse
        self.key = f"file://{path}"
        self._mtime: int | None = None
        self.failing = False

    async def poll(self) -> tuple[BackendSpec, ...] | None:
        """The backends the file lists when it changed; None when unchanged or unreadable/invalid."""
        try:
            mtime = self.path.stat().st_mtime_ns
            if mtime == self._mtime and not self.failing:
                return None
            specs = self.parse(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, UnicodeError, UserError) as exc:
            if not self.failing:
                log.warning("discovery %s: keeping the current backends: %s", self.key, exc)
            self.failing = True
            return None
        if self.failing:
            log.warning("discovery %s: readable again (%d backends)", self.key, len(specs))
        self.failing = False
        self._mtime = mtime
        return specs


Source = DnsSource | FileSource


def make_source(
    text: str,
    kv_events: str | None = None,
    resolve: Resolver | None = None,
    parse: ParseBackends | None = None,
) -> Source:
    """A source from ``dns://NAME:PORT`` or ``file://PATH``; UserError otherwise."""
    if text.startswith("dns://"):
        name, sep, port = text[len("dns://") :].rpartition(":")
        if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
            raise UserError(f"--discover {text!r}: expected dns://NAME:PORT")
        return DnsSource(name.strip("[]"), int(port), kv_events, resolve or resolve_getaddrinfo)
    if text.startswith("file://") and len(text) > len("file://"):
        return FileSource(text[len("file://") :], parse or parse_backends_text)
    raise UserError(f"--discover {text!r}: expected dns://NAME:PORT or file://PATH")


class Discovery:
    """The sources of ``config.discover`` feeding ``fleet``. ``resolve`` replaces DNS lookups (tests);
    ``parse`` reads a watched file (see :data:`ParseBackends`)."""

    def __init__(
        self,
        config: RouterConfig,
        fleet: Fleet,
        resolve: Resolver | None = None,
        parse: ParseBackends | None = None,
    ) -> None:
        self.fleet = fleet
        self.interval_s = config.discover_interval_s
        self.sources = [make_source(t, config.discover_kv_events, resolve, parse) for t in config.discover]

    async def poll(self, source: Source) -> None:
        """Check ``source`` once; hand a changed list to the fleet and log what changed."""
        specs = await source.poll()
        if specs is None:
            return
        changes = self.fleet.set_source(source.key, specs)
        if changes:
            log.warning("discovery %s: %s", source.key, changes.describe())

    async def watch(self, source: Source) -> None:
        while True:
            await self.poll(source)
            await asyncio.sleep(self.interval_s)

    def watchers(self) -> list[Coroutine[Any, Any, None]]:
        """One loop per source (the server runs them as tasks)."""
        return [self.watch(s) for s in self.sources]
