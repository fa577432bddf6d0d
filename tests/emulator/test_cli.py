"""`kvroute engine`: argument handling, and one real process serving the openai client."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import openai
import pytest

from kvroute.cli import build_parser
from kvroute.commands.engine import build
from kvroute.engine.cost import get_profile
from kvroute.errors import UserError


def parse(*argv: str):
    return build_parser().parse_args(["engine", *argv])


def test_defaults_come_from_the_profile():
    settings, profile, tok = build(parse())
    e = settings.engine
    assert settings.model_name == "kvroute-emulated" and settings.time_scale == 1.0
    assert e.num_kv_blocks == get_profile().num_kv_blocks(16) and e.report_tokens
    assert e.max_model_len == min(e.num_kv_blocks * 16, 262144)
    assert settings.kv_events is None and tok.vocab_size > 0 and profile.name == get_profile().name


def test_flags():
    settings, profile, _ = build(
        parse(
            "--served-model-name",
            "m",
            "--profile",
            "design-a100-qwen30b",
            "--kv-blocks",
            "100",
            "--max-model-len",
            "1000",
            "--max-num-seqs",
            "4",
            "--time-scale",
            "5",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5999",
            "--kv-events-format",
            "map",
            "--no-enable-prefix-caching",
        )
    )
    e = settings.engine
    assert (settings.model_name, profile.name, settings.time_scale) == ("m", "design-a100-qwen30b", 5.0)
    assert (e.num_kv_blocks, e.max_model_len, e.max_num_seqs, e.enable_prefix_caching) == (
        100,
        1000,
        4,
        False,
    )
    assert settings.kv_events is not None and settings.kv_events.fmt == "map"


def test_gpu_memory_sets_kv_capacity():
    small, _, _ = build(parse("--gpu-memory-gib", "70"))
    big, _, _ = build(parse("--gpu-memory-gib", "140"))
    assert 0 < small.engine.num_kv_blocks < big.engine.num_kv_blocks


@pytest.mark.parametrize(
    "argv",
    [
        ("--time-scale", "0"),
        ("--kv-blocks", "-1"),
        ("--kv-blocks", "10", "--max-model-len", "1000"),
        ("--profile", "nope"),
        ("--profile", "design-a100-qwen30b", "--profile-dir", "x"),
        ("--gpu-memory-utilization", "1.5"),
        ("--tokenizer", "/nonexistent/tokenizer.json"),
        ("--gpu-memory-gib", "1"),
        ("--lora-modules", "sql"),
        ("--lora-modules", "a=/p", "a=/q"),
        ("--flavor", "sglang", "--lora-modules", "a=/p"),
        ("--kv-events-page-size", "4"),
        ("--flavor", "sglang", "--kv-events-page-size", "5"),
    ],
)
def test_bad_flags(argv):
    with pytest.raises(UserError):
        build(parse(*argv))


def test_flavor_and_lora_flags():
    settings, _, _ = build(
        parse(
            "--flavor",
            "sglang",
            "--kv-events-endpoint",
            "tcp://127.0.0.1:5557",
            "--kv-events-page-size",
            "1",
        )
    )
    assert settings.flavor == "sglang" and settings.kv_events is not None
    assert (settings.kv_events.fmt, settings.kv_events.page_size) == ("sglang", 1)
    settings, _, _ = build(parse("--model", "base", "--lora-modules", "sql=/a", "chat=/b"))
    assert settings.lora_modules == ("sql", "chat") and settings.flavor == "vllm"


def test_process_serves_openai_client_and_stops_on_sigint():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvroute.cli",
            "engine",
            "--port",
            "0",
            "--time-scale",
            "50",
            "--kv-blocks",
            "256",
            "--model",
            "emu",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{match.group(1)}/v1", api_key="x", max_retries=0)
        with client:
            stream = client.chat.completions.create(
                model="emu", messages=[{"role": "user", "content": "hello"}], max_tokens=3, stream=True
            )
            text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert text == " the of and"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
