"""The command line's conventions: argparse's own usage line and one ``prog: error:`` line on a bad
flag (never the prefix twice, never a traceback), ``--version`` from the package metadata, and skip
reasons in the test report."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from kvroute.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_a_bad_flag_prints_the_usage_then_one_prefixed_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvroute.cli", "sim", "--workload", "chatbot", "--bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0].startswith("usage: kvroute ")
    assert lines[-1] == "kvroute: error: unrecognized arguments: --bogus"
    assert done.stderr.count("kvroute: error:") == 1 and "Traceback" not in done.stderr


def test_a_bad_value_names_the_subcommand_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "chatbot", "--instances", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute sim [-h]")
    assert err.splitlines()[-1] == "kvroute sim: error: argument --instances: invalid int value: 'x'"
    assert err.count("error:") == 1


def test_no_command_prints_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvroute [-h] [--version]")
    assert err.splitlines()[-1] == "kvroute: error: the following arguments are required: command"


def test_a_user_error_after_parsing_stays_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--workload", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvroute: error: unknown workload 'nope'")


def test_version_comes_from_the_package_metadata(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"kvroute {metadata.version('kvroute')}\n"


def test_the_test_report_lists_skip_reasons() -> None:
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-rs" in addopts.split()
