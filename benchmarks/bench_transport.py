"""The router's upstream client, A/B: :class:`~kvroute.server.wire.h1.H1Transport` (the default)
vs aiohttp's client (:class:`~kvroute.server.wire.transport.AiohttpTransport`), router CPU per request.

Copies this checkout's ``src`` twice into a temporary directory; in one copy the router's default
transport is replaced by ``AiohttpTransport`` (the only change), and both go through
:mod:`benchmarks.peers_ab` (same engines, same arrivals, order rotated each round): path ``kvroute``
is H1Transport, ``kvroute-base`` aiohttp's client. ``AB_RATES`` (default ``50,125`` req/s) and
``AB_ROUNDS`` (default 6) set the schedule. Writes ``benchmarks/results/transport.json``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import benchmarks.peers_ab as ab

SRC = Path(__file__).resolve().parent.parent / "src"
RESULTS = Path(__file__).resolve().parent / "results"
_DEFAULT = """self.transport: Transport = transport or H1Transport(
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.upstream_timeout_s
        )"""
_AIOHTTP = """self.transport: Transport = transport or AiohttpTransport(
            connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.upstream_timeout_s
        )"""


def _trees(root: Path) -> tuple[Path, Path]:
    """(aiohttp's tree, H1's tree) under ``root``."""
    h1, aio = root / "h1", root / "aiohttp"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(SRC, h1, ignore=ignore)
    shutil.copytree(SRC, aio, ignore=ignore)
    app = aio / "kvroute" / "server" / "app.py"
    text = app.read_text()
    if _DEFAULT not in text:
        raise SystemExit("bench_transport: the router's default transport is no longer where expected")
    text = text.replace(_DEFAULT, _AIOHTTP)
    text = text.replace(
        "\nfrom kvroute.server.wire.h1 import H1Transport\n",
        "\nfrom kvroute.server.wire.h1 import H1Transport\nfrom kvroute.server.wire.transport import AiohttpTransport\n",
    )
    app.write_text(text)
    return aio, h1


def main() -> int:
    os.environ.setdefault("AB_RATES", "50,125")
    os.environ.setdefault("AB_ROUNDS", "6")
    os.environ.setdefault("AB_OUT", str(RESULTS / "transport.json"))
    with tempfile.TemporaryDirectory(prefix="kvroute-transport-ab-") as tmp:
        aio, h1 = _trees(Path(tmp))
        return ab.main([str(aio), str(h1)])


if __name__ == "__main__":
    sys.exit(main())
