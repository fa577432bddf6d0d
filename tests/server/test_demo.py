"""The main job (`kvroute demo`) end to end on a small scale: real engines, router and HTTP; its
verdict logic; and its "run it yourself" line, run as printed (the bench waits for `up`)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.commands.demo import default_policies, run_yourself
from kvroute.commands.demo_report import busy_machine_warning, plain_name, summary_sentence, verdict
from kvroute.policies import DEFAULT_POLICY
from kvroute.sim.compare import DEFAULT_ARM


def test_demo_runs_the_default_against_its_rivals_over_http(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "demo.json"
    rc = main(
        [
            *("demo", "--instances", "2", "--duration", "6", "--time-scale", "2", "--rate-scale", "0.5"),
            *("--sim-policies", "aibrix-lmetric", "--json", str(out)),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [r["policy"] for r in rows] == list(default_policies())
    assert rows[0]["policy"] == DEFAULT_ARM and {"llm-d", "dynamo-lmetric", "vllm"} <= {
        r["policy"] for r in rows
    }
    balancer = next(r for r in rows if r["policy"] == "vllm")
    assert balancer["ttft_mean_vs_vllm"] == 1.0
    assert "verdict" not in rows[0]
    for r in rows:
        assert r["requests"] > 5 and r["unfinished"] == 0
        assert 0 < r["engine_ttft_ms_mean"] <= r["ttft_ms"]["mean"]  # the engine's share of the client's
        assert math.isfinite(r["simulated_ttft_ms_mean"]) and r["simulated_ttft_ms_mean"] > 0
        assert r["kv_hit_rate"] > 0 and r["ttft_se_ms"] > 0
        # every arm starts level: no arm's client makes prompt text another arm reuses (the first
        # arm made it all while it was being measured)
        assert r["text_blocks_made"] == 0
        # what the arm cost this process, and the router's own routing time (decide is part of it)
        assert r["process_cpu_ms_per_request"] > 0
        assert r["routing_ms_per_request"] >= r["decide_ms_per_request"] > 0
        assert r["gc_passes"] >= r["gc_full"] >= 0 and r["gc_pause_ms"] >= 0
        assert len(r["loadavg_before"]) == 3 and min(r["loadavg_before"]) >= 0
        if r is not rows[0]:
            assert r["verdict"].split()[0] in {"leads", "ties", "trails"}
    # the bound is below every arm, live and simulated
    bound = data["bound"]
    assert all(0 < bound["ttft_mean_ms"] <= s["ttft_ms"]["mean"] for s in data["simulated"].values())
    assert all(s["kv_hit_rate"] <= bound["kv_hit_rate"] + 1e-9 for s in data["simulated"].values())
    # the default's arm with the queue toggled (the default policy without it) in the simulator too
    assert {DEFAULT_ARM, DEFAULT_POLICY, "aibrix-lmetric"} <= set(data["simulated"])
    text = capsys.readouterr().out
    assert "cache-blind balancer (vLLM's default routing)" in text
    assert (
        f"| kvroute's default — {plain_name(DEFAULT_ARM, '')}" in text
        and "behind the router-side queue" in text
    )
    assert "| bound: no router does better |" in text and "The bound is what no router can beat" in text
    assert f"The default ({DEFAULT_ARM}) " in text
    assert "Run it yourself: kvroute up --instances 2 " in text
    assert "Machine: " in text and "load average" in text
    assert f"  {DEFAULT_ARM}: " in text and "ms CPU, routing " in text and "full GC passes" in text
    assert "load average" in text.split(f"  {DEFAULT_ARM}: ", 1)[1].splitlines()[0]


def test_demo_rejects_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--policies", "nope"]) == 2
    assert "valid policies" in capsys.readouterr().err
    assert main(["demo", "--duration", "0"]) == 2
    assert main(["demo", "--policies", "vllm,vllm"]) == 2
    assert "given twice" in capsys.readouterr().err
    assert main(["demo", "--workload", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().err


def test_verdict_reads_the_difference_against_the_noise() -> None:
    assert verdict(80.0, 2.0, 100.0, 2.0).word == "leads"  # 20 ms lower, noise 2·2.83 ms
    assert verdict(98.0, 2.0, 100.0, 2.0).word == "ties"
    assert verdict(120.0, 2.0, 100.0, 2.0).word == "trails"
    v = verdict(90.0, 3.0, 100.0, 4.0)
    assert v.change == pytest.approx(-0.10) and v.noise == pytest.approx(0.10)
    assert str(v) == "ties (-10% ± 10%)"


def test_summary_sentence_names_what_the_default_leads_and_ties() -> None:
    lead, tie = verdict(50.0, 1.0, 100.0, 1.0), verdict(99.0, 1.0, 100.0, 1.0)
    assert "leads: its mean TTFT is below every rival's" in summary_sentence("x", {"a": lead, "b": lead})
    assert summary_sentence("x", {"a": lead}).endswith("by more than the noise.")
    trail = verdict(150.0, 1.0, 100.0, 1.0)
    assert summary_sentence("x", {"a": trail}) == "The default (x) trails a on mean TTFT."
    mixed = summary_sentence("x", {"a": lead, "b": tie})
    assert mixed == "The default (x) ties with b; leads a on mean TTFT (a tie: within the noise)."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_run_it_yourself_line_works_as_printed() -> None:
    """The printed line, with a small cluster, a short run and a free port for 8080: `bench` starts
    while `up` is still bringing its engines up, waits for it, and the line ends with `up` stopped."""
    line = run_yourself(1, DEFAULT_ARM, "chatbot", 0.5, 4.0)
    assert line.startswith(f"kvroute up --instances 1 --policy {DEFAULT_POLICY} & kvroute bench ")
    assert "--no-router-queue" in run_yourself(1, DEFAULT_POLICY, "chatbot", 0.5, 4.0)
    port = str(_free_port())
    line = line.replace("http://127.0.0.1:8080", f"http://127.0.0.1:{port}").replace(
        "--policy", f"--port {port} --policy"
    )
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unfinished" in done.stdout and "| TTFT mean (ms)" in done.stdout
    assert "0 unfinished" in done.stdout


def test_bench_gives_up_after_its_bounded_wait(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()  # nothing listens there
    argv = ["bench", "--url", f"http://127.0.0.1:{port}", "--workload", "chatbot", "--wait-ready", "0.5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did not answer ready" in err and "--wait-ready" in err
    assert main([*argv[:-1], "-1"]) == 2
    assert "--wait-ready must be" in capsys.readouterr().err


def test_a_busy_machine_is_named_when_the_client_waits_far_longer_than_the_engines() -> None:
    def row(policy: str, client: float, engine: float) -> dict[str, object]:
        return {"policy": policy, "ttft_ms": {"mean": client}, "engine_ttft_ms_mean": engine}

    assert busy_machine_warning([row("a", 103.5, 95.7), row("b", 322.2, 311.7)]) is None
    warning = busy_machine_warning([row("a", 51475.3, 77.6), row("b", 120.0, 100.0)])
    assert warning is not None and "a (663×)" in warning and "b (" not in warning


def test_demo_through_envoy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--gateway envoy``: every policy's run goes through a real Envoy with kvroute as its endpoint
    picker, and the rows are measured there (skips without the gateway extra)."""
    pytest.importorskip("grpc", reason="the gateway extra is not installed: pip install -e '.[gateway]'")
    from kvroute.errors import UserError
    from kvroute.server.extproc.envoyproc import find_envoy

    try:
        find_envoy()
    except UserError as exc:
        pytest.skip(f"no Envoy: {exc}")
    out = tmp_path / "demo.json"
    argv = ["demo", "--instances", "2", "--duration", "4", "--time-scale", "2", "--rate-scale", "0.5"]
    argv += ["--policies", f"{DEFAULT_ARM},vllm", "--sim-policies", "", "--gateway", "envoy"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == [DEFAULT_ARM, "vllm"]
    assert all(r["requests"] > 3 and r["unfinished"] == 0 for r in rows)
    text = capsys.readouterr().out
    assert "with kvroute epp as its picker" in text
    assert "--gateway envoy & kvroute bench" in text
