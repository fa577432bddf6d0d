"""`kvroute epp` on the command line: its errors are one line and exit status 2."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")


def test_grpc_port_taken_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [sys.executable, "-m", "kvroute.cli", "epp", "--grpc-port", str(port), "--port", "0"]
        out = subprocess.run(
            [*argv, "--backend", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=120
        )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"kvroute: error: cannot listen on 127.0.0.1:{port} (gRPC): Address already in use"
    ]


@pytest.mark.parametrize(
    ("args", "needle"),
    [(["--grpc-port", "70000"], "--grpc-port"), (["--kv-events", "nope"], "--kv-events")],
)
def test_bad_flags_are_one_line(args: list[str], needle: str) -> None:
    """One error line (argparse's usage lines may come first), naming the flag; never a traceback."""
    out = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "epp", *args], capture_output=True, text=True, timeout=120
    )
    lines = out.stderr.strip().splitlines()
    errors = [ln for ln in lines if not ln.startswith(("usage:", " "))]
    assert out.returncode == 2 and len(errors) == 1 and needle in errors[0], out.stderr
    assert "Traceback" not in out.stderr
