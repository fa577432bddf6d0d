"""Nonsense on the router's and the engine's command lines and config files: one clear line, exit 2."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.cli import main


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["engine", "--port", "70000"], "port must be in 0..65535"),
        (["serve", "--backend", "http://a:1", "--port", "-5"], "port must be in 0..65535"),
        (["serve", "--backend", "http://a:1", "--port", "x"], "invalid port 'x'"),
        (["serve"], "at least one backend is needed"),
        (["serve", "--backend", "notaurl"], "must look like http://host:port"),
        (["serve", "--backend", "http://a:99999"], "must look like http://host:port"),
        (["serve", "--backend", "http://a:0"], "must look like http://host:port"),
        (["serve", "--backend", "http://a:x"], "must look like http://host:port"),
        (["serve", "--backend", "http://a b:1"], "must look like http://host:port"),
        (["serve", "--backend", "http://a:1/v1?x"], "must look like http://host:port"),
        (["serve", "--backend", "http://a:1#x"], "must look like http://host:port"),
        (
            ["serve", "--backend", "http://a:1", "--drain-timeout", "-1"],
            "seconds must be a finite number >= 0",
        ),
        (
            ["serve", "--backend", "http://a:1", "--drain-grace", "nan"],
            "seconds must be a finite number >= 0",
        ),
        (["serve", "--backend", "http://a:1", "--drain-grace", "x"], "invalid number of seconds 'x'"),
        (["up", "--drain-timeout", "inf"], "seconds must be a finite number >= 0"),
        (["serve", "--discover", "dns://x"], "expected dns://NAME:PORT"),
        (["serve", "--discover", "http://x:1"], "must be dns://NAME:PORT or file://PATH"),
        (["serve", "--backend", "http://a:1", "--admin-token", " "], "admin_token must not be empty"),
        (
            ["serve", "--discover", "dns://x:1", "--discover-kv-events", "x:{host}"],
            "must be a tcp:// template",
        ),
    ],
)
def test_bad_flags(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("backends: [http://a:1]\nmax_retries: -1\n", "max_retries must be a finite number >= 0"),
        ("backends: [http://a:1]\nport: 70000\n", "port must be in 0..65535"),
        ("backends: [http://a:1]\nscrape_interval_s: .nan\n", "scrape_interval_s must be a finite number"),
        ("backends: [http://a:1]\nbogus: 1\n", "unknown key 'bogus'"),
        ("backends: [http://a:1]\ndrain_timeout_s: -2\n", "drain_timeout_s must be a finite number >= 0"),
        ("backends: [http://a:1]\ndiscover: dns://x:1\n", "'discover' must be a list"),
        ("backends: [http://a:1]\nadmin_token: 5\n", "admin_token must be a string"),
    ],
)
def test_bad_config_values(
    tmp_path: Path, text: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "router.yaml"
    cfg.write_text(text)
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert needle in err and str(cfg) in err


def test_drain_settings_from_flags_and_yaml(tmp_path: Path) -> None:
    from kvroute.commands.serve import add_arguments, config_from_args

    cfg = tmp_path / "router.yaml"
    cfg.write_text("backends: [http://a:1]\ndrain_timeout_s: 5\ndrain_grace_s: 0\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    from_file = config_from_args(parser.parse_args(["--config", str(cfg)]))
    assert (from_file.drain_grace_s, from_file.drain_timeout_s) == (0.0, 5.0)
    flags = parser.parse_args(["--config", str(cfg), "--drain-timeout", "7.5", "--drain-grace", "1"])
    assert (config_from_args(flags).drain_grace_s, config_from_args(flags).drain_timeout_s) == (1.0, 7.5)
    default = config_from_args(parser.parse_args(["--backend", "http://a:1"]))
    assert (default.drain_grace_s, default.drain_timeout_s) == (2.0, 30.0)


def test_admin_token_and_discovery_from_flags_env_and_yaml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvroute.commands.serve import add_arguments, config_from_args

    cfg = tmp_path / "router.yaml"
    cfg.write_text("discover: [dns://engines:8000]\ndiscover_interval_s: 2\nadmin_token: fromfile\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.delenv("KVROUTE_ADMIN_TOKEN", raising=False)
    from_file = config_from_args(parser.parse_args(["--config", str(cfg)]))
    assert from_file.discover == ("dns://engines:8000",) and from_file.discover_interval_s == 2.0
    assert from_file.admin_token == "fromfile" and "fromfile" not in repr(from_file)
    monkeypatch.setenv("KVROUTE_ADMIN_TOKEN", "fromenv")
    assert config_from_args(parser.parse_args(["--config", str(cfg)])).admin_token == "fromenv"
    flags = parser.parse_args(
        [
            "--config",
            str(cfg),
            "--admin-token",
            "fromflag",
            "--discover",
            "file:///x",
            "--discover-interval",
            "1",
        ]
    )
    got = config_from_args(flags)
    assert (got.admin_token, got.discover, got.discover_interval_s) == ("fromflag", ("file:///x",), 1.0)
    monkeypatch.delenv("KVROUTE_ADMIN_TOKEN")
    assert config_from_args(parser.parse_args(["--backend", "http://a:1"])).admin_token is None
