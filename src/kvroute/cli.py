"""`kvroute` command line: a thin dispatcher over ``kvroute.commands.<name>`` modules.

Every user error (``kvroute.errors.UserError``) ends as one line on stderr and exit status 2; a bad
flag or argument prints argparse's own usage line of the (sub)command first, then that one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata
from types import ModuleType

from kvroute.errors import UserError
from kvroute.logtext import configure_logging

# name on the command line -> module in kvroute.commands
COMMANDS: dict[str, str] = {
    "demo": "demo",
    "sim": "sim",
    "compare": "compare",
    "validate": "validate",
    "profiles": "profiles",
    "engine": "engine",
    "serve": "serve",
    "epp": "epp",
    "up": "up",
    "bench": "bench",
    "prompt": "prompt",
}


class UsageError(UserError):
    """A bad command line: ``str()`` is argparse's message; ``prog`` the (sub)command that refused it
    (``kvroute`` or ``kvroute serve``), ``usage`` its usage line (ends with a newline)."""

    def __init__(self, message: str, prog: str, usage: str) -> None:
        super().__init__(message)
        self.prog = prog
        self.usage = usage


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message, self.prog, self.format_usage())


def version() -> str:
    """The installed distribution's version (package metadata), or ``unknown`` when run from an
    uninstalled source tree."""
    try:
        return metadata.version("kvroute")
    except metadata.PackageNotFoundError:
        return "unknown"


def _available() -> dict[str, ModuleType]:
    mods: dict[str, ModuleType] = {}
    for name, mod in COMMANDS.items():
        try:
            mods[name] = importlib.import_module(f"kvroute.commands.{mod}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvroute.commands.{mod}":
                raise
    return mods


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvroute", description="KV-cache-aware LLM request router, simulator and emulator")
    parser.add_argument("--version", action="version", version=f"kvroute {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, mod in _available().items():
        p = sub.add_parser(name, help=getattr(mod, "HELP", ""), description=getattr(mod, "HELP", ""))
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging()
    try:
        args = build_parser().parse_args(argv)
        return int(args._run(args))
    except UsageError as exc:  # argparse's own form: the usage line, then one `prog: error:` line
        print(f"{exc.usage}{exc.prog}: error: {exc}", file=sys.stderr, end="\n")
        return 2
    except UserError as exc:
        print(f"kvroute: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
