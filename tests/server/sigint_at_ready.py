"""``python sigint_at_ready.py NEEDLE KVROUTE-ARGS...``: run ``kvroute KVROUTE-ARGS`` in this process
and send it SIGINT at the instant it announces readiness: right after it writes a stdout or stderr line
that starts with ``NEEDLE`` (``-``: no line triggers it), before it runs one more line of its own.

A worker of ``serve --workers`` (a spawned interpreter, which runs this file's top level as
``__mp_main__``) announces by sending ``("ready", url)`` to its supervisor: right after that send, it
SIGINTs its supervisor (a Ctrl-C, which the supervisor forwards to every worker) and itself (that
forward, arriving at once).

Sent from outside on reading the line, the signal would land a scheduler's whim later, and a test
would pass by luck on code that installs its handlers a moment after announcing; sent here, a front
door that announces before its handlers are in place is interrupted mid-start every time.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing import connection
from typing import Any, TextIO


class _Tripwire:
    """A text stream that SIGINTs this process once a line starting with ``needle`` is written."""

    def __init__(self, inner: TextIO, needle: str) -> None:
        self._inner = inner
        self._needle = needle
        self._line = ""
        self._fired = False

    def write(self, text: str) -> int:
        n = self._inner.write(text)
        self._line += text
        while "\n" in self._line:
            line, self._line = self._line.split("\n", 1)
            if not self._fired and self._needle and line.startswith(self._needle):
                self._fired = True
                self._inner.flush()
                os.kill(os.getpid(), signal.SIGINT)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _arm_worker() -> None:
    """In a spawned worker: SIGINT the supervisor and this worker right after it says it listens."""
    send = connection.Connection.send

    def send_then_sigint(self: connection.Connection, obj: Any) -> None:
        send(self, obj)
        if isinstance(obj, tuple) and obj[:1] == ("ready",):
            os.kill(os.getppid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    connection.Connection.send = send_then_sigint  # type: ignore[method-assign]


if __name__ == "__mp_main__":
    _arm_worker()

if __name__ == "__main__":
    from kvroute.cli import main

    needle = "" if sys.argv[1] == "-" else sys.argv[1]
    sys.stdout = _Tripwire(sys.stdout, needle)  # type: ignore[assignment]
    sys.stderr = _Tripwire(sys.stderr, needle)  # type: ignore[assignment]
    sys.exit(main(sys.argv[2:]))
