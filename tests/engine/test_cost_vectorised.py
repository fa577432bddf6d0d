"""The vectorised step prices (``ProfileCostModel.chunk_step_times``, ``AttentionGrid.many``) equal the
scalar ones (``step_time``, ``AttentionGrid.__call__``) bit for bit: on random steps around, on, below
and far above every grid point, on every packaged profile, and on small grids with one-point axes."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.engine.cost import AttentionGrid, ProfileCostModel, get_profile, profile_names

QWEN = get_profile("qwen3-30b-a3b-rtxpro6000-tp1").cost
assert isinstance(QWEN, ProfileCostModel) and QWEN._attn is not None
GRID = QWEN._attn


def _near(points: tuple[int, ...], top: int) -> st.SearchStrategy[int]:
    """A grid point, one token either side of one, or anything up to ``top`` (far past the grid)."""
    return st.one_of(
        st.sampled_from(points),
        st.sampled_from(points).map(lambda x: x + 1),
        st.sampled_from(points).map(lambda x: max(x - 1, 0)),
        st.integers(0, top),
    )


STEP = st.tuples(
    _near(GRID.pcs, 16_000).map(lambda c: max(c, 1)),  # chunk ≥ 1 token
    _near(GRID.kps, 300_000),  # history before the chunk
    _near(GRID.nds, 400),  # decoding sequences
    _near(GRID.kvs, 200_000),  # their mean context (times the count below)
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, min_size=1, max_size=130))
def test_chunk_step_times_equal_step_time_bit_for_bit(steps: list[tuple[int, int, int, int]]) -> None:
    chunks = [c for c, _, _, _ in steps]
    hists = [h for _, h, _, _ in steps]
    nds = [n for _, _, n, _ in steps]
    ctxs = [n * kv + (n > 1) for _, _, n, kv in steps]  # + 1: a mean context off the integers
    got = QWEN.chunk_step_times(chunks, hists, nds, ctxs)
    want = [QWEN.step_time(((c, h),), n, x) for c, h, n, x in zip(chunks, hists, nds, ctxs, strict=True)]
    assert got == want  # == on floats: the same double, not approximately


def test_chunk_step_times_on_every_packaged_profile() -> None:
    """The vectorised pass, and the scalar fallback it takes past its tables or without an attention
    grid (the Llama profile's analytic attention), give the scalar results."""
    rng = np.random.default_rng(3)
    chunks = rng.integers(1, 20_000, 200).tolist()  # some steps past the 16,384-token tables
    hists = rng.integers(0, 100_000, 200).tolist()
    nds = rng.integers(0, 300, 200).tolist()
    ctxs = [n * int(k) for n, k in zip(nds, rng.integers(0, 50_000, 200), strict=True)]
    for name in profile_names():
        cost = get_profile(name).cost
        if not isinstance(cost, ProfileCostModel):
            continue
        for end in (1, 60, 200):  # within the tables only, then with steps past them
            args = [chunks[:end], hists[:end], nds[:end], ctxs[:end]]
            if end == 60:
                args[0] = [min(c, 4096) for c in args[0]]
            want = [cost.step_time(((c, h),), n, x) for c, h, n, x in zip(*args, strict=True)]
            assert cost.chunk_step_times(*args) == want, name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(-5, 100), st.floats(-5, 100), st.floats(-5, 10), st.floats(-5, 100)),
        min_size=1,
        max_size=20,
    )
)
def test_many_on_grids_with_one_point_axes(queries: list[tuple[float, float, float, float]]) -> None:
    """Grids whose pc, nd or kp axis has a single point (t = 0 there whatever the query), and a
    last segment that slopes down (the edge lookup wins beyond it)."""
    grids = [
        AttentionGrid([{"pc": 0, "nd": 1, "kp": [0], "kv": [[16, 32]], "us": [[4.0, 3.0]]}]),
        AttentionGrid(
            [
                {"pc": 0, "nd": 1, "kp": [0], "kv": [[16, 32]], "us": [[1.0, 3.0]]},
                {"pc": 16, "nd": 0, "kp": [0, 16], "kv": [[0], [0]], "us": [[5.0], [7.0]]},
            ]
        ),
    ]
    pc, kp, nd, kv = (np.asarray(col, dtype=np.float64) for col in zip(*queries, strict=True))
    for g in grids:
        want = [g(*q) for q in queries]
        assert g.many(pc, kp, nd, kv).tolist() == want
