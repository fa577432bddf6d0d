"""``kvroute up`` as a real process for tests: started in its own session with stderr to a file, the
router's base URL read from its ``router: URL`` line; its children found through ``/proc``."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvroute.server.cluster import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    base: str  # http://127.0.0.1:PORT (no /v1)
    port: int
    err: Path  # its stderr

    def log(self) -> bytes:
        return self.err.read_bytes()

    def kill_all(self) -> None:
        """SIGKILL ``up``'s process group (the test's cleanup: whatever the test left)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_up(tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 120.0) -> Up:
    """``kvroute up --port FREE ARGS`` started and listening (its ``router:`` line read)."""
    port = free_port()
    argv = [sys.executable, "-m", "kvroute.cli", "up", "--port", str(port), *args]
    full = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full.update(env or {})
    err = tmp_path / f"up-{port}.err"
    with err.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=out, env=full, start_new_session=True)
    line = b""
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if line.startswith(b"router: "):
                break
    if not line.startswith(b"router: "):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        raise AssertionError(f"kvroute up did not start: {proc.returncode} {err.read_text()[-2000:]}")
    base = line.split()[1].decode().removesuffix("/v1")
    return Up(proc, base, port, err)


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (from ``/proc/PID/task/*/children``)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    return out


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
