"""``python -m kvroute.conformance``: run the suite from the command line.

Two ways to use it:

- ``python -m kvroute.conformance`` starts everything itself: a misbehaving upstream (model
  ``faulty``), an emulated engine (model ``emu``) and ``kvroute serve`` in front of both;
- ``python -m kvroute.conformance --url http://HOST:PORT --upstream-port P [--engine-model M]``
  drives a front door you started: it runs a misbehaving upstream on port ``P`` (register
  ``http://127.0.0.1:P`` with your front door as the backend of model ``faulty``) and, with
  ``--engine-model``, uses a real engine you placed behind the same front door.

It prints one line per case and exits 1 when any case found a violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

from kvroute.conformance.clients import CLIENTS
from kvroute.conformance.faults import FAULTS
from kvroute.conformance.frontdoor import FrontDoor, emulated_engine, serve_front_door
from kvroute.conformance.runner import Harness, Report, Suite, Target, cases
from kvroute.conformance.upstream import MisbehavingUpstream


class _External:
    """A front door someone else started: ``log`` (optional) is its log file."""

    def __init__(self, url: str, log: str | None) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.log = log

    def mark(self) -> int:
        if self.log is None:
            return 0
        with open(self.log, "rb") as f:
            return f.seek(0, 2)

    def problems(self, since: int, client_fault: bool) -> list[str]:
        if self.log is None:
            return []
        from kvroute.conformance.frontdoor import log_problems

        with open(self.log, "rb") as f:
            f.seek(since)
            return log_problems(f.read().decode("utf-8", "replace"), client_fault)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvroute.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running front door (default: start kvroute serve)")
    p.add_argument("--log", help="the running front door's log file, checked for tracebacks")
    p.add_argument(
        "--upstream-port", type=int, default=0, help="port of the misbehaving upstream (default: free)"
    )
    p.add_argument("--upstream-model", default="faulty", help="model the misbehaving upstream serves")
    p.add_argument(
        "--engine-model", help="model of a real engine behind the front door (default: emu, started)"
    )
    p.add_argument("--client", action="append", choices=list(CLIENTS), help="only this client case (repeat)")
    p.add_argument("--fault", action="append", choices=list(FAULTS), help="only this upstream fault (repeat)")
    p.add_argument("--no-clients", action="store_true", help="no client cases (only the faults)")
    p.add_argument("--no-faults", action="store_true", help="no upstream faults (only the client cases)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds any one wait may take (default 10)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    harness = Harness()
    upstream = MisbehavingUpstream(args.upstream_model)
    try:
        harness.call(upstream.start(port=args.upstream_port))
        with _door(args, upstream.url) as (door, engine_model):
            targets = [Target("upstream", args.upstream_model, upstream)]
            if engine_model:
                targets.append(Target("engine", engine_model))
            suite = Suite(door, timeout_s=args.timeout)
            harness.call(suite.ready(targets))
            failed = 0
            clients = [] if args.no_clients else args.client
            faults = [] if args.no_faults else args.fault
            for case in cases(targets, clients, faults):
                report: Report = harness.call(suite.run(case))
                failed += bool(report.violations)
                print(("FAIL " if report.violations else "ok   ") + report.case, flush=True)
                for v in report.violations:
                    print("     " + v, flush=True)
            print(f"{failed} case(s) failed", flush=True)
            return 1 if failed else 0
    finally:
        harness.call(upstream.stop())
        harness.close()


@contextlib.contextmanager
def _door(args: argparse.Namespace, upstream_url: str) -> Iterator[tuple[FrontDoor, str | None]]:
    if args.url:
        yield _External(args.url, args.log), args.engine_model
        return
    with emulated_engine("emu") as engine, serve_front_door([upstream_url, engine]) as door:
        yield door, "emu"


if __name__ == "__main__":
    asyncio.set_event_loop_policy(None)
    sys.exit(main())
