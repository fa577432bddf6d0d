"""Running the router (and, for `kvroute up`, engines) until Ctrl-C or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Awaitable, Callable

from kvroute.errors import UserError
from kvroute.server.app import RouterServer
from kvroute.server.config import RouterConfig

__all__ = ["run_loop", "serve_forever", "wait_for_signal"]


async def wait_for_signal() -> None:
    """Return on SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


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
        try:
            await wait_for_signal()
        finally:
            await server.stop()
        return 0

    return run_loop(main)
