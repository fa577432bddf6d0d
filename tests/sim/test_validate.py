"""kvroute validate: a tiny synthetic bench with hand-computable latencies, lockstep DP, the CLI, and
(when ../shared exists) the real vLLM run's TPOT within 5 %."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.engine.cost import QWEN3_30B_A3B, ModelShape, ProfileCostModel, ProfileTables, Table1D
from kvroute.errors import UserError
from kvroute.sim.validate import compare, load_bench, measured_latencies, simulate, summarize

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "profiles" / "llmservingsim"
REAL_BENCH = SHARED / "bench/examples/RTXPRO6000/Qwen3-30B-A3B-Instruct-2507"
REAL_PROFILE = SHARED / "profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16"

TINY = ModelShape(
    name="tiny", num_layers=1, hidden=8, num_heads=1, num_kv_heads=1, head_dim=8, vocab=16, intermediate=8
)


def constant_cost(step_ms: float) -> ProfileCostModel:
    """Every non-empty step takes ``step_ms``: all of it in the per-layer dense table."""
    flat = Table1D((1.0, 100000.0), (step_ms * 1e3, step_ms * 1e3))
    zero = Table1D((1.0, 100000.0), (0.0, 0.0))
    attention = ({"pc": 0, "nd": 0, "kp": [0], "kv": [[0]], "us": [[0.0]]},)
    tables = ProfileTables("test", flat, zero, zero, None, attention)
    return ProfileCostModel("const", tables, TINY, table_tokens=1024)


def write_bench(
    root: Path,
    reqs: list[tuple[float, int, int, float, float]],
    *,
    dp: int = 1,
    max_num_seqs: int = 4,
    mbt: int = 256,
    model: str = "tiny",
) -> Path:
    """reqs: (arrival s, prompt tokens, output tokens, measured first-token s, measured last-token s)."""
    (root / "vllm").mkdir(parents=True)
    kwargs = {
        "data_parallel_size": dp,
        "tensor_parallel_size": 1,
        "enable_expert_parallel": dp > 1,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": mbt,
    }
    (root / "vllm" / "meta.json").write_text(json.dumps({"model": model, "engine_kwargs": kwargs}))
    lines = [
        json.dumps(
            {
                "request_id": f"r{i}",
                "input_toks": p,
                "output_toks": o,
                "arrival_time": 1.7e9 + a,
                "queued_ts": 500.0 + a,
                "first_token_ts": 500.0 + f,
                "last_token_ts": 500.0 + last,
            }
        )
        for i, (a, p, o, f, last) in enumerate(reqs)
    ]
    (root / "vllm" / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_single_engine_latencies_by_hand(tmp_path):
    # step = 10 ms; request 0 (arrival 0): prefill step ends 10 ms, 4 decode steps → last token 50 ms.
    # request 1 arrives at 5 ms (mid-step): joins the second step → first token 20 ms, 2 more → 40 ms.
    run = load_bench(write_bench(tmp_path / "b", [(0.0, 100, 5, 0.010, 0.050), (0.005, 50, 3, 0.020, 0.040)]))
    sim = simulate(run, constant_cost(10.0), num_kv_blocks=100)
    assert sim.ttft_ms == pytest.approx((10.0, 15.0))
    assert sim.e2e_ms == pytest.approx((50.0, 35.0))
    assert sim.tpot_ms == pytest.approx((10.0, 10.0))
    res = compare(measured_latencies(run), sim)
    assert res["measured"]["ttft_ms"]["mean"] == pytest.approx(12.5)
    assert res["error_pct"]["ttft_ms"]["mean"] == pytest.approx(0.0, abs=1e-9)
    assert res["error_pct"]["e2e_ms"]["p50"] == pytest.approx(0.0, abs=1e-9)


def test_batch_limits_queue_requests(tmp_path):
    # max_num_seqs 1: the second request waits for the first to finish (3 steps), then 3 more
    run = load_bench(write_bench(tmp_path / "b", [(0.0, 10, 3, 0, 0), (0.0, 10, 3, 0, 0)], max_num_seqs=1))
    sim = simulate(run, constant_cost(10.0), num_kv_blocks=100)
    assert sim.ttft_ms == pytest.approx((10.0, 40.0))
    assert sim.e2e_ms == pytest.approx((30.0, 60.0))


def test_chunked_prefill_uses_the_token_budget(tmp_path):
    # 600-token prompt with max_num_batched_tokens 256: chunks 256, 256, 88 → first token after 3 steps
    run = load_bench(write_bench(tmp_path / "b", [(0.0, 600, 2, 0, 0)]))
    sim = simulate(run, constant_cost(10.0), num_kv_blocks=100)
    assert sim.ttft_ms == pytest.approx((30.0,))


def test_lockstep_dp_ranks_share_steps(tmp_path):
    # two requests at once, dp=2: the vllm balancer sends them to different ranks (4·waiting + running)
    # and both ranks step together: first tokens at 10 ms; the short one idles (dummy steps) after 20 ms
    run = load_bench(write_bench(tmp_path / "b", [(0.0, 10, 2, 0, 0), (0.0, 10, 4, 0, 0)], dp=2))
    assert run.ep == 2
    sim = simulate(run, constant_cost(10.0), num_kv_blocks=100)
    assert sim.ttft_ms == pytest.approx((10.0, 10.0))
    assert sim.e2e_ms == pytest.approx((20.0, 40.0))


def test_summarize_percentiles():
    s = summarize([float(x) for x in range(1, 101)])
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)


def test_bad_bench_errors(tmp_path):
    with pytest.raises(UserError, match=r"vllm/meta\.json"):
        load_bench(tmp_path)
    root = write_bench(tmp_path / "b", [(0.0, 10, 2, 0, 0)])
    (root / "vllm" / "requests.jsonl").write_text('{"input_toks": 5}\n')
    with pytest.raises(UserError, match=r"requests\.jsonl:1: bad request line"):
        load_bench(root)


def write_profile_dir(root: Path) -> Path:
    """A minimal LLMServingSim v1 bundle for Qwen3-30B-A3B (flat 1 µs kernels)."""
    tp1 = root / "tp1"
    tp1.mkdir(parents=True)
    (root / "meta.yaml").write_text(f"model: {QWEN3_30B_A3B.name}\nhardware: RTXPRO6000\n")
    ops = ("embedding", "layernorm", "qkv_proj", "qk_norm", "rotary_emb", "o_proj", "final_layernorm")
    (tp1 / "dense.csv").write_text(
        "layer,tokens,time_us\n" + "".join(f"{op},{t},1\n" for op in ops for t in (1, 2048))
    )
    (tp1 / "per_sequence.csv").write_text(
        "layer,sequences,time_us\nlm_head,1,1\nlm_head,256,2\nsampler,1,1\n"
    )
    (tp1 / "attention.csv").write_text(
        "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n"
        "0,0,1,16,1\n0,0,1,16384,3\n16,0,0,0,1\n2048,0,0,0,5\n"
    )
    (tp1 / "moe.csv").write_text("tokens,activated_experts,time_us\n1,8,1\n2048,8,4\n1,128,2\n2048,128,8\n")
    return root


def test_cli_validate_writes_json(tmp_path, capsys):
    bench = write_bench(
        tmp_path / "b", [(0.0, 100, 5, 0.1, 0.5), (0.2, 300, 8, 0.4, 1.0)], dp=2, model=QWEN3_30B_A3B.name
    )
    prof = write_profile_dir(tmp_path / "p")
    out = tmp_path / "v.json"
    assert main(["validate", "--bench", str(bench), "--profile-dir", str(prof), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) >= {"measured", "simulated"}
    for side in ("measured", "simulated"):
        assert set(data[side]) == {"ttft_ms", "tpot_ms", "e2e_ms"}
        assert set(data[side]["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert data["measured"]["ttft_ms"]["mean"] == pytest.approx(150.0)
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "median" in printed
    assert main(["validate", "--bench", str(bench), "--profile-dir", str(tmp_path / "nope")]) == 2
    assert "meta.yaml" in capsys.readouterr().err


def test_cli_profiles_lists_all(capsys):
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("qwen3-30b-a3b-rtxpro6000-tp1", "llama31-8b-h100-tp1", "design-a100-qwen30b"):
        assert name in out
    assert "decode b=8 120.0 ms" in out  # the design document's claim


@pytest.mark.skipif(not REAL_BENCH.is_dir(), reason="../shared (LLMServingSim bench and profiles) absent")
def test_real_vllm_run_tpot_within_5_percent(tmp_path):
    out = tmp_path / "v.json"
    assert (
        main(["validate", "--bench", str(REAL_BENCH), "--profile-dir", str(REAL_PROFILE), "--json", str(out)])
        == 0
    )
    err = json.loads(out.read_text())["error_pct"]
    assert abs(err["tpot_ms"]["mean"]) < 5.0
    assert abs(err["e2e_ms"]["mean"]) < 5.0
