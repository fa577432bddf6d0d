"""Children that die with their parent: ``python -m kvroute.procguard PARENT_PID SIGNAL CMD...``.

A process ``kvroute up`` (or the demo, or a benchmark) starts is run through this module: it asks
Linux to send it ``SIGNAL`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``, kept across
``execve``), checks that ``PARENT_PID`` is still its parent (it may have died before the request was
made; then it exits at once), and replaces itself with ``CMD`` (same pid). So however the parent
ends, its ``finally`` run or not (SIGKILL, a crash, the OOM killer), each child receives ``SIGNAL``.

Why this and not a watchdog on a pipe: it needs nothing from the child, so it works alike for
emulated engines, ``vllm serve`` and Envoy; and an ``exec`` wrapper rather than
``subprocess.Popen(preexec_fn=...)``, which is unsafe in a process with threads. The signal is
SIGTERM: a child then stops as on a normal shutdown (``vllm serve`` takes its engine-core process
down with it; the death signal itself reaches only the direct child, not its children).
On a system without ``prctl`` (not Linux) the command runs unguarded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["guarded"]

_PR_SET_PDEATHSIG = 1


def guarded(argv: Sequence[str], sig: int = signal.SIGTERM) -> list[str]:
    """``argv`` run so that it receives ``sig`` when this process dies (module docstring)."""
    return [sys.executable, "-m", "kvroute.procguard", str(os.getpid()), str(int(sig)), *argv]


def _set_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when the parent dies; False where the call is missing (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return int(libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)) == 0


def main(args: Sequence[str]) -> int:
    if len(args) < 3:
        print("usage: python -m kvroute.procguard PARENT_PID SIGNAL CMD...", file=sys.stderr)
        return 2
    parent, sig, cmd = int(args[0]), int(args[1]), list(args[2:])
    if _set_death_signal(sig) and os.getppid() != parent:  # the parent died before the call
        return 128 + sig
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
