"""Cost models and profiles: table interpolation against hand-picked CSV rows, composition,
monotonicity, the named profiles' documented claims, KV capacity, and bad-input errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvroute.engine.cost import (
    LLAMA31_8B_CONFIG,
    QWEN3_30B_A3B_CONFIG,
    AttentionGrid,
    LinkSpec,
    ProfileCostModel,
    get_profile,
    kv_capacity_tokens,
    load_packaged_model,
    load_packaged_tables,
    profile_names,
    read_profile_dir,
    tables_from_json,
    tables_to_json,
)
from kvroute.errors import UserError

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
QWEN_DIR = SHARED / "profiles/llmservingsim/profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16"
QWEN_JSON = "qwen3-30b-a3b-rtxpro6000-tp1.json"
QWEN3_30B_A3B = load_packaged_model(*QWEN3_30B_A3B_CONFIG)
LLAMA31_8B = load_packaged_model(*LLAMA31_8B_CONFIG)


@pytest.fixture(scope="module")
def qwen_tables():
    return load_packaged_tables(QWEN_JSON)


@pytest.fixture(scope="module")
def qwen():
    return get_profile("qwen3-30b-a3b-rtxpro6000-tp1")


@pytest.fixture(scope="module")
def attn(qwen_tables):
    return AttentionGrid(qwen_tables.attention)


# -- tables against rows of tp1/*.csv (µs) ------------------------------------------------------------


def test_attention_grid_hits_profiled_rows(attn):
    # attention.csv rows: prefill_chunk,kv_prefill,n_decode,kv_decode,time_us
    assert attn(0, 0, 1, 1024) == pytest.approx(12.7687, abs=1e-3)
    assert attn(0, 0, 2, 2048) == pytest.approx(21.2047, abs=1e-3)
    assert attn(2048, 0, 0, 0) == pytest.approx(174.635, abs=1e-3)
    assert attn(2048, 2048, 0, 0) == pytest.approx(420.054, abs=1e-3)


def test_attention_grid_interpolates_linearly(attn):
    # kv 1088 is halfway between the profiled 1024 (12.7687) and 1152 (13.3757) for one decode
    assert attn(0, 0, 1, 1088) == pytest.approx((12.7687 + 13.3757) / 2, abs=1e-3)
    # n_decode 1.5 halfway between rows (0,0,1,1024) and (0,0,2,1024) = 17.2273
    assert attn(0, 0, 1.5, 1024) == pytest.approx((12.7687 + 17.2273) / 2, abs=1e-3)


def test_attention_grid_fills_missing_slice_from_nearest():
    slices = [
        {"pc": 0, "nd": 1, "kp": [0], "kv": [[16, 32]], "us": [[1.0, 3.0]]},
        {"pc": 16, "nd": 0, "kp": [0, 16], "kv": [[0], [0]], "us": [[5.0], [7.0]]},
    ]
    g = AttentionGrid(slices)
    assert g(0, 0, 1, 24) == pytest.approx(2.0)
    assert g(16, 8, 0, 0) == pytest.approx(6.0)
    # (pc 0, nd 0) and (pc 16, nd 1) were not profiled: nearest slices stand in
    assert g(16, 0, 1, 0) == pytest.approx(5.0)  # nearest to (16, 1) is (16, 0) at distance 1
    # above the grid: extrapolate from the top two points
    assert g(0, 0, 1, 48) == pytest.approx(5.0)


def test_extrapolation_never_falls_below_the_last_profiled_time():
    """A last segment that slopes down (profiling noise) must not extrapolate to shorter, let alone
    negative, kernel times far beyond the table."""
    from kvroute.engine.cost import Table1D

    t = Table1D((0.0, 10.0, 20.0), (1.0, 6.0, 5.0))
    assert t(15.0) == pytest.approx(5.5)  # inside: plain interpolation
    assert t(1000.0) == pytest.approx(5.0)  # beyond: flat, not 5 - 98
    import numpy as np

    assert t.sample(np.array([15.0, 1000.0])).tolist() == pytest.approx([5.5, 5.0])
    down = [{"pc": 0, "nd": 1, "kp": [0], "kv": [[16, 32]], "us": [[4.0, 3.0]]}]
    g = AttentionGrid(down)
    assert g(0, 0, 1, 24) == pytest.approx(3.5)
    assert g(0, 0, 1, 10_000) == pytest.approx(3.0)


def test_default_profile_long_mixed_step_is_positive():
    """The case that went negative: an 894-token chunk after 37k tokens of history beside 55 decodes
    of 8k context each, on the default profile (seen as -0.06 s before the edge clamp)."""
    from kvroute.engine.cost import DEFAULT_PROFILE

    cost = get_profile(DEFAULT_PROFILE).cost
    t = cost.step_time([(894, 37_000)], 55, 55 * 8192)
    assert t > cost.step_time([(894, 0)], 55, 55 * 1024) > 0


def test_dense_and_moe_tables(qwen_tables):
    # dense.csv at tokens=1: 2×layernorm 2.12267 + qkv_proj 9.39733 + qk_norm 1.936 + rotary_emb 2.42133
    # + o_proj 7.435
    assert qwen_tables.layer_dense(1) == pytest.approx(
        2 * 2.12267 + 9.39733 + 1.936 + 2.42133 + 7.435, abs=1e-2
    )
    # embedding 3.10433 + final_layernorm 2.027
    assert qwen_tables.step_dense(1) == pytest.approx(3.10433 + 2.027, abs=1e-2)
    # per_sequence.csv: lm_head 420.224 + sampler 10.1227 at one sequence
    assert qwen_tables.step_sequences(1) == pytest.approx(420.224 + 10.1227, abs=1e-2)
    moe = qwen_tables.moe
    assert moe is not None
    assert moe(64, 64) == pytest.approx(432.672, abs=1e-3)
    assert moe(64, 96) == pytest.approx((432.672 + 827.81) / 2, abs=1e-3)


def test_step_time_composition_for_one_decode(qwen, qwen_tables, attn):
    t = qwen_tables
    L = QWEN3_30B_A3B.num_layers
    expected_us = (
        L * (t.layer_dense(1) + attn(0, 0, 1, 1000) + t.moe(1, 8))  # 1 token activates 8 experts
        + t.step_dense(1)
        + t.step_sequences(1)
    )
    assert qwen.cost.step_time((), 1, 1000) == pytest.approx(expected_us * 1e-6, rel=1e-9)


@pytest.mark.parametrize(
    "name", ["qwen3-30b-a3b-rtxpro6000-tp1", "llama31-8b-h100-tp1", "design-a100-qwen30b"]
)
def test_step_time_is_monotone(name):
    cost = get_profile(name).cost
    assert cost.step_time((), 0, 0) == 0.0
    for nd in (1, 2, 8, 64, 128):
        assert cost.step_time((), nd + 1, (nd + 1) * 1000) >= cost.step_time((), nd, nd * 1000) > 0
    for kv in (100, 1000, 4000, 12000):
        assert cost.step_time((), 16, 16 * (kv + 500)) >= cost.step_time((), 16, 16 * kv)
    for chunk in (16, 256, 1024, 2048):
        assert cost.step_time([(chunk * 2, 0)], 0, 0) >= cost.step_time([(chunk, 0)], 0, 0)
        if chunk >= 256:  # flat only where kernels are launch-bound
            assert cost.step_time([(chunk * 2, 0)], 0, 0) > cost.step_time([(chunk, 0)], 0, 0)
        assert cost.step_time([(chunk, 4096)], 0, 0) >= cost.step_time([(chunk, 0)], 0, 0)


def test_beyond_precomputed_range_continues(qwen):
    c = qwen.cost
    assert c.step_time([(20000, 0)], 0, 0) > c.step_time([(16000, 0)], 0, 0)


# -- named profiles -----------------------------------------------------------------------------------


def test_profile_names_and_unknown_name():
    names = profile_names()
    assert names[0] == "qwen3-30b-a3b-rtxpro6000-tp1"
    assert {"llama31-8b-h100-tp1", "design-a100-qwen30b"} <= set(names)
    with pytest.raises(UserError, match="valid: qwen3-30b-a3b-rtxpro6000-tp1, llama31-8b-h100-tp1"):
        get_profile("nope")


def test_design_profile_claims():
    cost = get_profile("design-a100-qwen30b").cost
    assert cost.step_time((), 1, 100) == pytest.approx(0.015)
    assert cost.step_time((), 8, 800) == pytest.approx(0.120)
    assert cost.step_time((), 4, 400) == pytest.approx(0.060)  # linear in between
    # prefill: 2 × 3.3e9 FLOP per token at 50 % of 312 TFLOP/s
    assert cost.step_time([(1000, 0)], 0, 0) == pytest.approx(1000 * 6.6e9 / 156e12)


def test_profiles_carry_source_and_kv_blocks():
    for name in profile_names():
        p = get_profile(name)
        assert p.source and p.description
        assert p.num_kv_blocks(16) == p.kv_capacity_tokens // 16 > 1000


def test_model_shapes_match_published_sizes():
    assert QWEN3_30B_A3B.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert sum(QWEN3_30B_A3B.param_counts()) / 1e9 == pytest.approx(30.5, rel=0.01)
    assert sum(LLAMA31_8B.param_counts()) / 1e9 == pytest.approx(8.03, rel=0.01)


def test_kv_capacity_formula():
    p = get_profile("qwen3-30b-a3b-rtxpro6000-tp1")
    m, g = p.model, p.gpu
    expected = (g.memory_bytes * 0.9 - m.weight_bytes() - 2 * 2**30) // m.kv_bytes_per_token
    assert p.kv_capacity_tokens == int(expected)
    # expert parallelism halves the expert weights: more room for KV
    assert kv_capacity_tokens(g, m, ep=2) > p.kv_capacity_tokens
    with pytest.raises(UserError, match="does not fit"):
        kv_capacity_tokens(g, m, mem_util=0.5)


# -- DP + EP group steps --------------------------------------------------------------------------------


def test_dp_group_step_time(qwen):
    c = qwen.cost
    assert isinstance(c, ProfileCostModel)
    busy = ((), 32, 32 * 1000)
    idle = ((), 0, 0)
    # one rank, no EP: same as a plain step
    assert c.dp_group_step_time([busy], ep=1) == pytest.approx(c.step_time((), 32, 32000))
    assert c.dp_group_step_time([idle, idle], ep=2) == 0.0
    both = c.dp_group_step_time([busy, busy], ep=2, link=LinkSpec(16e9, 20e-6))
    one = c.dp_group_step_time([busy, idle], ep=2, link=LinkSpec(16e9, 20e-6))
    assert 0 < one <= both
    # the slower rank sets the pace, in either order
    heavy = ((), 32, 32 * 8000)
    assert c.dp_group_step_time([busy, heavy], ep=2) == c.dp_group_step_time([heavy, busy], ep=2)
    assert c.dp_group_step_time([busy, heavy], ep=2) > c.dp_group_step_time([busy, busy], ep=2)
    # a slower link costs time
    fast = c.dp_group_step_time([busy, busy], ep=2, link=LinkSpec(1e12, 0.0))
    assert fast < both


def test_link_collectives():
    link = LinkSpec(10e9, 1e-5)
    assert link.all_reduce(1e6, 1) == 0.0
    assert link.all_reduce(1e6, 2) == pytest.approx(2 * (1e-5 + 0.5e6 / 10e9))
    assert link.all_gather(1e6, 2) == pytest.approx(1e-5 + 1e6 / 10e9)
    assert link.reduce_scatter(1e6, 2) == pytest.approx(1e-5 + 0.5e6 / 10e9)


# -- readers ----------------------------------------------------------------------------------------------


def test_json_round_trip_keeps_step_times(qwen_tables):
    again = tables_from_json(tables_to_json(qwen_tables), "x")
    a = ProfileCostModel("a", qwen_tables, QWEN3_30B_A3B, table_tokens=64)
    b = ProfileCostModel("b", again, QWEN3_30B_A3B, table_tokens=64)
    for batch in (((), 8, 8000), (((300, 700),), 4, 4000)):
        assert b.step_time(*batch) == pytest.approx(a.step_time(*batch), rel=1e-6)
    with pytest.raises(UserError, match="not a kvroute-profile-tables"):
        tables_from_json({"format": "other"}, "bad.json")


def test_bad_profile_dir_names_missing_file(tmp_path):
    with pytest.raises(UserError, match=r"meta\.yaml"):
        read_profile_dir(tmp_path)
    (tmp_path / "meta.yaml").write_text("model: x\n")
    with pytest.raises(UserError, match="no tp1/"):
        read_profile_dir(tmp_path)
    (tmp_path / "tp1").mkdir()
    with pytest.raises(UserError, match=r"tp1/dense\.csv"):
        read_profile_dir(tmp_path)
    (tmp_path / "tp1" / "dense.csv").write_text("layer,tokens\nembedding,1\n")
    with pytest.raises(UserError, match="missing column"):
        read_profile_dir(tmp_path)


@pytest.mark.skipif(not QWEN_DIR.is_dir(), reason="../shared profiles absent (a plain clone has none)")
@pytest.mark.parametrize("tp", [1, 2])
def test_packaged_table_matches_source_csvs(qwen_tables, tp):
    src = read_profile_dir(QWEN_DIR, tp)
    if tp == 1:
        for x in (1, 100, 2048):
            assert src.layer_dense(x) == pytest.approx(qwen_tables.layer_dense(x), abs=1e-2)
    else:  # TP 2 shards the projections: cheaper per layer at large batches, MoE table shared with TP 1
        assert src.layer_dense(2048) < qwen_tables.layer_dense(2048)
        assert src.moe is not None and qwen_tables.moe is not None
        assert src.moe(64, 64) == qwen_tables.moe(64, 64)
    cost = ProfileCostModel("t", src, QWEN3_30B_A3B, tp=tp, link=LinkSpec(16e9, 20e-6), table_tokens=64)
    assert math.isfinite(cost.step_time(((512, 0),), 8, 8000)) and cost.step_time(((512, 0),), 8, 8000) > 0
