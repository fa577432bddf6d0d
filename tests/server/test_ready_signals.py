"""Every front door announces readiness only once its SIGINT/SIGTERM handlers are in place: a SIGINT
that arrives the instant it announces (``sigint_at_ready.py``: sent by the process itself, right after
the line or, for a worker of ``serve --workers``, the ``ready`` message) drains it like any later one.

Real processes on loopback (an unreachable backend is enough: nothing is routed). Each must exit 0
(as after any graceful stop), say which signal stopped it, print no traceback, and leave no process of
its session behind (workers, engines, multiprocessing's resource tracker). Before the fix, ``epp``
and ``serve`` in P/D mode exited 130 (asyncio's own handler cancelled the main task), and a worker of
``serve --workers`` printed a KeyboardInterrupt traceback and its supervisor never exited; the
emulated engine (``kvroute engine``) printed a KeyboardInterrupt traceback. A hang
guard of 120 s, no speed claim."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .sessionproc import run_in_session

LAUNCHER = str(Path(__file__).with_name("sigint_at_ready.py"))
NOWHERE = "http://127.0.0.1:9"  # nothing listens: the router starts with an unhealthy backend

FRONT_DOORS: dict[str, tuple[str, list[str]]] = {  # name: (the ready line's start, the arguments)
    "serve": ("kvroute serve: ", ["serve", "--backend", NOWHERE]),
    "serve --workers 2": ("-", ["serve", "--backend", NOWHERE, "--workers", "2"]),
    "serve P/D": ("kvroute serve (P/D): ", ["serve", "--decode", NOWHERE]),
    "epp": ("kvroute epp: ", ["epp", "--backend", NOWHERE, "--grpc-port", "0"]),
    "up": ("router: ", ["up", "--instances", "1"]),
    "engine": ("kvroute engine: ", ["engine"]),  # not a front door, but `up` and users launch it alike
}


@pytest.mark.parametrize("door", list(FRONT_DOORS))
def test_sigint_at_the_ready_announcement_drains(door: str) -> None:
    if door == "epp":
        pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
    needle, args = FRONT_DOORS[door]
    rc, text, left = run_in_session([sys.executable, LAUNCHER, needle, *args, "--port", "0"])
    assert rc == 0, f"{door} exited {rc}: {text[-3000:]}"
    assert "Traceback" not in text, text[-3000:]
    assert "SIGINT" in text, text[-3000:]  # its handler saw the signal (a graceful stop says so)
    assert left == [], f"{door} left processes behind: {left}"
