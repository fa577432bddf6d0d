"""Front doors the suite can drive, and the processes behind them.

A front door is anything that listens for OpenAI-style HTTP and forwards to upstreams: ``kvroute
serve`` today, Envoy with ``kvroute epp`` later. The suite needs only :class:`FrontDoor`: where it
listens, and what its log says went wrong since a mark. A :data:`FrontDoorFactory` starts one in
front of a list of upstream base URLs (registering them however that front door learns its
upstreams) and stops it on exit.

:func:`serve_front_door` is the factory for ``kvroute serve`` (a child process);
:func:`emulated_engine` starts a real emulated vLLM engine (``kvroute engine``) to stand beside the
misbehaving upstream.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

__all__ = [
    "FrontDoor",
    "FrontDoorFactory",
    "ProcessFrontDoor",
    "emulated_engine",
    "log_problems",
    "serve_front_door",
]


class FrontDoor(Protocol):
    """A running front door: ``host``:``port`` it listens on; :meth:`mark` a position in its log;
    :meth:`problems` what went wrong after ``since``. ``client_fault``: the case was a client's
    doing, so an upstream taken out of service is a problem too."""

    host: str
    port: int

    def mark(self) -> int: ...

    def problems(self, since: int, client_fault: bool) -> list[str]: ...


FrontDoorFactory = Callable[[Sequence[str]], AbstractContextManager[FrontDoor]]
"""Starts a front door in front of these upstream base URLs; stops it on exit."""


def log_problems(text: str, client_fault: bool) -> list[str]:
    """What a kvroute log says went wrong: a traceback, a fatal transport error, and (after a
    client's doing) an ejected backend."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Traceback (most recent call last)" in line or "Fatal error" in line:
            tail = " | ".join(x.strip() for x in lines[i + 1 : i + 40] if x.strip() and not x.startswith(" "))
            out.append(f"the log has a traceback: {line.strip()} {tail[:300]}")
        elif client_fault and "ejected backend" in line:
            out.append(f"a client's doing ejected a backend: {line.strip()[:300]}")
    return out


@dataclass
class ProcessFrontDoor:
    """A front door run as a child process whose output goes to ``log``."""

    host: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def mark(self) -> int:
        return self.log.stat().st_size

    def problems(self, since: int, client_fault: bool) -> list[str]:
        with self.log.open("rb") as f:
            f.seek(since)
            text = f.read().decode("utf-8", "replace")
        out = log_problems(text, client_fault)
        if self.proc.poll() is not None:
            out.append(f"the front door exited with {self.proc.returncode}")
        return out

    def log_text(self) -> str:
        return self.log.read_text("utf-8", "replace")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float, ok: Callable[[int], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if ok(r.status):
                    return
        except urllib.error.HTTPError as e:
            if ok(e.code):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready in {timeout_s} s")


def _kvroute(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvroute.cli", *args]


@contextlib.contextmanager
def _process(argv: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def serve_front_door(
    backends: Sequence[str], extra: Sequence[str] = (), log_dir: str | None = None, timeout_s: float = 60.0
) -> Iterator[ProcessFrontDoor]:
    """``kvroute serve`` on a free loopback port in front of ``backends`` (``extra``: more flags),
    health-checked every 0.2 s; yields once its ``/livez`` answers."""
    port = _free_port()
    with tempfile.TemporaryDirectory(dir=log_dir) as tmp:
        log = Path(tmp) / "serve.log"
        argv = _kvroute("serve", "--port", str(port), "--health-interval", "0.2", *extra)
        for b in backends:
            argv += ["--backend", b]
        with _process(argv, log) as proc:
            _wait_http(f"http://127.0.0.1:{port}/livez", proc, timeout_s, lambda s: s == 200)
            yield ProcessFrontDoor("127.0.0.1", port, proc, log)


@contextlib.contextmanager
def emulated_engine(model: str = "emu", time_scale: float = 50.0, timeout_s: float = 60.0) -> Iterator[str]:
    """``kvroute engine`` serving ``model`` on a free loopback port, ``time_scale`` times faster
    than its cost model; yields its base URL once ``/health`` answers."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        argv = _kvroute("engine", "--port", str(port), "--model", model, "--time-scale", str(time_scale))
        with _process(argv, Path(tmp) / "engine.log") as proc:
            url = f"http://127.0.0.1:{port}"
            _wait_http(url + "/health", proc, timeout_s, lambda s: s == 200)
            yield url
