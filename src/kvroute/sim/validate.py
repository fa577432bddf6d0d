"""Replay a real vLLM benchmark run through the engine model and compare latencies.

A bench folder (LLMServingSim's ``bench/examples/<hw>/<model>/``) holds ``vllm/meta.json`` (engine
settings), ``vllm/requests.jsonl`` (per request: ``input_toks``, ``output_toks`` and vLLM's
``queued_ts``/``first_token_ts``/``last_token_ts`` on the engine's monotonic clock, seconds) and
optionally ``config.json`` (LLMServingSim's cluster config: ``link_bw`` in GB/s, ``link_latency`` in ns,
``nodes[0].instances[0].hardware``: the GPU the run used).

Latency definitions (LLMServingSim's ``bench/core/validate.py``, applied to both sides):
TTFT = first token − arrival, TPOT = (last token − first token) / (output tokens − 1) for outputs of 2+
tokens, e2e = last token − arrival; the measured arrival is ``queued_ts`` (same clock as the token
times; ``arrival_time`` is wall-clock).

The replay (:func:`simulate`) reproduces what ran: ``data_parallel_size`` engines (one
:class:`~kvroute.engine.model.EngineModel` each, with the run's ``max_num_seqs`` and
``max_num_batched_tokens``), requests routed at their arrival by a policy (vLLM's DP balancer,
``make_policy("vllm")``), each request given its own KV blocks (the prompts carry no prefix
information). With data parallelism the engines step in **lockstep**, as vLLM's DP engine cores do
for MoE models: every step all ranks synchronise (an idle rank runs a dummy one-token batch while
any rank has work), and the step lasts as long as the slowest rank —
:meth:`~kvroute.engine.cost.ProfileCostModel.dp_group_step_time`. Requests that arrive during a step
join the next one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.engine.cost import LinkSpec, ProfileCostModel
from kvroute.engine.model import EngineModel
from kvroute.engine.types import EngineConfig, EngineRequest, OutputKind
from kvroute.errors import UserError
from kvroute.routing.core import RouteRequest, RoutingCore, build_policy
from kvroute.routing.kvview import KVView
from kvroute.views import InstanceView

__all__ = [
    "BenchRequest",
    "BenchRun",
    "Latencies",
    "compare",
    "load_bench",
    "measured_latencies",
    "simulate",
    "summarize",
]


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One measured request: lengths in tokens, times in seconds on the engine's clock."""

    req_id: str
    prompt_len: int
    output_len: int
    arrival: float
    first_token: float
    last_token: float


@dataclass(frozen=True, slots=True)
class BenchRun:
    """A measured vLLM run: its requests (sorted by arrival) and the engine settings that matter."""

    path: str
    model: str
    requests: tuple[BenchRequest, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    tp: int
    dp: int
    expert_parallel: bool
    link: LinkSpec | None
    hardware: str | None = None  # the cluster config's ``hardware`` of the first instance, if any

    @property
    def ep(self) -> int:
        """Expert-parallel degree: vLLM spreads experts over all DP × TP ranks when EP is on."""
        return self.dp * self.tp if self.expert_parallel else 1


def _load_json(path: Path) -> Any:
    if not path.is_file():
        raise UserError(f"bench file missing: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: not JSON ({exc})") from exc


def load_bench(bench_dir: str | Path) -> BenchRun:
    """Read a bench folder; UserError names a missing file or a bad line."""
    root = Path(bench_dir)
    meta = _load_json(root / "vllm" / "meta.json")
    kw = meta.get("engine_kwargs", {})
    link = None
    hardware = None
    if (root / "config.json").is_file():
        cfg = _load_json(root / "config.json")
        if "link_bw" in cfg:  # GB/s and ns in LLMServingSim's cluster config
            link = LinkSpec(float(cfg["link_bw"]) * 1e9, float(cfg.get("link_latency", 0)) * 1e-9)
        hardware = _cluster_hardware(cfg)
    path = root / "vllm" / "requests.jsonl"
    if not path.is_file():
        raise UserError(f"bench file missing: {path}")
    reqs = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                reqs.append(
                    BenchRequest(
                        req_id=str(r.get("request_id", n)),
                        prompt_len=int(r["input_toks"]),
                        output_len=int(r["output_toks"]),
                        arrival=float(r["queued_ts"]),
                        first_token=float(r["first_token_ts"]),
                        last_token=float(r["last_token_ts"]),
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise UserError(f"{path}:{n}: bad request line ({exc})") from exc
    if not reqs:
        raise UserError(f"{path}: no requests")
    reqs.sort(key=lambda q: q.arrival)
    return BenchRun(
        path=str(root),
        model=str(meta.get("model", kw.get("model", "?"))),
        requests=tuple(reqs),
        max_num_seqs=int(kw.get("max_num_seqs") or 256),
        max_num_batched_tokens=int(kw.get("max_num_batched_tokens") or 8192),
        tp=int(kw.get("tensor_parallel_size") or 1),
        dp=int(kw.get("data_parallel_size") or 1),
        expert_parallel=bool(kw.get("enable_expert_parallel", False)),
        link=link,
        hardware=hardware,
    )


def _cluster_hardware(cfg: Any) -> str | None:
    """``hardware`` of the first instance of an LLMServingSim cluster config (``nodes[].instances[]``)."""
    try:
        return str(cfg["nodes"][0]["instances"][0]["hardware"])
    except (KeyError, IndexError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class Latencies:
    """Per-request latencies in milliseconds (TPOT only for outputs of 2+ tokens)."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]
    e2e_ms: tuple[float, ...]


def _latencies(rows: Sequence[tuple[float, float, float, int]]) -> Latencies:
    """rows: (arrival, first token, last token, output tokens), seconds."""
    ttft, tpot, e2e = [], [], []
    for arrival, first, last, out in rows:
        ttft.append((first - arrival) * 1e3)
        e2e.append((last - arrival) * 1e3)
        if out > 1:
            tpot.append((last - first) / (out - 1) * 1e3)
    return Latencies(tuple(ttft), tuple(tpot), tuple(e2e))


def measured_latencies(run: BenchRun) -> Latencies:
    return _latencies([(r.arrival, r.first_token, r.last_token, r.output_len) for r in run.requests])


class _Recorder:
    """Stand-in cost model inside each lockstep engine: records the step's batch and reports a unit
    duration; the real duration is decided for the whole DP group (see :func:`simulate`)."""

    name = "lockstep-recorder"

    def __init__(self) -> None:
        self.batch: tuple[tuple[tuple[int, int], ...], int, int] = ((), 0, 0)

    def step_time(self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int) -> float:
        self.batch = (tuple(prefill), num_decode, decode_kv_tokens)
        return 1.0


def simulate(
    run: BenchRun,
    cost: ProfileCostModel,
    *,
    num_kv_blocks: int,
    block_size: int = 16,
    policy: str = "vllm",
    link: LinkSpec | None = None,
) -> Latencies:
    """Replay ``run`` on ``run.dp`` lockstep engines (module docstring); latencies of every request.

    Each engine keeps its own step clock (one unit per step, from :class:`_Recorder`); the group clock
    (seconds, the run's) advances by ``cost.dp_group_step_time`` of the batches the engines scheduled.
    ``num_kv_blocks`` is per engine. Raises UserError if a request never finishes (too long for the
    KV pool).
    """
    dp = run.dp
    cfg = EngineConfig(
        max_num_seqs=run.max_num_seqs,
        max_num_batched_tokens=run.max_num_batched_tokens,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        enable_prefix_caching=True,
        report_tokens=True,  # one cost call per step: no decode stretches, which lockstep cannot share
    )
    recorders = [_Recorder() for _ in range(dp)]
    engines = [EngineModel(cfg, rec) for rec in recorders]
    clocks = [0.0] * dp  # each engine's own clock at its last step boundary
    # No prefix information in these runs: an empty approximate KV view, nothing recorded in it.
    kv = KVView(dp, block_size, capacity_blocks=1, ttl_s=None, recovery_s=0.0)
    router = RoutingCore(build_policy(policy, None), kv)
    reqs = run.requests
    t0 = reqs[0].arrival
    arrivals = [r.arrival - t0 for r in reqs]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    buffered: list[list[EngineRequest]] = [[] for _ in range(dp)]
    queued_tokens = [0] * dp

    def route(i: int) -> None:
        r = reqs[i]
        views = []
        for k, eng in enumerate(engines):
            st = eng.stats()
            views.append(
                InstanceView(
                    index=k,
                    running=st.running,
                    waiting=st.waiting + len(buffered[k]),
                    queued_prefill_tokens=st.queued_prefill_tokens + queued_tokens[k],
                    kv_usage=st.kv_usage,
                    kv_capacity_blocks=num_kv_blocks,
                )
            )
        chosen = router.route(RouteRequest((), r.prompt_len, r.output_len), views, arrivals[i]).instance
        assert chosen is not None  # no quota here
        nblocks = r.prompt_len // block_size
        hashes = tuple((i + 1) << 24 | j for j in range(nblocks))  # unique per request: no sharing
        buffered[chosen].append(
            EngineRequest(req_id=i, prompt_len=r.prompt_len, output_len=r.output_len, block_hashes=hashes)
        )
        queued_tokens[chosen] += r.prompt_len

    def deliver_and_advance(now: float) -> None:
        """Group step boundary at ``now`` (seconds): queue buffered requests, finish engine steps."""
        for k, eng in enumerate(engines):
            end = eng.next_time()
            at = end if end is not None else clocks[k]
            for req in buffered[k]:
                eng.add_request(req, at)
            buffered[k].clear()
            queued_tokens[k] = 0
            if end is not None:
                clocks[k] = end
                for out in eng.advance(end):
                    if out.kind is OutputKind.FIRST_TOKEN:
                        first[int(out.req_id)] = now
                    elif out.kind is OutputKind.FINISHED:
                        first.setdefault(int(out.req_id), now)
                        done[int(out.req_id)] = now
                    elif out.kind is OutputKind.ABORTED:
                        raise UserError(
                            f"request {reqs[int(out.req_id)].req_id} cannot fit in "
                            f"{num_kv_blocks} KV blocks of {block_size} tokens"
                        )

    nxt = 0
    now = 0.0
    n = len(reqs)
    while nxt < n or any(e.next_time() is not None for e in engines):
        if all(e.next_time() is None for e in engines):  # idle group: jump to the next arrival
            now = max(now, arrivals[nxt])
            while nxt < n and arrivals[nxt] <= now:
                route(nxt)
                nxt += 1
            deliver_and_advance(now)
            continue
        batches = [
            rec.batch if eng.next_time() is not None else ((), 0, 0)
            for rec, eng in zip(recorders, engines, strict=True)
        ]
        end = now + cost.dp_group_step_time(batches, ep=run.ep, link=link or run.link)
        while nxt < n and arrivals[nxt] <= end:
            route(nxt)
            nxt += 1
        now = end
        deliver_and_advance(now)
    if len(done) != n:
        raise UserError(f"{n - len(done)} request(s) never finished")
    return _latencies([(arrivals[i], first[i], done[i], reqs[i].output_len) for i in range(n)])


def summarize(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 (linear interpolation between order statistics); NaN when empty."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan}
    xs = sorted(values)

    def pct(p: float) -> float:
        pos = (len(xs) - 1) * p / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (pos - lo) * (xs[hi] - xs[lo])

    return {"mean": sum(xs) / len(xs), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def compare(measured: Latencies, simulated: Latencies) -> dict[str, Any]:
    """``{"measured": {metric: summary}, "simulated": {...}, "error_pct": {metric: {stat: %}}}``."""
    out: dict[str, Any] = {"measured": {}, "simulated": {}, "error_pct": {}}
    for metric in ("ttft_ms", "tpot_ms", "e2e_ms"):
        m = summarize(getattr(measured, metric))
        s = summarize(getattr(simulated, metric))
        out["measured"][metric] = m
        out["simulated"][metric] = s
        out["error_pct"][metric] = {k: (s[k] - m[k]) / m[k] * 100 if m[k] else math.nan for k in m}
    return out
