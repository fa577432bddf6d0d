"""Durations given by a flag (``--NAME``) or by the YAML key (``NAME_s``): their defaults, both
forms read, and a value that is not positive refused, naming the key."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvroute.commands.serve import add_arguments, config_from_args
from kvroute.commands.settings import load_config_file
from kvroute.errors import UserError
from kvroute.server.config import BackendSpec, RouterConfig

URL = "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("key", "default"), [("upstream_keepalive_s", 15.0), ("worker_start_timeout_s", 120.0)]
)
def test_duration_flag_and_yaml_key(tmp_path: Path, key: str, default: float) -> None:
    assert getattr(RouterConfig(backends=(BackendSpec(URL),)), key) == default
    p = argparse.ArgumentParser()
    add_arguments(p)
    flag = "--" + key.removesuffix("_s").replace("_", "-")
    assert getattr(config_from_args(p.parse_args(["--backend", URL, flag, "2.5"])), key) == 2.5
    f = tmp_path / "c.yaml"
    f.write_text(f"backends: [{URL}]\n{key}: 4\n")
    assert getattr(load_config_file(f), key) == 4.0
    f.write_text(f"backends: [{URL}]\n{key}: 0\n")
    with pytest.raises(UserError, match=key):
        load_config_file(f).validate()
