"""Cost models (one engine step → seconds), profile readers and the named profiles.

Units: the profile tables hold **microseconds (µs)** per kernel, exactly as LLMServingSim's CSVs do; every
public ``*_time``/``step_time`` returns **seconds**; lengths are **tokens**; memory is **bytes**.

How a step time is composed (LLMServingSim v1, ``serving/core/trace_generator.py`` of
casys-kaist/LLMServingSim, read at snapshot 5daddb2; the profiles were taken with ``num_hidden_layers: 1``, so
every per-layer kernel is multiplied by the model's real layer count)::

    T = prefill tokens + decode sequences          (tokens computed this step, vLLM's num_scheduled_tokens)
    S = prefill requests + decode sequences        (rows that reach lm_head/sampler)
    step = step_dense(T)                           embedding + final_layernorm            (dense.csv)
         + L × layer_dense(T)                      2×layernorm + qkv_proj + qk_norm + rotary_emb + o_proj
         + L × attention(pc, kp, nd, kv_mean)      4-D table (attention.csv), see below
         + L × moe(tokens, activated_experts)      2-D table (moe.csv), MoE models only
         + L × collectives                         TP all-reduce / EP all-gather + reduce-scatter (link model)
         + step_sequences(S)                       lm_head + sampler                      (per_sequence.csv)

- attention: ``pc`` = sum of the step's prefill chunk tokens, ``kp`` = sum of those chunks' KV history
  (context before the chunk), ``nd`` = decode sequences, ``kv_mean`` = their mean context; LLMServingSim
  sums ``pc`` and ``kp`` over prefill requests and uses the decode mean the same way. Interpolation is
  linear on every axis (clamped below the grid, extrapolated from the top two points above it), the
  missing (pc, nd) slices of the grid take the nearest profiled slice — both as LLMServingSim does.
  LLMServingSim's batch-skew correction (``skew_fit.csv``) needs each step's max and min decode context,
  which :class:`~kvroute.engine.types.CostModel` does not carry; it is left out (its fitted
  ``alpha_default`` is 0.065, i.e. a few percent of the decode attention time).
- moe: ``tokens`` tokens each choosing ``k`` of ``E`` experts. The expected number of distinct experts
  touched under independent uniform routing, ``E·(1 − (1 − k/E)^tokens)``, is the ``activated_experts``
  coordinate (Qwen3's gate is trained with a load-balancing loss; real routing is more correlated, so
  this is an upper estimate of the weights read). With expert parallelism over ``ep`` ranks and ``G``
  gathered tokens (vLLM's all-gather/reduce-scatter backend: every rank runs its ``E/ep`` experts over
  all DP ranks' tokens), a rank sees ``G·k/ep`` token-expert pairs, i.e. ``G/ep`` profile tokens (the
  profile has ``k`` pairs per token), and ``(E/ep)·(1 − (1 − k/E)^G)`` activated experts.
  ``moe.csv`` exists for TP 1 only; LLMServingSim uses it for every TP, and so does this module.
- collectives (ring algorithm over ``p`` ranks, link ``bw`` bytes/s and ``lat`` s per message):
  all-reduce of ``B`` bytes = ``2(p−1)·(lat + B/(p·bw))``; all-gather of a ``B``-byte local chunk =
  ``(p−1)·(lat + B/bw)``; reduce-scatter of a ``B``-byte buffer = ``(p−1)·(lat + B/(p·bw))``. TP adds two
  all-reduces of ``T × hidden × dtype`` bytes per layer (after o_proj and after the MLP), as LLMServingSim
  does; EP adds the dispatch all-gather (hidden + router logits per token) and the combine
  reduce-scatter (hidden per token), see :meth:`ProfileCostModel.dp_group_step_time`.

The default profile works without ``../shared``: ``scripts/derive_profiles.py`` regroups the CSV rows
into ``kvroute/engine/profiles/*.json`` (see :func:`tables_to_json`), and :func:`get_profile` reads
those through ``importlib.resources``.
"""

from __future__ import annotations

import bisect
import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from kvroute.engine.modelconfig import ModelShape, find_model_config, load_model_config, parse_hf_config
from kvroute.errors import UserError

GIB = 1 << 30
TABLE_FORMAT = "kvroute-profile-tables/1"

# ---------------------------------------------------------------------------------------------------------
# Model shapes, GPUs, KV capacity
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU: memory in bytes, peak HBM bandwidth in bytes/s, peak dense bf16 FLOP/s (vendor sheets);
    ``key``: the hardware id LLMServingSim's profiles and cluster configs use (``hardware:``)."""

    name: str
    memory_bytes: int
    hbm_bytes_per_s: float
    bf16_flops: float
    key: str = ""


# RTX PRO 6000 Blackwell Server: 96 GB GDDR7 (LLMServingSim's cluster config: mem_size 96, mem_bw 1597 GB/s).
RTXPRO6000 = GpuSpec("NVIDIA RTX PRO 6000 Blackwell", 96 * GIB, 1597e9, 0.0, "RTXPRO6000")
# H100 SXM5 80 GB: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet).
H100_SXM = GpuSpec("NVIDIA H100 SXM 80GB", 80 * GIB, 3.35e12, 989e12, "H100")
# A100 SXM4 80 GB: 2.039 TB/s HBM2e, 312 TFLOP/s dense bf16 (NVIDIA A100 datasheet).
A100_80G = GpuSpec("NVIDIA A100 80GB", 80 * GIB, 2.039e12, 312e12, "A100")
# The GPUs a profile's ``hardware:`` may name (memory for the KV budget, the link for collectives).
GPUS: dict[str, GpuSpec] = {g.key: g for g in (RTXPRO6000, H100_SXM, A100_80G)}

# vLLM's default --gpu-memory-utilization.
GPU_MEMORY_UTILIZATION = 0.9
# Memory besides weights and KV that vLLM keeps (CUDA context, NCCL buffers, activation peak of the
# max_num_batched_tokens profiling run, CUDA graphs). An estimate: vLLM's start-up log on one GPU typically
# reports 1-3 GiB for these together; it moves the KV budget by a few percent at most.
RUNTIME_RESERVE_BYTES = 2 * GIB


def kv_capacity_tokens(
    gpu: GpuSpec,
    model: ModelShape,
    *,
    ep: int = 1,
    tp: int = 1,
    mem_util: float = GPU_MEMORY_UTILIZATION,
    reserve_bytes: int = RUNTIME_RESERVE_BYTES,
) -> int:
    """KV cache capacity of one engine in **tokens** (per GPU for TP: KV heads are split over ``tp``).

    ``(memory × mem_util − weights − reserve) / (KV bytes per token on one rank)``; raises UserError when the
    weights do not fit.
    """
    free = gpu.memory_bytes * mem_util - model.weight_bytes(ep=ep, tp=tp) - reserve_bytes
    if free <= 0:
        raise UserError(f"{model.name} does not fit on {gpu.name} (ep={ep}, tp={tp})")
    return int(free // model.kv_bytes_per_token_per_rank(tp))


# ---------------------------------------------------------------------------------------------------------
# Interpolation helpers (pure Python, used per call) and table builders (numpy, used once)
# ---------------------------------------------------------------------------------------------------------


def _bracket(xs: Sequence[float], q: float) -> tuple[int, int, float]:
    """(lo, hi, t) for linear interpolation on sorted ``xs``: clamp below, extrapolate above (t > 1).
    Callers never let an extrapolated time fall below the last profiled one: a kernel does not get
    faster with more work, and a last segment that happens to slope down (profiling noise) would
    otherwise reach negative times far beyond the table."""
    n = len(xs)
    if n == 1 or q <= xs[0]:
        return 0, 0, 0.0
    i = bisect.bisect_right(xs, q)
    if i >= n:
        lo, hi = n - 2, n - 1
    else:
        lo, hi = i - 1, i
    return lo, hi, (q - xs[lo]) / (xs[hi] - xs[lo])


def _brackets(xs: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_bracket` for an array of queries, clamped to the grid on both sides (t in [0, 1])."""
    n = len(xs)
    if n == 1:
        zero = np.zeros(len(q), dtype=np.int64)
        return zero, zero, np.zeros(len(q))
    qc = np.clip(q, xs[0], xs[-1])
    lo = np.clip(np.searchsorted(xs, qc, side="right") - 1, 0, n - 2)
    hi = lo + 1
    return lo, hi, (qc - xs[lo]) / (xs[hi] - xs[lo])


@dataclass(frozen=True, slots=True)
class Table1D:
    """y(x) by linear interpolation on sorted ``xs`` (clamped below, extrapolated above); y in µs."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    def __call__(self, x: float) -> float:
        lo, hi, t = _bracket(self.xs, x)
        y0 = self.ys[lo]
        if t > 1.0:  # above the table: the last segment's slope, never downwards
            y1 = self.ys[hi]
            return y1 + (t - 1.0) * max(y1 - y0, 0.0)
        return y0 + t * (self.ys[hi] - y0) if t else y0

    def sample(self, grid: np.ndarray) -> np.ndarray:
        """The table on many points at once (same semantics as ``__call__``)."""
        xs = np.asarray(self.xs, dtype=float)
        ys = np.asarray(self.ys, dtype=float)
        out = np.interp(grid, xs, ys)
        if len(xs) >= 2:
            above = grid > xs[-1]
            slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out[above] = ys[-1] + (grid[above] - xs[-1]) * slope
        return out


def _interp_extrap(
    grid: np.ndarray, xs: Sequence[float] | np.ndarray, ys: Sequence[float] | np.ndarray
) -> np.ndarray:
    """``Table1D(xs, ys).sample(grid)`` without building the table (xs sorted ascending)."""
    x = np.asarray(xs, dtype=float)
    y = np.asarray(ys, dtype=float)
    out = np.interp(grid, x, y)
    if len(x) >= 2:
        above = grid > x[-1]
        if above.any():
            out[above] = y[-1] + (grid[above] - x[-1]) * max((y[-1] - y[-2]) / (x[-1] - x[-2]), 0.0)
    return out


@dataclass(frozen=True, slots=True)
class MoETable:
    """MoE block time (µs, one layer, one rank) over (tokens, activated_experts): ``moe.csv``."""

    experts: tuple[int, ...]
    rows: tuple[Table1D, ...]  # one tokens → µs table per activated-experts value

    def __call__(self, tokens: float, activated: float) -> float:
        lo, hi, t = _bracket(self.experts, max(activated, 1.0))
        y0 = self.rows[lo](max(tokens, 1.0))
        if not t:
            return y0
        return y0 + t * (self.rows[hi](max(tokens, 1.0)) - y0)


class AttentionGrid:
    """Attention kernel time (µs, one layer) on a regular 4-D grid (pc, nd, kp, kv).

    Built once from the profile's slices: each (pc, nd) slice is resampled onto the union kp and kv axes
    with its own linear interpolation; missing slices copy the nearest profiled (pc, nd) (squared distance,
    LLMServingSim's fallback). Lookups are multilinear with at most 16 corners and skip exact axes.
    """

    __slots__ = (
        "_array",
        "_axes",
        "_corners",
        "_knots",
        "_last",
        "_least",
        "_nd_stride",
        "_offsets",
        "_pc_stride",
        "_slope",
        "_strides",
        "_top",
        "_values",
        "_widths",
        "kps",
        "kvs",
        "nds",
        "pcs",
    )

    def __init__(self, slices: Sequence[dict[str, Any]]) -> None:
        if not slices:
            raise ValueError("empty attention table")
        self.pcs = tuple(sorted({int(s["pc"]) for s in slices}))
        self.nds = tuple(sorted({int(s["nd"]) for s in slices}))
        self.kps = tuple(sorted({int(k) for s in slices for k in s["kp"]}))
        self.kvs = tuple(sorted({int(k) for s in slices for row in s["kv"] for k in row}))
        kp_grid = np.asarray(self.kps, dtype=float)
        kv_grid = np.asarray(self.kvs, dtype=float)
        by_pair: dict[tuple[int, int], np.ndarray] = {}
        for s in slices:
            rows = np.stack(
                [_interp_extrap(kv_grid, kv, us) for kv, us in zip(s["kv"], s["us"], strict=True)]
            )
            cols = [_interp_extrap(kp_grid, s["kp"], rows[:, j]) for j in range(len(self.kvs))]
            by_pair[(int(s["pc"]), int(s["nd"]))] = np.stack(cols, axis=1)  # [kp, kv]
        full = np.empty((len(self.pcs), len(self.nds), len(self.kps), len(self.kvs)))
        for i, pc in enumerate(self.pcs):
            for j, nd in enumerate(self.nds):
                key = (pc, nd)
                if key not in by_pair:
                    key = min(by_pair, key=lambda p: ((p[0] - pc) ** 2 + (p[1] - nd) ** 2, p))
                full[i, j] = by_pair[key]
        self._values: list[float] = full.ravel().tolist()
        self._array = full.ravel()  # the same values, for :meth:`many`
        self._least = full.min(axis=(2, 3))  # [pc, nd]: the fastest (kp, kv) vertex of each slice
        # [nd, kp, kv]: the last pc slice and its step from the one before (extrapolation beyond pc)
        self._top = full[-1]
        self._slope = full[-1] - full[-2] if len(self.pcs) > 1 else np.zeros_like(full[-1])
        self._pc_stride = len(self.nds) * len(self.kps) * len(self.kvs)
        self._nd_stride = len(self.kps) * len(self.kvs)
        # For :meth:`many`, axes in the order (pc, nd, kp, kv): each axis's points (a one-point axis
        # gets a second one, at an infinite width, so its t is 0 as in _bracket), all axes' points and
        # segment widths padded to one length and flattened, the offsets of each axis in those and
        # its last segment; the strides, and the 16 corners' offsets from the lowest corner, ordered
        # [kv][kp][nd][pc] (0 on a one-point axis, whose corners coincide).
        axes = (self.pcs, self.nds, self.kps, self.kvs)
        strides = (self._pc_stride, self._nd_stride, len(self.kvs), 1)
        width = max(2, *map(len, axes))
        knots = np.zeros((4, width))
        widths = np.ones((4, width))
        self._axes = []
        for j, axis in enumerate(axes):
            xs = np.asarray(axis if len(axis) > 1 else (axis[0], axis[0] + 1), dtype=np.float64)
            self._axes.append(xs)
            knots[j, : len(xs)] = xs
            widths[j, : len(xs) - 1] = np.diff(xs) if len(axis) > 1 else np.inf
        self._knots = knots.ravel()
        self._widths = widths.ravel()
        self._offsets = np.arange(4)[:, None] * width
        self._last = np.asarray([[len(xs) - 2] for xs in self._axes])
        self._strides = np.asarray(strides)
        steps = np.asarray([st if len(ax) > 1 else 0 for ax, st in zip(axes, strides, strict=True)])
        self._corners = (steps[::-1, None] * np.indices((2, 2, 2, 2)).reshape(4, -1)).sum(axis=0)

    def __call__(self, pc: float, kp: float, nd: float, kv: float) -> float:
        """µs for a step with ``pc`` prefill tokens over ``kp`` history and ``nd`` decodes of mean ``kv``.
        Beyond the grid: multilinear extrapolation, never below the value at the grid's edge."""
        p0, p1, tp = _bracket(self.pcs, pc)
        n0, n1, tn = _bracket(self.nds, nd)
        k0, k1, tk = _bracket(self.kps, kp)
        v0, v1, tv = _bracket(self.kvs, kv)
        out = self._lookup(p0, p1, tp, n0, n1, tn, k0, k1, tk, v0, v1, tv)
        if tp > 1.0 or tn > 1.0 or tk > 1.0 or tv > 1.0:
            edge = self._lookup(
                p0, p1, min(tp, 1.0), n0, n1, min(tn, 1.0), k0, k1, min(tk, 1.0), v0, v1, min(tv, 1.0)
            )
            out = max(out, edge)
        return out

    def many(self, pc: np.ndarray, kp: np.ndarray, nd: np.ndarray, kv: np.ndarray) -> np.ndarray:
        """``self(pc[i], kp[i], nd[i], kv[i])`` for every i at once (float64 arrays of one length), equal
        bit for bit: the same brackets, and the same float operations in the same order as
        :meth:`_lookup` (numpy's element-wise +, −, × are IEEE double like Python's floats; a step the
        scalar code skips at t = 0 adds exactly 0 here, the grid's values being finite). The edge
        lookup (every t clamped to 1) runs beside it on every row: where no t exceeds 1 it repeats the
        lookup itself, and the maximum of two equal values is that value."""
        q = np.stack((pc, nd, kp, kv))  # [axis, row]
        lo = np.stack([xs.searchsorted(qa, side="right") for xs, qa in zip(self._axes, q, strict=True)])
        lo -= 1
        np.maximum(lo, 0, out=lo)  # at or below the first point: the first segment, t = 0 below
        np.minimum(lo, self._last, out=lo)  # above the last: the last segment, t > 1
        at = lo + self._offsets
        t = (q - self._knots[at]) / self._widths[at]
        np.maximum(t, 0.0, out=t)
        ts = np.stack((t, np.minimum(t, 1.0)), axis=1)  # [axis, lookup or edge, row]
        base = self._strides @ lo
        a = self._array[base + self._corners[:, None]].reshape(2, 2, 2, 2, 1, len(base))
        for axis in (3, 2, 1, 0):  # kv, then kp, nd, pc: as _lookup nests them
            a = a[0] + ts[axis] * (a[1] - a[0])
        return np.maximum(a[0], a[1])

    def least(self, pc: np.ndarray, nd: np.ndarray) -> np.ndarray:
        """Lower bounds (µs) on ``self(pc, kp, nd, kv)`` over every ``kp`` and ``kv``, for arrays of
        (pc, nd). A lookup is multilinear in the grid values, with weights in [0, 1] on every axis
        inside the grid, and never below the grid's edge beyond it. So, with each (pc, nd) slice's
        smallest value: inside the grid, the bilinear interpolation in (pc, nd) of those smallest
        values; beyond the last pc, also each nd slice's smallest *extrapolated* vertex, interpolated
        in nd, where nd is inside the grid (the edge alone where it is not)."""
        pcs = np.asarray(self.pcs, dtype=np.float64)
        nds = np.asarray(self.nds, dtype=np.float64)
        pc = np.asarray(pc, dtype=np.float64)
        nd = np.asarray(nd, dtype=np.float64)
        p0, p1, tp = _brackets(pcs, pc)
        n0, n1, tn = _brackets(nds, nd)
        g = self._least
        edge = (1 - tp) * ((1 - tn) * g[p0, n0] + tn * g[p0, n1]) + tp * (
            (1 - tn) * g[p1, n0] + tn * g[p1, n1]
        )
        beyond = (pc > pcs[-1]) & (nd <= nds[-1])
        if len(pcs) < 2 or not beyond.any():
            return edge
        top, slope = self._top, self._slope
        over = ((pc[beyond] - pcs[-2]) / (pcs[-1] - pcs[-2]) - 1.0)[:, None, None]
        lo = (top[n0[beyond]] + over * slope[n0[beyond]]).min(axis=(1, 2))
        hi = (top[n1[beyond]] + over * slope[n1[beyond]]).min(axis=(1, 2))
        w = tn[beyond]
        out = edge.copy()
        out[beyond] = np.maximum(edge[beyond], (1 - w) * lo + w * hi)
        return out

    def _lookup(
        self,
        p0: int,
        p1: int,
        tp: float,
        n0: int,
        n1: int,
        tn: float,
        k0: int,
        k1: int,
        tk: float,
        v0: int,
        v1: int,
        tv: float,
    ) -> float:
        vals = self._values
        nkv = len(self.kvs)
        ps, ns = self._pc_stride, self._nd_stride

        def plane(base: int) -> float:  # bilinear over (kp, kv) inside one (pc, nd) slice
            r = base + k0 * nkv
            a = vals[r + v0]
            if tv:
                a += tv * (vals[r + v1] - a)
            if tk:
                r = base + k1 * nkv
                b = vals[r + v0]
                if tv:
                    b += tv * (vals[r + v1] - b)
                a += tk * (b - a)
            return a

        def row(i_pc: int) -> float:  # linear over nd
            a = plane(i_pc * ps + n0 * ns)
            if tn:
                a += tn * (plane(i_pc * ps + n1 * ns) - a)
            return a

        out = row(p0)
        if tp:
            out += tp * (row(p1) - out)
        return out


# ---------------------------------------------------------------------------------------------------------
# Profile tables: what the CSVs hold, regrouped (also the JSON that ships inside the package)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileTables:
    """One GPU's kernel profile for one model at one TP degree, regrouped from the source CSVs (µs).

    - ``layer_dense``: tokens → µs of one decoder layer's dense kernels (norms, projections, rotary;
      for the v0 Llama profile also attention at kv=0 and the MLP).
    - ``step_dense``: tokens → µs of once-per-step dense kernels (embedding, final norm).
    - ``step_sequences``: sequences → µs of lm_head + sampler.
    - ``moe``: (activated_experts, tokens → µs) rows, or ``None`` for a dense model.
    - ``attention``: 4-D slices ``{pc, nd, kp: [..], kv: [[..] per kp], us: [[..] per kp]}`` or ``None``
      (then ``layer_dense`` carries attention without KV history and an analytic term adds the history).
    """

    source: str
    layer_dense: Table1D
    step_dense: Table1D
    step_sequences: Table1D
    moe: MoETable | None
    attention: tuple[dict[str, Any], ...] | None
    profiled_max_tokens: int = 2048
    notes: tuple[str, ...] = field(default=())


def _t1(d: dict[str, Any]) -> Table1D:
    return Table1D(tuple(float(x) for x in d["x"]), tuple(float(y) for y in d["us"]))


def _t1_json(t: Table1D) -> dict[str, Any]:
    return {"x": [int(x) if float(x).is_integer() else x for x in t.xs], "us": [round(y, 3) for y in t.ys]}


def tables_to_json(tables: ProfileTables) -> dict[str, Any]:
    """A JSON-able dict; the derived package data is exactly this (µs rounded to 0.001)."""
    return {
        "format": TABLE_FORMAT,
        "source": tables.source,
        "notes": list(tables.notes),
        "profiled_max_tokens": tables.profiled_max_tokens,
        "layer_dense": _t1_json(tables.layer_dense),
        "step_dense": _t1_json(tables.step_dense),
        "step_sequences": _t1_json(tables.step_sequences),
        "moe": None
        if tables.moe is None
        else [
            {"experts": e, **_t1_json(r)} for e, r in zip(tables.moe.experts, tables.moe.rows, strict=True)
        ],
        "attention": None
        if tables.attention is None
        else [{**s, "us": [[round(float(v), 3) for v in row] for row in s["us"]]} for s in tables.attention],
    }


def tables_from_json(data: dict[str, Any], where: str) -> ProfileTables:
    """Inverse of :func:`tables_to_json`; ``where`` names the file in errors."""
    if data.get("format") != TABLE_FORMAT:
        raise UserError(f"{where}: not a {TABLE_FORMAT} file")
    moe = data.get("moe")
    return ProfileTables(
        source=str(data["source"]),
        layer_dense=_t1(data["layer_dense"]),
        step_dense=_t1(data["step_dense"]),
        step_sequences=_t1(data["step_sequences"]),
        moe=None
        if moe is None
        else MoETable(tuple(int(r["experts"]) for r in moe), tuple(_t1(r) for r in moe)),
        attention=None if data.get("attention") is None else tuple(data["attention"]),
        profiled_max_tokens=int(data.get("profiled_max_tokens", 2048)),
        notes=tuple(data.get("notes", ())),
    )


def _read_csv(path: Path, columns: Sequence[str]) -> list[dict[str, str]]:
    if not path.is_file():
        raise UserError(f"profile file missing: {path}")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path}: missing column(s) {', '.join(missing)}")
        return list(reader)


def _sum_ops(
    rows: list[dict[str, str]],
    name_col: str,
    x_col: str,
    y_col: str,
    ops: Sequence[str],
    scale: float,
    path: Path,
) -> Table1D:
    """Sum the named ops (each 1-D over ``x_col``; an op named twice counts twice) on the union of their x
    grids; µs × ``scale``."""
    per_op: dict[str, tuple[list[float], list[float]]] = {}
    for r in rows:
        if r[name_col] in ops:
            xs, ys = per_op.setdefault(r[name_col], ([], []))
            xs.append(float(r[x_col]))
            ys.append(float(r[y_col]) * scale)
    absent = [op for op in ops if op not in per_op]
    if absent:
        raise UserError(f"{path}: no rows for {', '.join(absent)}")
    grid = np.asarray(sorted({x for xs, _ in per_op.values() for x in xs}))
    total = np.zeros_like(grid)
    for op in ops:
        xs, ys = per_op[op]
        order = np.argsort(xs)
        total += _interp_extrap(grid, np.asarray(xs)[order].tolist(), np.asarray(ys)[order].tolist())
    return Table1D(tuple(grid.tolist()), tuple(total.tolist()))


# LLMServingSim's qwen3 / qwen3_moe architecture sequence (profiler/models/qwen3_moe.yaml).
V1_LAYER_OPS = ("layernorm", "layernorm", "qkv_proj", "qk_norm", "rotary_emb", "o_proj")
V1_DENSE_MLP_OPS = ("gate_up_proj", "act_fn", "down_proj")
V1_STEP_OPS = ("embedding", "final_layernorm")
V1_SEQ_OPS = ("lm_head", "sampler")


def read_profile_dir(profile_dir: str | Path, tp: int = 1) -> ProfileTables:
    """Read an LLMServingSim v1 bundle (``meta.yaml`` + ``tp<N>/{dense,attention,per_sequence,moe}.csv``).

    ``moe.csv`` is taken from ``tp<N>/`` when present, else from ``tp1/`` (it is profiled at TP 1 only).
    Raises UserError naming the first missing file or column.
    """
    root = Path(profile_dir)
    if not (root / "meta.yaml").is_file():
        raise UserError(f"profile file missing: {root / 'meta.yaml'}")
    tpdir = root / f"tp{tp}"
    if not tpdir.is_dir():
        have = sorted(p.name for p in root.glob("tp*") if p.is_dir())
        raise UserError(f"profile dir {root} has no tp{tp}/ (has: {', '.join(have) or 'none'})")
    dense_path = tpdir / "dense.csv"
    dense = _read_csv(dense_path, ("layer", "tokens", "time_us"))
    names = {r["layer"] for r in dense}
    layer_ops = V1_LAYER_OPS + (V1_DENSE_MLP_OPS if "gate_up_proj" in names else ())
    layer_dense = _sum_ops(dense, "layer", "tokens", "time_us", layer_ops, 1.0, dense_path)
    step_dense = _sum_ops(dense, "layer", "tokens", "time_us", V1_STEP_OPS, 1.0, dense_path)
    seq_path = tpdir / "per_sequence.csv"
    seq = _read_csv(seq_path, ("layer", "sequences", "time_us"))
    step_sequences = _sum_ops(seq, "layer", "sequences", "time_us", V1_SEQ_OPS, 1.0, seq_path)

    attn_path = tpdir / "attention.csv"
    attn_rows = _read_csv(attn_path, ("prefill_chunk", "kv_prefill", "n_decode", "kv_decode", "time_us"))
    grouped: dict[tuple[int, int], dict[int, list[tuple[int, float]]]] = {}
    for r in attn_rows:
        key = (int(r["prefill_chunk"]), int(r["n_decode"]))
        grouped.setdefault(key, {}).setdefault(int(r["kv_prefill"]), []).append(
            (int(r["kv_decode"]), float(r["time_us"]))
        )
    slices = []
    for (pc, nd), by_kp in sorted(grouped.items()):
        kps = sorted(by_kp)
        rows = [sorted(by_kp[k]) for k in kps]
        slices.append(
            {
                "pc": pc,
                "nd": nd,
                "kp": kps,
                "kv": [[k for k, _ in row] for row in rows],
                "us": [[v for _, v in row] for row in rows],
            }
        )

    moe: MoETable | None = None
    moe_path = tpdir / "moe.csv" if (tpdir / "moe.csv").is_file() else root / "tp1" / "moe.csv"
    if moe_path.is_file():
        by_e: dict[int, list[tuple[float, float]]] = {}
        for r in _read_csv(moe_path, ("tokens", "activated_experts", "time_us")):
            by_e.setdefault(int(r["activated_experts"]), []).append((float(r["tokens"]), float(r["time_us"])))
        es = sorted(by_e)
        moe = MoETable(
            tuple(es),
            tuple(
                Table1D(tuple(x for x, _ in sorted(by_e[e])), tuple(y for _, y in sorted(by_e[e])))
                for e in es
            ),
        )
    max_tokens = int(max(float(r["tokens"]) for r in dense))
    return ProfileTables(
        source=f"LLMServingSim v1 profile {root} tp{tp}",
        layer_dense=layer_dense,
        step_dense=step_dense,
        step_sequences=step_sequences,
        moe=moe,
        attention=tuple(slices),
        profiled_max_tokens=max_tokens,
        notes=(f"moe from {moe_path.parent.name}/moe.csv",) if moe is not None else (),
    )


# LLMServingSim v0 layers.csv op names (Llama): per-layer, once-per-step and per-sequence groups.
V0_LAYER_OPS = (
    "input_layernorm",
    "q_proj",
    "k_proj",
    "v_proj",
    "rope",
    "attn",
    "o_proj",
    "post_layernorm",
    "gate_proj",
    "up_proj",
    "act_fn",
    "down_proj",
)
V0_STEP_OPS = ("embedding", "final_layernorm")
V0_SEQ_OPS = ("lm_head",)


def read_v0_layers_csv(path: str | Path, sample: Callable[[int], bool] | None = None) -> ProfileTables:
    """Read an LLMServingSim v0 ``layers.csv`` (``layer_name,input,kv_cache,tp_size,latency(ns)``).

    Rows with ``kv_cache == 0`` only (the file has no others); ``sample(tokens)`` keeps a subset of the
    token grid (the derived package data keeps 1-16 and every 16th up to 2048). ``attn`` at kv=0 is the
    causal attention inside the chunk; attention over KV history is added analytically by the cost model.
    """
    p = Path(path)
    rows = _read_csv(p, ("layer_name", "input", "kv_cache", "latency(ns)"))
    rows = [r for r in rows if int(r["kv_cache"]) == 0 and (sample is None or sample(int(r["input"])))]
    ns_to_us = 1e-3
    return ProfileTables(
        source=f"LLMServingSim v0 profile {p}",
        layer_dense=_sum_ops(rows, "layer_name", "input", "latency(ns)", V0_LAYER_OPS, ns_to_us, p),
        step_dense=_sum_ops(rows, "layer_name", "input", "latency(ns)", V0_STEP_OPS, ns_to_us, p),
        step_sequences=_sum_ops(rows, "layer_name", "input", "latency(ns)", V0_SEQ_OPS, ns_to_us, p),
        moe=None,
        attention=None,
        profiled_max_tokens=int(max(float(r["input"]) for r in rows)),
    )


# ---------------------------------------------------------------------------------------------------------
# Cost models
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """A GPU-to-GPU link for collectives: bandwidth in bytes/s, per-message latency in seconds."""

    bytes_per_s: float
    latency_s: float

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return 2 * (ranks - 1) * (self.latency_s + nbytes / (ranks * self.bytes_per_s))

    def all_gather(self, local_bytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency_s + local_bytes / self.bytes_per_s)

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (self.latency_s + nbytes / (ranks * self.bytes_per_s))


# LLMServingSim's cluster config for the RTX PRO 6000 runs (bench/examples/RTXPRO6000/*/config.json):
# link_bw 16 GB/s, link_latency 20000 ns — two GPUs on PCIe, no NVLink.
RTXPRO6000_PCIE = LinkSpec(16e9, 20e-6)
# H100 SXM NVLink 4: 450 GB/s per direction; ~5 µs NCCL small-message latency (an estimate).
H100_NVLINK = LinkSpec(450e9, 5e-6)


@dataclass(frozen=True, slots=True)
class AnalyticAttention:
    """Attention over KV history for profiles without an attention table (µs, one layer).

    Roofline per step: decode reads ``kv_tokens × kv_bytes`` at ``bw_eff``; a prefill chunk of ``c``
    tokens over ``h`` history tokens costs max(4·c·h·heads·head_dim FLOP at ``flops_eff``, h·kv_bytes
    at ``bw_eff``). ``kv_bytes`` is one layer's K+V bytes per token on this GPU.
    """

    kv_bytes_per_token_layer: float
    qk_flops_per_pair: float  # 4 · heads · head_dim (QK^T and PV, multiply-add = 2 FLOP)
    bw_eff: float  # bytes/s achieved
    flops_eff: float  # FLOP/s achieved

    def __call__(self, prefill: Sequence[tuple[int, int]], decode_kv_tokens: int) -> float:
        us = decode_kv_tokens * self.kv_bytes_per_token_layer / self.bw_eff
        for chunk, hist in prefill:
            if hist > 0:
                us += max(
                    chunk * hist * self.qk_flops_per_pair / self.flops_eff,
                    hist * self.kv_bytes_per_token_layer / self.bw_eff,
                )
        return us * 1e6


# Achieved fractions of peak used by AnalyticAttention: 0.9 of HBM bandwidth — the RTX PRO 6000 Qwen3 decode
# attention table reads 128 × 13122 tokens × 2 KiB in 2.32 ms (1.48 TB/s, 0.93 of 1.597 TB/s); 0.5 of bf16
# tensor FLOP/s — FlashAttention-2's forward pass reaches 50-73 % of peak on A100/H100 (Dao, 2023).
ATTN_BW_EFFICIENCY = 0.9
ATTN_FLOPS_EFFICIENCY = 0.5


def _expected_distinct(experts: int, k: int, tokens: float) -> float:
    """Expected distinct experts among ``experts`` hit by ``tokens`` tokens each choosing ``k`` uniformly."""
    if tokens <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


class ProfileCostModel:
    """Step time from per-layer kernel tables (see the module docstring for the composition).

    ``tp``: tensor-parallel degree the tables were profiled at (adds two all-reduces per layer over
    ``link``). Per-token sums are precomputed for 0…``table_tokens`` tokens as running maxima (so more
    tokens never cost less despite profiling noise), so a call costs one list index plus the attention
    lookup; beyond ``table_tokens`` the tables are interpolated/extrapolated directly.
    """

    def __init__(
        self,
        name: str,
        tables: ProfileTables,
        model: ModelShape,
        *,
        tp: int = 1,
        link: LinkSpec | None = None,
        analytic_attention: AnalyticAttention | None = None,
        table_tokens: int = 16384,
    ) -> None:
        if tables.attention is None and analytic_attention is None:
            raise ValueError("a profile without an attention table needs analytic_attention")
        self.name = name
        self.tables = tables
        self.model = model
        self.tp = tp
        self.link = link
        self._attn = AttentionGrid(tables.attention) if tables.attention is not None else None
        self._analytic = analytic_attention
        L = model.num_layers
        grid = np.arange(table_tokens + 1, dtype=float)
        g1 = np.maximum(grid, 1.0)
        layer_us = tables.layer_dense.sample(g1) * L
        if tp > 1 and link is not None:  # two all-reduces of T × hidden activations per layer
            nbytes = grid * model.hidden * model.dtype_bytes
            per = 2 * (tp - 1) * (link.latency_s + nbytes / (tp * link.bytes_per_s)) * 2e6
            layer_us = layer_us + per * L
        # Running maxima: profiled kernels are noisy at small sizes (e.g. the v0 Llama table is faster at
        # 32 tokens than at 16), and a step with more work must not be predicted faster.
        acc = np.maximum.accumulate
        self._layer_us: list[float] = acc(layer_us).tolist()
        self._step_us: list[float] = acc(tables.step_dense.sample(g1)).tolist()
        moe1 = np.zeros_like(grid)
        if tables.moe is not None and model.num_experts:
            moe1 = acc(np.array([self._moe_us(t, 1, 1) for t in grid]) * L)
        self._moe1_us: list[float] = moe1.tolist()
        self._tok_us: list[float] = (np.asarray(self._layer_us) + self._step_us + moe1).tolist()
        self._tok_us[0] = 0.0
        self._seq_us: list[float] = acc(tables.step_sequences.sample(g1)).tolist()
        self._seq_us[0] = 0.0
        self._tok_array = np.asarray(self._tok_us)  # the same values, for :meth:`chunk_step_times`
        self._seq_array = np.asarray(self._seq_us)

    # -- pieces (µs) -------------------------------------------------------------------------------------
    def _moe_us(self, gathered_tokens: float, ep: int, dp: int) -> float:
        """One layer's MoE µs on one EP rank when ``gathered_tokens`` tokens (all DP ranks) are routed."""
        moe = self.tables.moe
        if moe is None or gathered_tokens <= 0:
            return 0.0
        m = self.model
        activated = _expected_distinct(m.num_experts, m.experts_per_token, gathered_tokens) / ep
        return moe(gathered_tokens / ep, activated)

    def _attention_us(
        self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int
    ) -> float:
        if self._attn is not None:
            pc = kp = 0
            for chunk, hist in prefill:
                pc += chunk
                kp += hist
            kv = decode_kv_tokens / num_decode if num_decode else 0.0
            return self._attn(pc, kp, num_decode, kv) * self.model.num_layers
        assert self._analytic is not None
        return self._analytic(prefill, decode_kv_tokens) * self.model.num_layers

    def _dense_us(self, tokens: int) -> float:
        """L × layer_dense + step_dense (+ TP all-reduce) for ``tokens`` tokens, µs."""
        if tokens < len(self._layer_us):
            return self._layer_us[tokens] + self._step_us[tokens]
        L = self.model.num_layers
        us = L * self.tables.layer_dense(tokens) + self.tables.step_dense(tokens)
        if self.tp > 1 and self.link is not None:
            us += L * 2e6 * self.link.all_reduce(tokens * self.model.hidden * self.model.dtype_bytes, self.tp)
        return us

    def _token_us(self, tokens: int) -> float:
        """The terms of a step of ``tokens`` tokens that depend on the total only (dense and MoE), µs."""
        if tokens < len(self._tok_us):
            return self._tok_us[tokens]
        return self._dense_us(tokens) + self._moe_us(tokens, 1, 1) * self.model.num_layers

    def _seq(self, seqs: int) -> float:
        return self._seq_us[seqs] if seqs < len(self._seq_us) else self.tables.step_sequences(seqs)

    def least_step_times(self, tokens: int, max_decodes: int) -> list[float]:
        """For d = 0 … min(tokens, max_decodes): a lower bound (seconds) on any step of ``tokens``
        tokens of which d are decodes, whatever the prefill and decode contexts and however the
        prefill is split into chunks (it has at least d rows, plus one if any prefill). The token
        terms depend on the total only, the per-sequence term grows with rows, and the attention is
        at least :meth:`AttentionGrid.least` (with an analytic attention: its value without context,
        which context only adds to)."""
        if tokens <= 0:
            return [0.0]
        tok = self._token_us(tokens)
        d = np.arange(min(tokens, max_decodes) + 1)
        pc = tokens - d
        seq = np.array([self._seq(int(r)) for r in d + (pc > 0)])
        if self._attn is not None:
            attn = self._attn.least(pc, d) * self.model.num_layers
        else:
            attn = np.array(
                [
                    self._attention_us([(int(p), 0)] if p else [], int(k), int(k))
                    for p, k in zip(pc, d, strict=True)
                ]
            )
        return (np.maximum(tok + seq + attn, 0.0) * 1e-6).tolist()

    # -- CostModel ---------------------------------------------------------------------------------------
    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        """Seconds for one step of one engine (no data parallelism)."""
        tokens = num_decode
        for chunk, _ in prefill:
            tokens += chunk
        if tokens <= 0:
            return 0.0
        us = self._token_us(tokens)
        us += self._seq(len(prefill) + num_decode)
        us += self._attention_us(prefill, num_decode, decode_kv_tokens)
        return max(us, 0.0) * 1e-6

    def chunk_step_times(
        self,
        chunks: Sequence[int],
        histories: Sequence[int],
        num_decode: Sequence[int],
        decode_kv_tokens: Sequence[int],
    ) -> list[float]:
        """``step_time(((chunks[i], histories[i]),), num_decode[i], decode_kv_tokens[i])`` for every i
        (seconds), equal bit for bit, in one vectorised pass: the same table entries and the same float
        operations in the same order (:meth:`AttentionGrid.many`). Chunks of at least one token, counts
        at least 0. Steps past the precomputed tables (``table_tokens``) or a profile without an
        attention table take the scalar path, row by row."""
        grid = self._attn
        rows = np.array((chunks, histories, num_decode, decode_kv_tokens), dtype=np.int64)
        tokens = rows[0] + rows[2]
        if grid is None or not len(tokens) or int(tokens.max()) >= len(self._tok_us):
            return [
                self.step_time(((c, h),), nd, kv)
                for c, h, nd, kv in zip(chunks, histories, num_decode, decode_kv_tokens, strict=True)
            ]
        pc, kp, nd, ctx = rows.astype(np.float64)  # exact: token counts are far below 2**53
        kv = np.divide(ctx, nd, out=np.zeros(len(nd)), where=nd > 0)
        attn = grid.many(pc, kp, nd, kv) * self.model.num_layers
        tok = self._tok_array[tokens]
        seq = self._seq_array[rows[2] + 1]
        return (np.maximum(tok + seq + attn, 0.0) * 1e-6).tolist()

    def dp_group_step_time(
        self,
        batches: Sequence[tuple[Sequence[tuple[int, int]], int, int]],
        *,
        ep: int,
        link: LinkSpec | None = None,
    ) -> float:
        """Seconds for one lockstep step of a data-parallel group with expert parallelism (vLLM DP+EP).

        ``batches[r] = (prefill, num_decode, decode_kv_tokens)`` of DP rank ``r``; an empty batch is the
        dummy step vLLM runs on an idle rank (1 token) while another rank has work. All ranks pad their
        token count to the group's maximum ``Tpad`` (vLLM's DP padding for the MoE collectives), so every
        rank's dense layers and MoE see ``Tpad`` tokens, the MoE sees ``G = dp × Tpad`` gathered tokens
        over ``E/ep`` local experts, and each layer adds the EP dispatch all-gather (``Tpad × (hidden +
        E) × dtype`` bytes per rank: hidden states and router logits) and combine reduce-scatter
        (``G × hidden × dtype`` bytes). Attention and lm_head use each rank's real batch. The step lasts
        as long as the slowest rank. Returns 0 when every batch is empty.
        """
        dp = len(batches)
        tokens = [nd + sum(c for c, _ in pf) for pf, nd, _ in batches]
        if max(tokens, default=0) <= 0:
            return 0.0
        tpad = max(tokens)
        m = self.model
        L = m.num_layers
        shared = self._dense_us(tpad) + L * self._moe_us(dp * tpad, ep, dp)
        lk = link if link is not None else self.link
        if lk is not None and ep > 1:
            ag = lk.all_gather(tpad * (m.hidden + m.num_experts) * m.dtype_bytes, ep)
            rs = lk.reduce_scatter(dp * tpad * m.hidden * m.dtype_bytes, ep)
            shared += L * (ag + rs) * 1e6
        worst = 0.0
        for (pf, nd, kvd), t in zip(batches, tokens, strict=True):
            if t <= 0:  # dummy batch: one token, no KV
                own = self._seq(1) + self._attention_us((), 1, 0)
            else:
                own = self._seq(len(pf) + nd) + self._attention_us(pf, nd, kvd)
            worst = max(worst, own)
        return (shared + worst) * 1e-6


class LinearCostModel:
    """``step = decode_s_per_seq × num_decode + prefill_s_per_token × prefill tokens`` (seconds).

    No fixed cost and no KV-length term: the shape of a claim, not of a GPU.
    """

    def __init__(self, name: str, decode_s_per_seq: float, prefill_s_per_token: float) -> None:
        self.name = name
        self.decode_s_per_seq = decode_s_per_seq
        self.prefill_s_per_token = prefill_s_per_token

    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        tokens = 0
        for chunk, _ in prefill:
            tokens += chunk
        return num_decode * self.decode_s_per_seq + tokens * self.prefill_s_per_token


# ---------------------------------------------------------------------------------------------------------
# Named profiles
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Profile:
    """A named cost model with its KV budget.

    ``kv_capacity_tokens``: KV cache of one engine in tokens (see :func:`kv_capacity_tokens`);
    ``num_kv_blocks(block_size)`` turns it into vLLM's block count.
    """

    name: str
    cost: ProfileCostModel | LinearCostModel
    kv_capacity_tokens: int
    description: str
    source: str
    model: ModelShape
    gpu: GpuSpec

    def num_kv_blocks(self, block_size: int = 16) -> int:
        return self.kv_capacity_tokens // block_size


DEFAULT_PROFILE = "qwen3-30b-a3b-rtxpro6000-tp1"
_DATA_PACKAGE = "kvroute.engine.profiles"


def load_packaged_tables(filename: str) -> ProfileTables:
    """Tables shipped inside the package (written by ``scripts/derive_profiles.py``)."""
    text = resources.files(_DATA_PACKAGE).joinpath(filename).read_text()
    return tables_from_json(json.loads(text), filename)


def load_packaged_model(filename: str, name: str) -> ModelShape:
    """The architecture of a packaged profile's model, from the HF ``config.json`` shipped beside its
    tables (``kvroute/engine/profiles/*.config.json``; sources in that package's docstring)."""
    text = resources.files(_DATA_PACKAGE).joinpath(filename).read_text()
    return parse_hf_config(json.loads(text), filename, name)


# The models the packaged tables were profiled with, and their configs in the package.
QWEN3_30B_A3B_CONFIG = ("qwen3-30b-a3b-instruct-2507.config.json", "Qwen/Qwen3-30B-A3B-Instruct-2507")
LLAMA31_8B_CONFIG = ("llama-3.1-8b.config.json", "meta-llama/Llama-3.1-8B")


def _qwen_rtx() -> Profile:
    tables = load_packaged_tables("qwen3-30b-a3b-rtxpro6000-tp1.json")
    m, g = load_packaged_model(*QWEN3_30B_A3B_CONFIG), RTXPRO6000
    return Profile(
        name="qwen3-30b-a3b-rtxpro6000-tp1",
        cost=ProfileCostModel("qwen3-30b-a3b-rtxpro6000-tp1", tables, m, tp=1, link=RTXPRO6000_PCIE),
        kv_capacity_tokens=kv_capacity_tokens(g, m),
        description="Qwen3-30B-A3B bf16 on one RTX PRO 6000 (96 GB), vLLM 0.19, per-layer kernel tables",
        source="LLMServingSim profiler/perf/RTXPRO6000/Qwen/Qwen3-30B-A3B-Instruct-2507/bf16/tp1 "
        "(casys-kaist/LLMServingSim 5daddb2), derived by scripts/derive_profiles.py",
        model=m,
        gpu=g,
    )


def _llama_h100() -> Profile:
    tables = load_packaged_tables("llama31-8b-h100-tp1.json")
    m, g = load_packaged_model(*LLAMA31_8B_CONFIG), H100_SXM
    kv_layer = 2 * m.num_kv_heads * m.head_dim * m.dtype_bytes
    analytic = AnalyticAttention(
        kv_bytes_per_token_layer=kv_layer,
        qk_flops_per_pair=4.0 * m.num_heads * m.head_dim,
        bw_eff=ATTN_BW_EFFICIENCY * g.hbm_bytes_per_s,
        flops_eff=ATTN_FLOPS_EFFICIENCY * g.bf16_flops,
    )
    return Profile(
        name="llama31-8b-h100-tp1",
        cost=ProfileCostModel("llama31-8b-h100-tp1", tables, m, analytic_attention=analytic),
        kv_capacity_tokens=kv_capacity_tokens(g, m),
        description="Llama-3.1-8B bf16 on one H100 SXM: v0 per-op tables (kv=0) + roofline attention "
        "over KV history (0.9 of HBM bandwidth, 0.5 of bf16 FLOP/s)",
        source="LLMServingSim profiler/v0/perf_models/H100/meta-llama/Llama-3.1-8B/tp1/layers.csv "
        "(casys-kaist/LLMServingSim 5daddb2), derived by scripts/derive_profiles.py",
        model=m,
        gpu=g,
    )


# design-a100-qwen30b: the seed design document (seed/lmetric-seed.zh.txt, line 18) measured Qwen-30B on an
# A100: "per-token decode time grows linearly from 15 ms at BS 1 to 120 ms at BS 8" → 15 ms per decoding
# sequence. Prefill rate (our choice, not the document's): 2 × 3.3e9 active parameters FLOP per token at
# 50 % of the A100's 312 TFLOP/s bf16 = 42.3 µs per token (87 ms for 2048 tokens), consistent with the
# document's remark that prompt length moves a request's latency by under 10 %.
DESIGN_DECODE_S_PER_SEQ = 0.015
DESIGN_PREFILL_S_PER_TOKEN = 2 * 3.3e9 / (0.5 * A100_80G.bf16_flops)


def _design() -> Profile:
    m, g = load_packaged_model(*QWEN3_30B_A3B_CONFIG), A100_80G
    return Profile(
        name="design-a100-qwen30b",
        cost=LinearCostModel("design-a100-qwen30b", DESIGN_DECODE_S_PER_SEQ, DESIGN_PREFILL_S_PER_TOKEN),
        kv_capacity_tokens=kv_capacity_tokens(g, m),
        description="the design document's claim: decode step 15 ms at batch 1 rising linearly to 120 ms "
        "at batch 8 (15 ms per sequence); prefill 42.3 µs/token (3.3 B active params at 50 % of 312 TFLOP/s)",
        source="seed/lmetric-seed.zh.txt line 18 (A100, Qwen-30B); prefill rate derived, see cost.py",
        model=m,
        gpu=g,
    )


_PROFILES: dict[str, Callable[[], Profile]] = {
    "qwen3-30b-a3b-rtxpro6000-tp1": _qwen_rtx,
    "llama31-8b-h100-tp1": _llama_h100,
    "design-a100-qwen30b": _design,
}


def profile_names() -> list[str]:
    """Names accepted by :func:`get_profile`, the default first."""
    return list(_PROFILES)


def get_profile(name: str = DEFAULT_PROFILE) -> Profile:
    """Build the named profile (reads package data; cheap enough to call per run, not per step)."""
    factory = _PROFILES.get(name)
    if factory is None:
        raise UserError(f"unknown profile {name!r}; valid: {', '.join(_PROFILES)}")
    return factory()


def profile_from_dir(
    profile_dir: str | Path,
    tp: int = 1,
    model: ModelShape | None = None,
    model_config: str | Path | None = None,
) -> Profile:
    """A profile from an LLMServingSim v1 bundle (``meta.yaml`` + ``tp<N>/``), at any TP degree it has.

    The architecture comes from ``model`` if given, else the Hugging Face ``config.json`` at
    ``model_config``, else one next to the profile (:func:`~kvroute.engine.modelconfig.find_model_config`);
    its name from ``meta.yaml``'s ``model``. The GPU from ``meta.yaml``'s ``hardware`` (:data:`GPUS`).
    Raises UserError (one line, naming the file) for a missing piece or a config that contradicts the
    profile (MoE config without ``moe.csv``, ``model_type`` ≠ the profiled ``architecture``).
    """
    import yaml

    root = Path(profile_dir)
    tables = read_profile_dir(root, tp)
    meta_path = root / "meta.yaml"
    try:
        meta = yaml.safe_load(meta_path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{meta_path}: not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{meta_path}: not a mapping")
    hardware = str(meta.get("hardware", ""))
    gpu = GPUS.get(hardware)
    if gpu is None:
        raise UserError(f"{meta_path}: unknown hardware {hardware or None!r}; known: {', '.join(GPUS)}")
    name = str(meta.get("model") or root.name)
    if model is None:
        cfg_path = Path(model_config) if model_config is not None else find_model_config(root)
        if cfg_path is None:
            raise UserError(
                f"model config missing: no Hugging Face config.json in {root} or {root.parent}; "
                f"give {name}'s config.json with --model-config FILE"
            )
        model = load_model_config(cfg_path, name)
        arch = meta.get("architecture")
        types = _config_model_types(cfg_path)
        if arch and types and str(arch) not in types:
            raise UserError(
                f"{cfg_path}: model_type {', '.join(sorted(types))}, but {meta_path} was profiled as {arch!r}"
            )
        if model.num_experts and tables.moe is None:
            raise UserError(
                f"{cfg_path}: a MoE model ({model.num_experts} experts) but the profile has no "
                f"{root / f'tp{tp}' / 'moe.csv'} (nor tp1/moe.csv)"
            )
        if not model.num_experts and tables.moe is not None:
            raise UserError(f"{cfg_path}: a dense model, but {root} holds a MoE profile (moe.csv)")
    link = RTXPRO6000_PCIE if gpu is RTXPRO6000 else H100_NVLINK
    pname = f"dir:{root.name}-tp{tp}"
    return Profile(
        name=pname,
        cost=ProfileCostModel(pname, tables, model, tp=tp, link=link),
        kv_capacity_tokens=kv_capacity_tokens(gpu, model, tp=tp),
        description=f"{model.name} on {meta.get('gpu', gpu.name)} tp{tp}",
        source=tables.source,
        model=model,
        gpu=gpu,
    )


def _config_model_types(path: Path) -> set[str]:
    """``model_type`` of a HF config and of its nested text model (multimodal configs), where present."""
    data = json.loads(path.read_text())
    found = {str(data["model_type"])} if data.get("model_type") else set()
    for key in ("text_config", "llm_config", "language_config"):
        nested = data.get(key)
        if isinstance(nested, dict) and nested.get("model_type"):
            found.add(str(nested["model_type"]))
    return found


__all__ = [
    "DEFAULT_PROFILE",
    "AttentionGrid",
    "GpuSpec",
    "LinearCostModel",
    "LinkSpec",
    "ModelShape",
    "Profile",
    "ProfileCostModel",
    "ProfileTables",
    "get_profile",
    "kv_capacity_tokens",
    "load_packaged_model",
    "profile_from_dir",
    "profile_names",
    "read_profile_dir",
    "read_v0_layers_csv",
    "tables_from_json",
    "tables_to_json",
]
