"""Running the router (and, for `kvroute up`, engines) until SIGTERM or Ctrl-C.

Signals (see :class:`Signals`): the first SIGTERM or SIGINT starts a graceful shutdown
(:meth:`kvroute.server.app.RouterServer.shutdown`: ``/health`` 503 at once, new requests refused after
``drain_grace_s``, requests in flight awaited up to ``drain_timeout_s``); a second one ends the drain at
once. Either way the process exits 0.

SIGHUP reloads the config (:class:`Reloader`): ``kvroute serve --config FILE`` re-reads FILE, merges
the command-line flags over it as at start, and applies the backends, the policy and the features
(:meth:`RouterServer.apply_config`; requests in flight are not touched); one line on stderr says what
changed. A file that cannot be read or is invalid is rejected with one line naming it and the error,
and the old config stays. Without ``--config`` a line says there is nothing to reload.

Readiness: every front door (``serve``, each worker of ``serve --workers``, ``serve`` in P/D mode,
``epp``, ``up``) announces that it listens from the ``ready`` callback of :func:`serve_until_signal`
or :func:`wait_for_signal`, which runs once these handlers are in place: a SIGINT sent on reading the
announcement always drains. Before them it reached asyncio's own SIGINT handler, which cancels the
main task mid-start (a traceback, exit status 130, or a hang).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvroute.errors import UserError
from kvroute.policies.registry import make_policy
from kvroute.routing.core import with_features
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig, queue_note
from kvroute.server.sync.discovery import ParseBackends

__all__ = [
    "Reloadable",
    "Reloader",
    "Signals",
    "run_loop",
    "serve_forever",
    "serve_until_signal",
    "wait_for_signal",
]


def _say(line: str) -> None:
    print(f"kvroute: {line}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Reloader:
    """What SIGHUP reloads: ``path`` (the ``--config`` file; None: nothing to reload) and ``load``,
    which re-reads it with the command-line flags merged over it (raises UserError)."""

    path: str | None
    load: Callable[[], RouterConfig]

    def checked(self) -> RouterConfig:
        """Re-read the file and check what :meth:`RouterServer.apply_config` would reject (its values,
        the policy with its features) without applying it; raises UserError, ValueError or TypeError."""
        new = self.load().validate()
        with_features(make_policy(new.policy), new.features)
        return new

    def reload(self, server: Reloadable) -> bool:
        """Reload into ``server``; one line on stderr either way. True if applied."""
        if self.path is None:
            _say("SIGHUP: no --config file: nothing to reload; still serving")
            return False
        try:
            summary = server.apply_config(self.load())
        except (UserError, ValueError, TypeError) as exc:
            _say(f"SIGHUP: {self.path} rejected, keeping the old config: {exc}")
            return False
        _say(f"SIGHUP: reloaded {self.path}: {summary}")
        return True


class Signals:
    """The process's signal handlers on the running loop, while in use (``with Signals() as s``).

    - ``stop``: set by the first SIGTERM or SIGINT;
    - ``hurry``: set by the next one (end the drain now);
    - SIGHUP: ``on_hup()`` (a reload) when given, else a line on stderr; never kills the process.
    """

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, on_hup: Callable[[], object] | None = None) -> None:
        self.on_hup = on_hup
        self.stop = asyncio.Event()
        self.hurry = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> Signals:
        self._loop = asyncio.get_running_loop()
        for sig in self.HANDLED:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None:
            for sig in self.HANDLED:
                with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                    self._loop.remove_signal_handler(sig)
            self._loop = None

    def _on_signal(self, sig: signal.Signals) -> None:
        name = signal.Signals(sig).name
        if sig == signal.SIGHUP:
            if self.on_hup is not None:
                self.on_hup()
            else:
                _say(f"{name}: nothing to reload here; still serving")
        elif not self.stop.is_set():
            print(f"kvroute: {name}: shutting down gracefully", file=sys.stderr, flush=True)
            self.stop.set()
        else:
            print(f"kvroute: {name} again: ending requests in flight now", file=sys.stderr, flush=True)
            self.hurry.set()


async def wait_for_signal(ready: Callable[[], object] | None = None) -> None:
    """Return on SIGINT or SIGTERM (SIGHUP is logged and ignored); ``ready()`` runs once the handlers
    are in place (see :func:`serve_until_signal`)."""
    with Signals() as signals:
        if ready is not None:
            ready()
        await signals.stop.wait()


class Reloadable(Protocol):
    """What SIGHUP reloads and SIGTERM drains: a :class:`RouterServer`, or a server around one."""

    def apply_config(self, new: RouterConfig) -> str: ...

    async def shutdown(self, hurry: asyncio.Event | None = None) -> int: ...

    async def stop(self) -> None: ...


async def serve_until_signal(
    server: Reloadable, reloader: Reloader | None = None, ready: Callable[[], object] | None = None
) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop ``server``; SIGHUP reloads with ``reloader``
    (see the module docstring). ``ready()`` runs once the handlers are in place: a caller announces
    readiness there, so that a signal sent on reading the announcement always drains (before them, a
    SIGINT reached asyncio's own handler, which cancelled the main task mid-start)."""
    reload = None if reloader is None else (lambda: reloader.reload(server))
    with Signals(reload) as signals:
        if ready is not None:
            ready()
        try:
            await signals.stop.wait()
        except BaseException:
            await server.stop()
            raise
        await server.shutdown(signals.hurry)


def run_loop(main: Callable[[], Awaitable[int]]) -> int:
    """Run ``main`` on uvloop (asyncio if unavailable)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(main())  # type: ignore[arg-type]
    return uvloop.run(main())  # type: ignore[arg-type]


def serve_forever(
    config: RouterConfig,
    reloader: Reloader | None = None,
    parse_backends: ParseBackends | None = None,
) -> int:
    """``kvroute serve``: run the router until SIGTERM/SIGINT (``reloader``: what SIGHUP reloads;
    ``parse_backends``: the reader of discovery files, see :mod:`kvroute.server.sync.discovery`)."""

    async def main() -> int:
        server = RouterServer(config, parse_backends=parse_backends)
        try:
            url = await server.start()
        except OSError as exc:
            await server.stop()
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
        # What start-up built (tokenizer, chat template, app) lives as long as the process: keep it
        # out of the cyclic collector's full passes, which otherwise walk it again and again.
        gc.freeze()
        modes = ", ".join(f"{b.url} ({'exact' if b.kv_events else 'approx'})" for b in config.backends)
        found = f" discover: {', '.join(config.discover)}" if config.discover else ""
        admin = f" admin API on; dashboard: {url}/dashboard" if config.admin_token is not None else ""
        line = (
            f"kvroute serve: {url}/v1 policy={config.policy} {queue_note(config)} "
            f"backends: {modes or '(none yet)'}{found}{admin}"
        )
        await serve_until_signal(server, reloader, lambda: print(line, file=sys.stderr, flush=True))
        return 0

    return run_loop(main)
