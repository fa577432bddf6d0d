"""A command run as a real process in its own session, for the tests of how front doors start and
stop: its exit status, its stderr, and the processes of its session still alive once it exited
(every descendant that did not call setsid: workers, engines, multiprocessing's resource tracker)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import kvroute

__all__ = ["SRC", "left_in", "run_in_session", "session"]

SRC = str(Path(kvroute.__file__).resolve().parents[1])  # the kvroute under test, for the subprocess


def session(sid: int) -> list[int]:
    """The live processes of session ``sid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z" and int(fields[3]) == sid:
                    out.append(int(entry))
    return out


def left_in(sid: int, timeout_s: float = 30.0) -> list[int]:
    """The processes of session ``sid`` still alive after waiting up to ``timeout_s`` for them to end."""
    deadline = time.monotonic() + timeout_s
    while (left := session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_in_session(argv: list[str], timeout_s: float = 120.0) -> tuple[int, str, list[int]]:
    """Run ``argv`` (with this kvroute on ``PYTHONPATH``) in a new session until it exits (a hang
    guard of ``timeout_s``); (exit status, stderr, the pids of its session left alive). Whatever a
    failed run leaves is SIGKILLed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout_s)
        left = left_in(proc.pid)
    finally:
        for pid in [proc.pid, *session(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, err.decode(errors="replace"), left
