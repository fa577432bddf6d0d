"""Why one policy beats another, from decisions: per-decision records of simulated runs.

``python -m benchmarks.policy_findings --trace FILE --rate 2.83 --duration 120 --out DIR`` runs the
cluster simulator once per policy of ``--policies`` (default ``lmetric,dynamo-lmetric``), each with
the others as shadow policies, and records every decision: the candidates' terms as the router saw
them (cached and queued prefill tokens, running, waiting, KV blocks held, KV usage), the real
choice and each shadow's, then what the request cost afterwards (TTFT, TPOT) and what happened on
the chosen instance while it ran (preemptions). It writes ``DIR/<name>.json`` with the figures that
decide each hypothesis:

- **(a) attention**: the engine's step time for one decode batch at a growing mean context
  (the cost model itself), and, over the decisions, how well each score orders the realized TTFT
  (Spearman rank correlation of the chosen instance's score with the request's TTFT);
- **(b) KV pressure**: at the decisions where the policies disagree, the KV usage of each policy's
  pick, and the preemptions on the chosen instance during the request's life;
- **(c) queued prefill**: the router's queued-prefill view against the engine's at decision time;
- **(d) ties**: the share of decisions whose best score is shared by several instances;
- **(e) the TPOT tail** (``tpot_anatomy``): every instance's engine steps are logged, and each
  request's decode time (first token to last) is split into the steps that carried prefill chunks
  (other requests' prompts) and pure-decode steps, with the decode batch and context it shared and
  the requests routed onto its instance meanwhile, averaged over the requests at and above the TPOT
  p99; ``batch_spread`` and ``above_least``: how unevenly the policy spread the decode batch and what
  the prompt's cache share was where it picked a much busier instance than the least loaded.

Deterministic (the simulator is); one process, so run it with ``nice``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvroute.engine.cost import get_profile
from kvroute.routing.core import Decision, RouteRequest, build_policy
from kvroute.sim.cluster import ClusterSim, SimConfig
from kvroute.views import InstanceView
from kvroute.workloads import open_workload
from kvroute.workloads.request import Request


class RecordingSim(ClusterSim):
    """:class:`ClusterSim` that keeps one record per decision and per request outcome, and per
    instance a log of its engine steps (:meth:`_add_instance`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.steps: list[list[tuple[float, float, int, int, int]]] = []
        super().__init__(*args, **kwargs)
        self.records: dict[Any, dict[str, Any]] = {}

    def _add_instance(self, eng: Any, now: float, tags: frozenset[str] = frozenset()) -> None:
        """Also log every step the engine starts: (start s, duration s of its first step, prefill
        tokens, decoding sequences, their context tokens). A step with prefill is always a single
        step (only pure-decode steps are planned as stretches), so the prefill steps are exact."""
        super()._add_instance(eng, now, tags)
        log: list[tuple[float, float, int, int, int]] = []
        self.steps.append(log)
        start = eng._start_step

        def logged(t: float) -> None:
            start(t)
            st = eng._step
            if st is None:
                return
            pre = nd = kv = 0
            for seq, n in st.work:
                if n == 1 and seq.out and seq.known - seq.computed == 1:
                    nd += 1
                    kv += seq.computed
                else:
                    pre += n
            if st.cohort and eng._cohort is not None:
                nd += eng._cohort.n
                kv += eng._cohort.kv
            log.append((t, st.segs[0][1], pre, nd, kv))

        eng._start_step = logged

    def _carry_out(
        self,
        req: Request,
        rr: RouteRequest,
        arrived: float,
        views: Sequence[InstanceView],
        decision: Decision,
    ) -> None:
        picks: tuple[Any, ...] = ()
        before = {}
        if decision.instance is not None:
            st = self._insts[decision.instance].engine.stats()
            before = {"true_queued": st.queued_prefill_tokens, "preempt0": st.preemptions}
        shadows = self.shadows
        if shadows is not None and decision.instance is not None:
            # what the shadows would choose from the same views, before the request changes them
            # (the base class does the same, so it is told there are none for this request)
            picks = shadows.observe(rr, views, self.loop.now, decision)
            self.shadows = None
            try:
                super()._carry_out(req, rr, arrived, views, decision)
            finally:
                self.shadows = shadows
        else:
            super()._carry_out(req, rr, arrived, views, decision)
        if decision.instance is None:
            return
        ch = decision.instance
        self.records[req.req_id] = {
            **before,
            "t": self.loop.now,
            "arrival": arrived,
            "prompt": rr.prompt_tokens,
            "output": req.output_len,
            "choice": ch,
            "scores": decision.scores,
            "views": [
                (
                    v.running,
                    v.waiting,
                    v.queued_prefill_tokens,
                    v.decode_blocks,
                    v.kv_usage,
                    v.kv_capacity_blocks,
                )
                for v in views
            ],
            "cached": decision.cached_tokens,
            "shadow": {p.name: p.instance for p in picks},
        }

    def _outputs(self, i: int, inst: Any, outs: list) -> None:
        from kvroute.engine.types import OutputKind

        for o in outs:
            rec = self.records.get(o.req_id)
            if rec is None:
                continue
            if o.kind is OutputKind.FIRST_TOKEN:
                rec["first"] = o.time
                rec["hit"] = o.num_cached_tokens
            elif o.kind is OutputKind.FINISHED:
                rec["done"] = o.time
                rec["preempt1"] = inst.engine.stats().preemptions
        super()._outputs(i, inst, outs)


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties); NaN for fewer than 3 points."""
    if len(xs) < 3:
        return math.nan

    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2.0
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else math.nan


def attention_table(profile: Any) -> list[dict[str, float]]:
    """The cost model's decode step (ms) for ``n`` sequences at mean context ``c`` tokens: what a
    decoding sequence costs the step as its context grows (hypothesis a)."""
    cost = profile.cost
    rows = []
    for n in (1, 8, 32):
        for c in (100, 1_000, 10_000, 100_000):
            rows.append({"decodes": n, "mean_context": c, "step_ms": 1e3 * cost.step_time((), n, n * c)})
    for c in (0, 10_000, 100_000):
        rows.append(
            {"prefill_chunk": 4096, "context_before": c, "step_ms": 1e3 * cost.step_time(((4096, c),), 0, 0)}
        )
    return rows


def _terms(rec: dict[str, Any], i: int, block: int) -> dict[str, float]:
    running, waiting, queued, blocks, usage, cap = rec["views"][i]
    p = rec["prompt"] - rec["cached"][i] + queued
    return {
        "p_token": p,
        "bs": running + waiting,
        "decode_blocks": blocks,
        "kv_usage": usage,
        "kv_demand": (blocks + queued / block) / cap if cap else 0.0,
        "lmetric": p * (running + waiting + 1),
        "dynamo_lmetric": (p / block) * (blocks + -(-rec["prompt"] // block) + 1),
    }


def decode_window(
    sim: RecordingSim, rec: dict[str, Any], routed: dict[int, list[tuple[float, int]]]
) -> dict[str, float]:
    """What a request's decode shared its steps with, from its instance's step log: the steps that
    started while it decoded (first token to last), split into those with prefill (the chunks of
    other requests) and pure-decode ones; times in ms per output token after the first, so that
    ``tpot_ms = prefill_ms + decode_ms`` (the request is in every step of its window)."""
    log = sim.steps[rec["choice"]]
    first, done, n = rec["first"], rec["done"], rec["output"] - 1
    lo = bisect.bisect_left(log, (first,))
    hi = bisect.bisect_left(log, (done,))
    pre = [s for s in log[lo:hi] if s[2]]
    pre_t = sum(s[1] for s in pre)
    times = routed[rec["choice"]]
    arrivals = times[bisect.bisect_left(times, (first,)) : bisect.bisect_left(times, (done,))]
    nd = [s[3] for s in log[lo:hi]]
    return {
        "tpot_ms": 1e3 * (done - first) / n,
        "prefill_ms": 1e3 * pre_t / n,
        "decode_ms": 1e3 * (done - first - pre_t) / n,
        "output": rec["output"],
        "prompt": rec["prompt"],
        "prefill_steps": len(pre),
        "prefill_tokens": sum(s[2] for s in pre),
        "routed_in": len(arrivals),
        "routed_in_uncached": sum(a[1] for a in arrivals),
        "batch_mean": statistics.fmean(nd) if nd else 0.0,
        "context_k_mean": statistics.fmean([s[4] for s in log[lo:hi]]) / 1e3 if nd else 0.0,
    }


def tpot_anatomy(sim: RecordingSim, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """The TPOT tail taken apart: per request :func:`decode_window`; the mean of each field over the
    requests at or above the TPOT p99 (rank ⌊0.99·(n − 1)⌋ on), over the top 5 %, and over all."""
    routed: dict[int, list[tuple[float, int]]] = {i: [] for i in range(len(sim.steps))}
    for r in recs:
        routed[r["choice"]].append((r["t"], r["prompt"] - r.get("hit", 0)))
    for v in routed.values():
        v.sort()
    rows = sorted(
        (decode_window(sim, r, routed) for r in recs if r["output"] > 1), key=lambda x: x["tpot_ms"]
    )
    if not rows:
        return {}

    def mean(part: list[dict[str, float]]) -> dict[str, float]:
        return {k: round(statistics.fmean([x[k] for x in part]), 3) for k in part[0]}

    k99 = int(0.99 * (len(rows) - 1))
    return {
        "requests": len(rows),
        "p99_and_above": mean(rows[k99:]),
        "top_5pct": mean(rows[int(0.95 * (len(rows) - 1)) :]),
        "all": mean(rows),
        "p99_rows": rows[k99:],
    }


def above_least(recs: list[dict[str, Any]]) -> dict[str, float]:
    """The decisions whose pick runs at least 8 sequences more than the least-loaded instance (the one
    with the fewest running, the most cached on a tie): their share, and at the pick and at that
    instance the mean running sequences, cached share of the prompt and uncached tokens."""
    rows = []
    for r in recs:
        run = [v[0] for v in r["views"]]
        ch, prompt, cached = r["choice"], r["prompt"], r["cached"]
        lo = min(range(len(run)), key=lambda i: (run[i], -cached[i]))
        if run[ch] - run[lo] >= 8:
            rows.append(
                (
                    run[ch],
                    run[lo],
                    cached[ch] / prompt,
                    cached[lo] / prompt,
                    prompt - cached[ch],
                    prompt - cached[lo],
                )
            )
    if not rows:
        return {"share": 0.0}
    keys = (
        "running_pick",
        "running_least",
        "cached_share_pick",
        "cached_share_least",
        "uncached_pick",
        "uncached_least",
    )
    return {
        "share": len(rows) / len(recs),
        **{k: statistics.fmean(x[j] for x in rows) for j, k in enumerate(keys)},
    }


def analyse(sim: RecordingSim, policy: str, block: int) -> dict[str, Any]:
    recs = [r for r in sim.records.values() if "done" in r]
    ttft = [r["first"] - r["arrival"] for r in recs]
    tpot = [(r["done"] - r["first"]) / (r["output"] - 1) for r in recs if r["output"] > 1]
    chosen = [_terms(r, r["choice"], block) for r in recs]
    out: dict[str, Any] = {
        "policy": policy,
        "requests": len(recs),
        "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
        "ttft_ms_p99": 1e3 * sorted(ttft)[int(0.99 * (len(ttft) - 1))],
        "tpot_ms_p99": 1e3 * sorted(tpot)[int(0.99 * (len(tpot) - 1))] if tpot else math.nan,
        "preemptions": sum(i.engine.stats().preemptions for i in sim._insts),
        "kv_hit_rate": sum(r.get("hit", 0) for r in recs) / max(1, sum(r["prompt"] for r in recs)),
        # (a) which score orders the realized TTFT of the chosen instance best
        "spearman_ttft": {
            k: spearman([c[k] for c in chosen], ttft)
            for k in ("lmetric", "dynamo_lmetric", "p_token", "bs", "decode_blocks")
        },
        # (c) the router's queued prefill view vs the engine's own count at decision time (tokens)
        "queued_view_minus_true_mean": statistics.fmean(
            [r["views"][r["choice"]][2] - r["true_queued"] for r in recs]
        ),
    }
    # (d) ties of the real policy's best score
    ties = idle_ties = 0
    for r in recs:
        s = r["scores"]
        best = min(s)
        tied = [i for i, x in enumerate(s) if x == best]
        if len(tied) > 1:
            ties += 1
            # the tied instances are interchangeable when none runs, waits or has prefill queued
            idle_ties += all(r["views"][i][0] + r["views"][i][1] + r["views"][i][2] == 0 for i in tied)
    out["tied_best_share"] = ties / max(1, len(recs))
    out["tied_all_idle_share"] = idle_ties / max(1, ties)
    # (b) where a shadow disagrees: the terms of both picks and what the real pick cost
    dis: dict[str, Any] = {}
    for name in recs[0]["shadow"] if recs else ():
        d = [r for r in recs if r["shadow"][name] != r["choice"]]
        a = [r for r in recs if r["shadow"][name] == r["choice"]]
        if not d:
            continue
        real_t = [_terms(r, r["choice"], block) for r in d]
        sh_t = [_terms(r, r["shadow"][name], block) for r in d]

        def mean(rows: list[dict[str, float]], k: str) -> float:
            return statistics.fmean([x[k] for x in rows])

        dis[name] = {
            "disagreements": len(d),
            "share": len(d) / len(recs),
            "ttft_ms_mean_disagree": 1e3 * statistics.fmean([r["first"] - r["arrival"] for r in d]),
            "ttft_ms_mean_agree": 1e3 * statistics.fmean([r["first"] - r["arrival"] for r in a])
            if a
            else math.nan,
            "tpot_ms_mean_disagree": 1e3
            * statistics.fmean(
                [(r["done"] - r["first"]) / (r["output"] - 1) for r in d if r["output"] > 1] or [0]
            ),
            "preemptions_during_disagree": sum(r["preempt1"] - r["preempt0"] for r in d) / len(d),
            "preemptions_during_agree": sum(r["preempt1"] - r["preempt0"] for r in a) / max(1, len(a)),
            "hit_tokens_disagree": statistics.fmean([r.get("hit", 0) for r in d]),
            "prompt_tokens_disagree": statistics.fmean([r["prompt"] for r in d]),
            "real_pick": {
                k: mean(real_t, k) for k in ("p_token", "bs", "decode_blocks", "kv_usage", "kv_demand")
            },
            "shadow_pick": {
                k: mean(sh_t, k) for k in ("p_token", "bs", "decode_blocks", "kv_usage", "kv_demand")
            },
            "real_pick_kv_demand_over_0.9": sum(x["kv_demand"] > 0.9 for x in real_t) / len(d),
            "shadow_pick_kv_demand_over_0.9": sum(x["kv_demand"] > 0.9 for x in sh_t) / len(d),
        }
    out["disagreements"] = dis
    out["tpot_anatomy"] = tpot_anatomy(sim, recs)
    # how evenly the decode batch is spread, as the router saw it at each decision: the running
    # sequences of the pick minus the fewest anywhere, and the most minus the fewest
    running = [[v[0] for v in r["views"]] for r in recs]
    out["batch_spread"] = {
        "pick_minus_least": statistics.fmean(
            [x[r["choice"]] - min(x) for x, r in zip(running, recs, strict=True)]
        ),
        "most_minus_least": statistics.fmean([max(x) - min(x) for x in running]),
        "hit_share_at_pick": statistics.fmean([r["cached"][r["choice"]] / r["prompt"] for r in recs]),
    }
    out["above_least"] = above_least(recs)
    # the slowest 1 % of requests: where they went and what that instance looked like then
    slow = sorted(recs, key=lambda r: r["first"] - r["arrival"])[-max(1, len(recs) // 100) :]
    out["slowest"] = [
        {
            "ttft_s": round(r["first"] - r["arrival"], 3),
            "routed_at_s": round(r["t"], 3),
            "prompt": r["prompt"],
            "instance": r["choice"],
            "running": r["views"][r["choice"]][0],
            "waiting": r["views"][r["choice"]][1],
            "queued_prefill": r["views"][r["choice"]][2],
            "kv_usage": round(r["views"][r["choice"]][4], 3),
            "kv_demand": round(_terms(r, r["choice"], block)["kv_demand"], 3),
            "preemptions_meanwhile": r["preempt1"] - r["preempt0"],
        }
        for r in slow
    ]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    profile = get_profile(args.profile) if args.profile else get_profile()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    results = []
    for name in policies:
        cfg = SimConfig(
            instances=args.instances,
            kv_capacity_tokens=args.kv_tokens or profile.kv_capacity_tokens,
            seed=args.seed,
        )
        shadows = tuple(p for p in policies if p != name)
        sim = RecordingSim(cfg, build_policy(name, None, random.Random(args.seed)), profile.cost, shadows)
        stream, _ = open_workload(
            args.trace, "auto", args.workload, args.rate, args.duration, args.seed, False
        )
        t0 = time.process_time()
        sim.run(stream)
        block = sim._block_size
        res = analyse(sim, name, block)
        res["cpu_seconds"] = round(time.process_time() - t0, 1)
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "disagreements"}), file=sys.stderr)
    return {
        "command": "python -m benchmarks.policy_findings " + " ".join(sys.argv[1:]),
        "profile": profile.name,
        "kv_capacity_tokens": args.kv_tokens or profile.kv_capacity_tokens,
        "instances": args.instances,
        "workload": args.trace or args.workload,
        "rate_scale": args.rate,
        "duration_s": args.duration,
        "seed": args.seed,
        "attention": attention_table(profile),
        "runs": results,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
    }


def tpot_table(reports: Sequence[dict[str, Any]]) -> str:
    """Markdown: per report (a JSON this script wrote) and policy, the TPOT p99 and its tail taken
    apart (:func:`tpot_anatomy`), the batch spread and the piled-on decisions (:func:`above_least`)."""
    lines = [
        "| run | policy | TPOT p99 (ms) | its tail: prefill + decode steps (ms) | tail's batch / context (k tokens) "
        "| running, most − least | picks ≥ 8 above the least | their cached share: pick / least | KV hit rate |",
        "|---|---|---:|---|---|---:|---:|---|---:|",
    ]
    for rep in reports:
        run = f"{rep['workload']}/{rep['instances']} ×{rep['rate_scale']:.3g} seed {rep['seed']}"
        for r in rep["runs"]:
            t = r["tpot_anatomy"]["p99_and_above"]
            a = r["above_least"]
            shares = f"{a['cached_share_pick']:.2f} / {a['cached_share_least']:.2f}" if a["share"] else "—"
            lines.append(
                f"| {run} | {r['policy']} | {r['tpot_ms_p99']:.1f} | {t['prefill_ms']:.1f} + {t['decode_ms']:.1f} "
                f"| {t['batch_mean']:.1f} / {t['context_k_mean']:.0f} | {r['batch_spread']['most_minus_least']:.1f} "
                f"| {100 * a['share']:.0f} % | {shares} | {r['kv_hit_rate']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace")
    ap.add_argument("--workload")
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--instances", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile")
    ap.add_argument("--kv-tokens", type=int)
    ap.add_argument("--policies", default="lmetric,dynamo-lmetric,lmetric-time")
    ap.add_argument("--out", help="JSON file to write")
    ap.add_argument(
        "--tpot-table", nargs="+", metavar="JSON", help="print the TPOT tables of these JSON files and exit"
    )
    args = ap.parse_args(argv)
    if args.tpot_table:
        try:
            reports = [json.loads(Path(f).read_text()) for f in args.tpot_table]
            print(tpot_table(reports), end="")
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--tpot-table: {exc!r}")
        return 0
    if not args.out:
        ap.error("--out is required to run")
    if (args.trace is None) == (args.workload is None):
        ap.error("give --trace FILE or --workload NAME")
    out = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
