"""The observation flags and config keys: parsed into the config, nonsense refused in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.errors import UserError


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--backend", "http://a:1", "--shadow", "vllm,nope"], "nope"),
        (["serve", "--backend", "http://a:1", "--decisions-kept", "0"], "decisions_kept=0 is out of range"),
        (["sim", "--workload", "chatbot", "--shadow", "nope"], "nope"),
        (["sim", "--workload", "chatbot", "--shadow", ","], "--shadow needs at least one policy"),
    ],
)
def test_bad_flags(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_flags_and_yaml(tmp_path: Path) -> None:
    from kvroute.commands.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = tmp_path / "router.yaml"
    cfg.write_text("backends: [http://a:1]\nshadow: [vllm, llm-d]\naccess_log: /tmp/x.jsonl\nexplain: true\n")
    from_file = config_from_args(parser.parse_args(["--config", str(cfg)]))
    assert (
        from_file.shadow == ("vllm", "llm-d") and from_file.explain and from_file.access_log == "/tmp/x.jsonl"
    )
    flags = config_from_args(
        parser.parse_args(
            [
                "--backend",
                "http://a:1",
                "--shadow",
                "round-robin",
                "--decisions-kept",
                "5",
                "--otel",
                "--explain",
            ]
        )
    )
    assert flags.shadow == ("round-robin",) and flags.decisions_kept == 5 and flags.otel and flags.explain
    plain = config_from_args(parser.parse_args(["--backend", "http://a:1"]))
    assert (plain.shadow, plain.explain, plain.otel, plain.access_log) == ((), False, False, None)
    cfg.write_text("backends: [http://a:1]\nshadow: 5\n")
    assert main(["serve", "--config", str(cfg)]) == 2


def test_access_log_that_cannot_be_opened(tmp_path: Path) -> None:
    from kvroute.server.app import RouterServer
    from kvroute.server.config import BackendSpec, RouterConfig

    cfg = RouterConfig(backends=(BackendSpec("http://127.0.0.1:1"),), access_log=str(tmp_path / "no" / "x"))
    with pytest.raises(UserError, match="cannot open the access log"):
        RouterServer(cfg, background=False)
