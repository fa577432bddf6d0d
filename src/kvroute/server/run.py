"""Running the router (and, for `kvroute up`, engines) until SIGTERM or Ctrl-C.

Signals (see :class:`Signals`): the first SIGTERM or SIGINT starts a graceful shutdown
(:meth:`kvroute.server.app.RouterServer.shutdown`: ``/health`` 503 at once, new requests refused after
``drain_grace_s``, requests in flight awaited up to ``drain_timeout_s``); a second one ends the drain at
once. Either way the process exits 0. SIGHUP is logged and ignored (config reload is not supported yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable

from kvroute.errors import UserError
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig

__all__ = ["Signals", "run_loop", "serve_forever", "serve_until_signal", "wait_for_signal"]


class Signals:
    """The process's signal handlers on the running loop, while in use (``with Signals() as s``).

    - ``stop``: set by the first SIGTERM or SIGINT;
    - ``hurry``: set by the next one (end the drain now);
    - SIGHUP: a line on stderr, nothing else (it no longer kills the process).
    """

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
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
            print(
                f"kvroute: {name}: config reload is not supported yet; still serving",
                file=sys.stderr,
                flush=True,
            )
        elif not self.stop.is_set():
            print(f"kvroute: {name}: shutting down gracefully", file=sys.stderr, flush=True)
            self.stop.set()
        else:
            print(f"kvroute: {name} again: ending requests in flight now", file=sys.stderr, flush=True)
            self.hurry.set()


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM (SIGHUP is logged and ignored)."""
    with Signals() as signals:
        await signals.stop.wait()


async def serve_until_signal(server: RouterServer) -> None:
    """Serve until SIGTERM/SIGINT, then drain and stop ``server`` (see the module docstring)."""
    with Signals() as signals:
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


def serve_forever(config: RouterConfig) -> int:
    async def main() -> int:
        server = RouterServer(config)
        try:
            url = await server.start()
        except OSError as exc:
            await server.stop()
            raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
        modes = ", ".join(f"{b.url} ({'exact' if b.kv_events else 'approx'})" for b in config.backends)
        print(
            f"kvroute serve: {url}/v1 policy={config.policy} backends: {modes}", file=sys.stderr, flush=True
        )
        await serve_until_signal(server)
        return 0

    return run_loop(main)
