"""Nothing ``kvroute up`` starts outlives it, however it is stopped: SIGTERM, SIGINT, SIGTERM then
SIGKILL 2 s later, and SIGKILL alone. Real processes: ``up`` with two emulated engines; the engines
are found as ``up``'s children in ``/proc`` and must all be gone after ``up`` is (a hang guard of
60 s, no speed claim)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from .upproc import Up, alive, children_of, start_up


def _gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids of ``pids`` still alive after waiting up to ``timeout_s`` for them to end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _engines(up: Up) -> list[int]:
    kids = children_of(up.proc.pid)
    assert len(kids) == 2, kids  # the two engines (each exec'd in place: same pid)
    for pid in kids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert b"engine" in f.read()
    return kids


@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT", "SIGTERM+SIGKILL", "SIGKILL"])
def test_engines_die_with_up(tmp_path: Path, how: str) -> None:
    up = start_up(tmp_path, "--instances", "2")
    kids: list[int] = []
    try:
        kids = _engines(up)
        if how == "SIGKILL":
            up.proc.kill()
        else:
            up.proc.send_signal(signal.SIGINT if how == "SIGINT" else signal.SIGTERM)
            if how == "SIGTERM+SIGKILL":
                time.sleep(2.0)
                with contextlib.suppress(ProcessLookupError):
                    up.proc.kill()
        up.proc.wait(60)
        assert _gone(kids) == [], f"engines outlived `up` stopped by {how}"
    finally:
        for pid in kids:  # whatever a failed run left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        up.kill_all()


@pytest.mark.parametrize("how", ["SIGTERM+SIGKILL", "SIGKILL"])
def test_envoy_dies_with_up(tmp_path: Path, how: str) -> None:
    """``up --gateway envoy``: Envoy (started by the event loop's thread, so its death signal holds
    for the process's life) is gone with ``up`` too."""
    pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
    from kvroute.errors import UserError
    from kvroute.server.extproc.envoyproc import find_envoy

    try:
        find_envoy()
    except UserError as exc:
        pytest.skip(f"no Envoy: {exc}")
    up = start_up(tmp_path, "--instances", "1", "--gateway", "envoy")
    kids: list[int] = []
    try:
        kids = children_of(up.proc.pid)
        names = []
        for pid in kids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                names.append(f.read())
        assert any(b"envoy" in n and b"engine" not in n for n in names), names  # Envoy, exec'd in place
        if how == "SIGTERM+SIGKILL":
            up.proc.send_signal(signal.SIGTERM)
            time.sleep(2.0)
        with contextlib.suppress(ProcessLookupError):
            up.proc.kill()
        up.proc.wait(60)
        assert _gone(kids) == [], f"Envoy or an engine outlived `up` stopped by {how}"
    finally:
        for pid in kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        up.kill_all()
