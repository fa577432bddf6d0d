"""kvroute validate: a tiny synthetic bench with hand-computable latencies, lockstep DP, the CLI, and
(when ../shared exists) the real vLLM run's TPOT within 5 %."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.engine.cost import (
    QWEN3_30B_A3B_CONFIG,
    ModelShape,
    ProfileCostModel,
    ProfileTables,
    Table1D,
    load_packaged_model,
)
from kvroute.errors import UserError
from kvroute.sim.validate import compare, load_bench, measured_latencies, simulate, summarize

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "profiles" / "llmservingsim"
REAL_BENCH = SHARED / "bench/examples/RTXPRO6000/Qwen3-30B-A3B-Instruct-2507"
REAL_PROFILE = SHARED / "profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16"

QWEN3_30B_A3B = load_packaged_model(*QWEN3_30B_A3B_CONFIG)
PACKAGED = Path(__file__).resolve().parents[2] / "src/kvroute/engine/profiles"
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


def write_profile_dir(root: Path, *, config: bool = True) -> Path:
    """A minimal LLMServingSim v1 bundle for Qwen3-30B-A3B (flat 1 µs kernels), with the model's HF
    config.json beside it unless ``config`` is False."""
    tp1 = root / "tp1"
    tp1.mkdir(parents=True)
    if config:
        (root / "config.json").write_text((PACKAGED / QWEN3_30B_A3B_CONFIG[0]).read_text())
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


def test_cli_validate_model_config_flag_and_errors(tmp_path, capsys):
    bench = write_bench(tmp_path / "b", [(0.0, 100, 5, 0.1, 0.5)], model=QWEN3_30B_A3B.name)
    prof = write_profile_dir(tmp_path / "p", config=False)
    # no config.json beside the profile: one line naming where it looked and the flag to use
    assert main(["validate", "--bench", str(bench), "--profile-dir", str(prof)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(prof) in err and "--model-config" in err
    cfg = PACKAGED / QWEN3_30B_A3B_CONFIG[0]
    assert (
        main(["validate", "--bench", str(bench), "--profile-dir", str(prof), "--model-config", str(cfg)]) == 0
    )
    capsys.readouterr()
    missing = tmp_path / "absent.json"
    assert (
        main(["validate", "--bench", str(bench), "--profile-dir", str(prof), "--model-config", str(missing)])
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(missing) in err
    # a config of another architecture than the profiled one is refused, naming both files
    (prof / "meta.yaml").write_text(
        f"model: {QWEN3_30B_A3B.name}\nhardware: RTXPRO6000\narchitecture: llama\n"
    )
    assert (
        main(["validate", "--bench", str(bench), "--profile-dir", str(prof), "--model-config", str(cfg)]) == 2
    )
    err = capsys.readouterr().err
    assert "qwen3_moe" in err and "meta.yaml" in err
    # the bench folder's own config.json is LLMServingSim's cluster config, not a model config
    (bench / "config.json").write_text(json.dumps({"nodes": [{"instances": [{"hardware": "RTXPRO6000"}]}]}))
    (prof / "meta.yaml").write_text(f"model: {QWEN3_30B_A3B.name}\nhardware: RTXPRO6000\n")
    flags = ["--profile-dir", str(prof), "--model-config", str(bench / "config.json")]
    assert main(["validate", "--bench", str(bench), *flags]) == 2
    assert "not a Hugging Face model config" in capsys.readouterr().err
    # a named packaged profile of another model: says which model each is for
    assert main(["validate", "--bench", str(bench), "--profile", "llama31-8b-h100-tp1"]) == 2
    assert "meta-llama/Llama-3.1-8B" in capsys.readouterr().err


def test_config_in_the_model_folder_above_the_variant(tmp_path):
    from kvroute.engine.cost import profile_from_dir

    prof = write_profile_dir(tmp_path / "Qwen3-30B-A3B" / "bf16", config=False)
    (prof.parent / "config.json").write_text((PACKAGED / QWEN3_30B_A3B_CONFIG[0]).read_text())
    p = profile_from_dir(prof)
    assert p.model == QWEN3_30B_A3B  # same architecture, name from meta.yaml


# Every real run in ../shared and the profile it is replayed with (as scripts/validate_runs.py does):
# the Qwen3-30B-A3B MoE run (DP 2 + EP) with its RTX PRO 6000 v1 profile, the dense Llama-3.1-8B run
# with the only Llama profile there is (H100, so only loose bounds: the hardware differs).
REAL_RUNS = {
    "moe-qwen3-30b-a3b": (
        "Qwen3-30B-A3B-Instruct-2507",
        ["--profile-dir", str(REAL_PROFILE), "--model-config", str(PACKAGED / QWEN3_30B_A3B_CONFIG[0])],
    ),
    "dense-llama-3.1-8b": ("Llama-3.1-8B", ["--profile", "llama31-8b-h100-tp1"]),
}


@pytest.mark.skipif(not REAL_BENCH.is_dir(), reason="../shared (LLMServingSim bench and profiles) absent")
@pytest.mark.parametrize("key", sorted(REAL_RUNS))
def test_real_vllm_runs(tmp_path, key):
    run, flags = REAL_RUNS[key]
    out = tmp_path / "v.json"
    bench = SHARED / "bench/examples/RTXPRO6000" / run
    assert main(["validate", "--bench", str(bench), *flags, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    err = data["error_pct"]
    assert data["run"]["requests"] == 300 and data["run"]["run_hardware"] == "RTXPRO6000"
    if key.startswith("moe"):
        assert (data["run"]["dp"], data["run"]["ep"]) == (2, 2)
        assert abs(err["tpot_ms"]["mean"]) < 5.0
        assert abs(err["e2e_ms"]["mean"]) < 5.0
    else:  # an H100 profile replaying an RTX PRO 6000 run: faster, but not absurdly so
        assert data["run"]["profile_hardware"] == "H100"
        assert -60.0 < err["tpot_ms"]["mean"] < 0.0


def test_every_real_run_is_covered():
    """scripts/validate_runs.py refuses to run unless each bench folder has a plan entry; the committed
    results hold one JSON per planned run."""
    import importlib.util

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("validate_runs", root / "scripts/validate_runs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = root / "docs/results/validate"
    for run in mod.PLAN:
        stem = run.split("/", 1)[-1].replace("/", "-")
        assert json.loads((results / f"{stem}.json").read_text())["run"]["bench"].endswith(run)
    if REAL_BENCH.is_dir():
        assert sorted(mod.PLAN) == mod.discover(SHARED / "bench")
