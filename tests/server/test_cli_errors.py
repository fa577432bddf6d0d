"""Nonsense on the router's and the engine's command lines and config files: one clear line, exit 2."""

from __future__ import annotations

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
