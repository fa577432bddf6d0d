"""Admin changes shared by the workers of one machine (``kvroute serve --workers N``).

A connection reaches one worker, so an admin call (:mod:`kvroute.server.sync.admin`) changes that worker's
backends only. Each change is therefore also appended to a journal: an append-only file of JSON lines
in a folder the supervisor creates (and removes), one line per change, written with one ``write`` on a
file opened with ``O_APPEND`` (so lines from several workers never interleave). Every worker follows the
file (:meth:`AdminJournal.follow`, polling every ``interval_s``) and applies the lines written by other
processes; a worker that starts, or restarts after a crash, applies the whole journal first, so it
holds the same admin changes as its siblings.

Lines: ``{"by": PROCESS_ID, "op": "add" | "delete" | "drain" | "undrain", "url": URL, "spec": {...}}``
(``spec`` only for ``add``: the :class:`~kvroute.server.config.BackendSpec` fields). A line that does
not parse is logged and skipped. With one process there is no journal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["AdminJournal"]

log = logging.getLogger("kvroute.server")


class AdminJournal:
    """The journal at ``path`` as seen by one process (``by``: its id, random per process start)."""

    def __init__(self, path: str, interval_s: float = 0.1) -> None:
        self.path = path
        self.interval_s = interval_s
        self.by = secrets.token_hex(8)
        self._offset = 0
        self._partial = b""
        self.applied = 0
        self.bad_lines = 0

    def append(self, op: str, url: str, spec: dict[str, Any] | None = None) -> None:
        """Record one change made by this process (one write, atomic with ``O_APPEND``)."""
        line: dict[str, Any] = {"by": self.by, "op": op, "url": url}
        if spec is not None:
            line["spec"] = spec
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, orjson.dumps(line) + b"\n")
        finally:
            os.close(fd)

    def read_new(self) -> list[dict[str, Any]]:
        """The complete lines written since the last call, by other processes (own ones skipped)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        out = []
        for raw in lines:
            if not raw.strip():
                continue
            try:
                line = orjson.loads(raw)
                if not isinstance(line, dict) or not isinstance(line.get("op"), str):
                    raise ValueError("not a change")
            except (orjson.JSONDecodeError, ValueError) as exc:
                self.bad_lines += 1
                log.warning("admin journal %s: bad line skipped (%s)", self.path, exc)
                continue
            if line.get("by") != self.by:
                out.append(line)
        return out

    def catch_up(self, apply: Callable[[dict[str, Any]], None]) -> int:
        """Apply the other processes' changes not applied yet; returns how many."""
        n = 0
        for line in self.read_new():
            try:
                apply(line)
            except Exception as exc:  # one bad change must not stop the others
                log.warning("admin journal: change %s not applied: %r", line, exc)
                continue
            n += 1
        self.applied += n
        return n

    async def follow(self, apply: Callable[[dict[str, Any]], None]) -> None:
        """Apply the other workers' changes as they come (until cancelled)."""
        while True:
            self.catch_up(apply)
            await asyncio.sleep(self.interval_s)
