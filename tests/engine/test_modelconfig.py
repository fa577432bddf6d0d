"""Model architecture from a Hugging Face config.json: dense, GQA, MoE (three spellings), MHA, MLA,
multimodal nesting, dtypes, one-line errors naming file and key; profiles of any model from ../shared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvroute.cli import main
from kvroute.engine.cost import get_profile, profile_from_dir
from kvroute.engine.modelconfig import ModelShape, find_model_config, load_model_config, parse_hf_config
from kvroute.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures/hf_configs"
PACKAGED = ROOT / "src/kvroute/engine/profiles"
SHARED = ROOT / ".." / "shared" / "profiles/llmservingsim/profiler/perf/RTXPRO6000/Qwen"
QWEN32_DIR = SHARED / "Qwen3-32B/bf16"
needs_shared = pytest.mark.skipif(not QWEN32_DIR.is_dir(), reason="../shared profiles absent")

# A small dense Llama-like config; the synthetic variants below change one thing each.
BASE = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_dense_gqa_explicit_head_dim_qwen3_32b():
    m = load_model_config(FIXTURES / "Qwen3-32B.config.json", "Qwen/Qwen3-32B")
    assert (m.name, m.num_layers, m.hidden, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "Qwen/Qwen3-32B",
        64,
        5120,
        64,
        8,
        128,  # explicit: 5120 / 64 would be 80
    )
    assert (m.num_experts, m.intermediate, m.dtype_bytes) == (0, 25600, 2)
    assert m.kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert sum(m.param_counts()) / 1e9 == pytest.approx(32.8, rel=0.01)  # the model card: 32.8 B


def test_dense_gqa_head_dim_from_hidden_llama():
    m = load_model_config(PACKAGED / "llama-3.1-8b.config.json")
    assert (m.num_kv_heads, m.head_dim, m.vocab) == (8, 4096 // 32, 128256)
    assert m.name.endswith("llama-3.1-8b.config.json")  # no _name_or_path: the file names it
    assert sum(m.param_counts()) / 1e9 == pytest.approx(8.03, rel=0.01)


def test_moe_spellings():
    qwen = load_model_config(PACKAGED / "qwen3-30b-a3b-instruct-2507.config.json")
    assert (qwen.num_experts, qwen.experts_per_token, qwen.moe_intermediate) == (128, 8, 768)
    assert sum(qwen.param_counts()) / 1e9 == pytest.approx(30.5, rel=0.01)
    mixtral = load_model_config(FIXTURES / "Mixtral-8x7B-v0.1.config.json")
    # num_local_experts; the expert width is intermediate_size
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.moe_intermediate) == (8, 2, 14336)
    assert sum(mixtral.param_counts()) / 1e9 == pytest.approx(46.7, rel=0.01)  # Mistral: 46.7 B total
    deepseek = parse_hf_config(
        {
            **BASE,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 64,
            "n_shared_experts": 2,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 96,
            "qk_rope_head_dim": 32,
        },
        "ds.json",
    )
    assert (deepseek.num_experts, deepseek.shared_intermediate, deepseek.dense_layers) == (16, 128, 1)
    # MLA: one 96 + 32 latent per token and layer, not split over TP ranks
    assert deepseek.kv_bytes_per_token == 4 * 128 * 2
    assert deepseek.kv_bytes_per_token_per_rank(4) == deepseek.kv_bytes_per_token
    dense, experts = deepseek.param_counts()
    assert experts == 3 * 16 * 3 * 256 * 64  # three MoE layers of 16 experts
    attn = 256 * (8 + 2 * 2) * 32 + 8 * 32 * 256 + 2 * 256 + 2 * 32  # projections and norms
    moe_layer = 256 * 16 + 3 * 256 * 128  # router + 2 shared experts of width 64
    assert dense == 4 * attn + 3 * moe_layer + 3 * 256 * 512 + 2 * 1000 * 256 + 256  # + 1 dense MLP layer


def test_mha_nested_and_dtypes():
    mha = parse_hf_config({k: v for k, v in BASE.items() if k != "num_key_value_heads"}, "mha.json")
    assert mha.num_kv_heads == mha.num_heads == 8
    assert mha.kv_bytes_per_token_per_rank(2) == mha.kv_bytes_per_token / 2
    gqa = parse_hf_config(BASE, "gqa.json")
    assert gqa.kv_bytes_per_token_per_rank(8) == gqa.kv_bytes_per_token / 2  # 2 KV heads: replicated
    # multimodal: the language model under text_config, dtype and tying inherited from the top level
    nested = parse_hf_config(
        {
            "model_type": "llava",
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
            "vision_config": {"num_hidden_layers": 24, "hidden_size": 1024},
            "text_config": {k: v for k, v in BASE.items() if k not in ("torch_dtype", "tie_word_embeddings")},
        },
        "mm.json",
    )
    assert (nested.num_layers, nested.hidden, nested.dtype_bytes, nested.tied_embeddings) == (4, 256, 4, True)
    gpt2 = parse_hf_config(
        {"n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": 3072, "vocab_size": 50257}, "g"
    )
    assert (gpt2.num_kv_heads, gpt2.head_dim, gpt2.dtype_bytes, gpt2.tied_embeddings) == (12, 64, 2, True)
    assert parse_hf_config({**BASE, "torch_dtype": None, "dtype": "float16"}, "x").dtype_bytes == 2


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_hidden_layers": None}, "not a Hugging Face model config (no num_hidden_layers)"),
        ({"vocab_size": None}, "missing key 'vocab_size'"),
        ({"intermediate_size": None}, "missing key 'intermediate_size' (a dense model)"),
        ({"num_experts": 8}, "missing key 'num_experts_per_tok' (a MoE model: 8 experts)"),
        ({"num_attention_heads": 0}, "key 'num_attention_heads' must be a positive integer"),
        ({"hidden_size": "256"}, "key 'hidden_size' must be a positive integer"),
        ({"torch_dtype": "int3"}, "key 'torch_dtype': unknown dtype 'int3'"),
        ({"hidden_size": 250, "head_dim": None}, "not a multiple of 8 heads"),
    ],
)
def test_errors_name_file_and_key(tmp_path, change, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in {**BASE, **change}.items() if v is not None}))
    with pytest.raises(UserError) as exc:
        load_model_config(path)
    text = str(exc.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_file_errors(tmp_path):
    with pytest.raises(UserError, match=r"model config missing: .*nope\.json.*--model-config"):
        load_model_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UserError, match=r"bad\.json: not JSON"):
        load_model_config(tmp_path / "bad.json")
    (tmp_path / "cluster.json").write_text(json.dumps({"num_nodes": 1, "nodes": []}))
    with pytest.raises(UserError, match=r"cluster\.json: not a Hugging Face model config"):
        load_model_config(tmp_path / "cluster.json")
    # find_model_config passes over a cluster config and finds the model's one level up
    variant = tmp_path / "model" / "bf16"
    variant.mkdir(parents=True)
    (variant / "config.json").write_text(json.dumps({"nodes": []}))
    assert find_model_config(variant) is None
    (variant.parent / "config.json").write_text(json.dumps(BASE))
    assert find_model_config(variant) == variant.parent / "config.json"


def test_packaged_profiles_read_their_configs():
    """The packaged profiles take their architecture from the shipped config.json files."""
    qwen = get_profile("qwen3-30b-a3b-rtxpro6000-tp1").model
    assert isinstance(qwen, ModelShape)
    assert (qwen.name, qwen.num_layers, qwen.num_kv_heads, qwen.num_experts) == (
        "Qwen/Qwen3-30B-A3B-Instruct-2507",
        48,
        4,
        128,
    )
    llama = get_profile("llama31-8b-h100-tp1").model
    assert (llama.name, llama.num_layers, llama.intermediate) == ("meta-llama/Llama-3.1-8B", 32, 14336)


def test_no_list_of_known_model_names():
    """Neither the config parser nor the profile loader holds a model id ("org/name") to look up, as the
    old table of known models did."""
    import inspect
    import re

    import kvroute.engine.modelconfig as modelconfig

    for source in (inspect.getsource(modelconfig), inspect.getsource(profile_from_dir)):
        assert not re.findall(r"[\"'][\w.-]+/[\w.-]+[\"']", source)
        assert "known = {" not in source


@needs_shared
@pytest.mark.parametrize("tp", [1, 2])
def test_dense_qwen3_32b_profile_any_tp(tp):
    cfg = FIXTURES / "Qwen3-32B.config.json"
    p = profile_from_dir(QWEN32_DIR, tp, model_config=cfg)
    assert p.model.name == "Qwen/Qwen3-32B" and p.cost.tables.moe is None
    # 32.8 B bf16 params on 96 GB: about 21 GB left at TP 1, twice the room per rank and half the KV per
    # token at TP 2
    assert p.kv_capacity_tokens == pytest.approx(
        (p.gpu.memory_bytes * 0.9 - p.model.weight_bytes(tp=tp) - 2 * 2**30) / (262144 / tp), abs=1
    )
    decode = p.cost.step_time((), 32, 32 * 1000)
    assert 0.01 < decode < 0.2  # tens of ms per decode step for a 32 B model, batch 32


@needs_shared
def test_profile_mismatches_are_one_line_errors(tmp_path, capsys):
    moe_cfg = PACKAGED / "qwen3-30b-a3b-instruct-2507.config.json"
    dense_cfg = FIXTURES / "Qwen3-32B.config.json"
    with pytest.raises(UserError, match=r"no Hugging Face config\.json in .*--model-config"):
        profile_from_dir(QWEN32_DIR)
    with pytest.raises(UserError, match="profiled as 'qwen3'"):
        profile_from_dir(QWEN32_DIR, model_config=moe_cfg)
    with pytest.raises(UserError, match="profiled as 'qwen3_moe'"):
        profile_from_dir(SHARED / "Qwen3-30B-A3B-Instruct-2507/bf16", model_config=dense_cfg)
    # the headline failure of issue 14, through the CLI: a dense Qwen3-32B profile runs in the simulator
    flags = ["--workload", "chatbot", "--duration", "5", "--instances", "2", "--no-progress"]
    assert main(["sim", *flags, "--profile-dir", str(QWEN32_DIR)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--model-config" in err
    out = tmp_path / "s.json"
    args = [*flags, "--profile-dir", str(QWEN32_DIR), "--model-config", str(dense_cfg), "--json", str(out)]
    assert main(["sim", *args]) == 0
    assert "--model-config" in json.loads(out.read_text())["command"]


def write_profile(root: Path, *, moe: bool, hardware: str = "RTXPRO6000") -> Path:
    """A minimal v1 bundle (flat 1 µs kernels) without architecture in meta.yaml."""
    tp1 = root / "tp1"
    tp1.mkdir(parents=True)
    (root / "meta.yaml").write_text(f"model: some/model\nhardware: {hardware}\n")
    ops = ("embedding", "layernorm", "qkv_proj", "qk_norm", "rotary_emb", "o_proj", "final_layernorm")
    if not moe:
        ops += ("gate_up_proj", "act_fn", "down_proj")
    (tp1 / "dense.csv").write_text(
        "layer,tokens,time_us\n" + "".join(f"{op},{t},1\n" for op in ops for t in (1, 2048))
    )
    (tp1 / "per_sequence.csv").write_text("layer,sequences,time_us\nlm_head,1,1\nsampler,1,1\n")
    (tp1 / "attention.csv").write_text(
        "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us\n0,0,1,16,1\n16,0,0,0,1\n"
    )
    if moe:
        (tp1 / "moe.csv").write_text("tokens,activated_experts,time_us\n1,8,1\n2048,8,4\n")
    return root


def test_profile_and_config_must_agree(tmp_path):
    dense = tmp_path / "dense.json"
    dense.write_text(json.dumps(BASE))
    moe = tmp_path / "moe.json"
    moe.write_text(
        json.dumps({**BASE, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64})
    )
    assert (
        profile_from_dir(write_profile(tmp_path / "d", moe=False), model_config=dense).model.name
        == "some/model"
    )
    assert profile_from_dir(write_profile(tmp_path / "m", moe=True), model_config=moe).model.num_experts == 8
    with pytest.raises(
        UserError, match=r"moe\.json: a MoE model \(8 experts\) but the profile has no .*tp1/moe\.csv"
    ):
        profile_from_dir(tmp_path / "d", model_config=moe)
    with pytest.raises(UserError, match=r"dense\.json: a dense model, but .* holds a MoE profile"):
        profile_from_dir(tmp_path / "m", model_config=dense)
    with pytest.raises(
        UserError, match=r"meta\.yaml: unknown hardware 'TPUv9'; known: RTXPRO6000, H100, A100"
    ):
        profile_from_dir(write_profile(tmp_path / "t", moe=False, hardware="TPUv9"), model_config=dense)
