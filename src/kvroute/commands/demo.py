"""`kvroute demo`: the main job — the live router over real HTTP on an embedded default.

For each policy (``lmetric``, then the paper's baselines ``vllm`` and ``llm-d``, and ``round-robin``) it
does what ``kvroute up --instances 4`` does — starts 4 fresh emulated engines (``kvroute engine``
subprocesses, KV events on) and the router in front of them on loopback — replays 60 s of the generated
``multiturn`` workload through the router with the load generator of ``kvroute bench`` (open loop,
every response streamed), stops everything, and finally prints the comparison table with the
simulator's prediction for the same workload beside it.

The regime is chosen where routing matters: ``multiturn``'s prompts are mostly their own conversation's
history, and the rate (×1.4, ≈ 44 requests/s) sits at the cache-blind ``vllm`` balancer's knee on 4
instances, where recomputing history turns into queueing (the simulator: lmetric ≈ 0.24× vllm's mean
TTFT). Answers are short (~32 tokens), so the load on this machine's cores is the requests, not the
streamed tokens: the router, the client and the 4 engines stay well below the 2 cores' capacity
(``make bench ONLY=proxy`` sustains ~400 streamed requests/s), and the table shows each engine's own
TTFT next to the client's so that a busy machine would be visible. Engines run ``--time-scale`` times
faster than real time and arrivals are sped up by the same factor, so the latencies are reported in
*model time* (measured wall time × time scale). Needs nothing outside the package (no ../shared);
about four minutes on 2 cores.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvroute.errors import UserError

HELP = (
    "the main job: 4 emulated engines + the router; lmetric vs vllm, llm-d, round-robin over HTTP; "
    "the peers' variants, +queue and the bound in the simulator"
)

POLICIES = ("lmetric", "vllm", "llm-d", "round-robin")
# simulated only (same workload, seed and cluster): the peers' LMetric variants, lmetric behind the
# router-side queue, and the bound (kvroute.sim.bound) no router beats
SIM_POLICIES = ("aibrix-lmetric", "llm-d-lmetric", "dynamo-lmetric", "vllm-router-smetric")
WORKLOAD = "multiturn"
RATE_SCALE = 1.4


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--instances", type=int, default=4, help="emulated engines (default 4)")
    p.add_argument("--duration", type=float, default=60.0, help="model seconds of arrivals (default 60)")
    p.add_argument(
        "--rate-scale",
        type=float,
        default=RATE_SCALE,
        help=f"multiply the workload's rate (default {RATE_SCALE})",
    )
    p.add_argument("--workload", default=WORKLOAD, help=f"generated workload (default {WORKLOAD})")
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="engines run this much faster (default 1: real time)"
    )
    p.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated (default {','.join(POLICIES)})"
    )
    p.add_argument(
        "--sim-policies",
        default=",".join(SIM_POLICIES),
        help="also in the simulator only, beside lmetric +queue and the bound (default the peers' "
        f"LMetric variants: {','.join(SIM_POLICIES)}; '' for none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def _scaled(summary: dict[str, Any], factor: float) -> dict[str, Any]:
    out = dict(summary)
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        out[key] = {k: v * factor for k, v in summary[key].items()}
    return out


async def _engine_ttft_ms(urls: list[str]) -> float:
    """Mean TTFT the engines themselves measured (``vllm:time_to_first_token_seconds`` over all
    engines), in model milliseconds: the engine-side share of the client's TTFT."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as resp:
                body = await resp.text()
            for fam in text_string_to_metric_families(body):
                if fam.name != "vllm:time_to_first_token_seconds":
                    continue
                for sample in fam.samples:
                    if sample.name.endswith("_sum"):
                        total += sample.value
                    elif sample.name.endswith("_count"):
                        count += sample.value
    return 1000.0 * total / count if count else float("nan")


async def _one(policy: str, args: argparse.Namespace, text: Any) -> dict[str, Any]:
    from kvroute.loadgen import run_bench
    from kvroute.server.app import RouterServer
    from kvroute.server.cluster import EngineCluster
    from kvroute.server.config import RouterConfig
    from kvroute.workloads import make_workload

    cluster = EngineCluster(args.instances, ["--time-scale", str(args.time_scale)], kv_events=True)
    backends = await cluster.start()
    try:
        router = RouterServer(
            RouterConfig(backends=backends, port=0, policy=policy), tokenizer=text.tokenizer
        )
        url = await router.start()
        try:
            print(
                f"  {policy}: router {url}/v1 in front of {args.instances} engines; replaying ...", flush=True
            )
            reqs = make_workload(
                args.workload,
                seed=args.seed,
                rate_scale=args.rate_scale * args.time_scale,
                duration=args.duration / args.time_scale,
            )
            result = await run_bench(url, reqs, text)
            engine_ttft = await _engine_ttft_ms([b.url for b in backends])
        finally:
            await router.stop()
    finally:
        cluster.stop()
    out = _scaled(result.summary(policy, args.instances), args.time_scale)
    out["engine_ttft_ms_mean"] = engine_ttft
    print(
        f"  {policy}: {out['requests']} requests, {out['unfinished']} unfinished, "
        f"{result.wall_seconds:.1f} s wall",
        flush=True,
    )
    return out


def run(args: argparse.Namespace) -> int:
    from kvroute.commands.sim import write_json
    from kvroute.loadgen import BlockText
    from kvroute.metrics import comparison_table
    from kvroute.policies.registry import make_policy
    from kvroute.server.run import run_loop
    from kvroute.sim.runner import RunSpec, run_spec
    from kvroute.tokenizer import load_tokenizer
    from kvroute.workloads import WORKLOADS

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    sim_only = [p.strip() for p in args.sim_policies.split(",") if p.strip()]
    for p in (*policies, *sim_only):
        make_policy(p)
    if args.workload not in WORKLOADS:
        raise UserError(f"unknown workload {args.workload!r}; choose one of {', '.join(WORKLOADS)}")
    if args.instances < 1 or not args.duration > 0 or not args.time_scale > 0 or not args.rate_scale > 0:
        raise UserError("--instances, --duration, --time-scale and --rate-scale must be positive")
    print(
        f"kvroute demo: {args.instances} emulated engines (Qwen3-30B-A3B cost profile, {args.time_scale:g}x real "
        f"time, KV events on) behind the live router; {args.duration:g} model seconds of the generated "
        f"`{args.workload}` workload at ×{args.rate_scale:g} per policy, streamed over HTTP.",
        flush=True,
    )
    text = BlockText(load_tokenizer())
    rows: list[dict[str, Any]] = []

    async def main() -> int:
        for p in policies:
            rows.append(await _one(p, args, text))
        return 0

    run_loop(main)
    print()
    print(
        comparison_table(rows, title="Measured over real HTTP (latencies in model time = wall × time scale)")
    )
    print("\nWhere the client's TTFT goes, and what the simulator predicts for the same workload:\n")
    print(
        "| policy | client TTFT mean (ms) | vs vllm | engine TTFT mean (ms, /metrics) "
        "| simulated TTFT mean (ms) | simulated vs vllm |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    simulated: dict[str, dict[str, Any]] = {}  # policy -> its simulated run (reused below)
    for row in rows:
        sim = run_spec(
            RunSpec(
                policy=row["policy"],
                instances=args.instances,
                workload=args.workload,
                duration=args.duration,
                rate_scale=args.rate_scale,
                seed=args.seed,
            )
        )
        row["simulated_ttft_ms_mean"] = sim["ttft_ms"]["mean"]
        simulated[row["policy"]] = sim
    base = next((r for r in rows if r["policy"] == "vllm"), None)
    for row in rows:
        rel = sim_rel = "-"
        if base is not None:
            rel = f"{row['ttft_ms']['mean'] / base['ttft_ms']['mean']:.2f}×"
            sim_rel = f"{row['simulated_ttft_ms_mean'] / base['simulated_ttft_ms_mean']:.2f}×"
            row["ttft_mean_vs_vllm"] = row["ttft_ms"]["mean"] / base["ttft_ms"]["mean"]
        print(
            f"| {row['policy']} | {row['ttft_ms']['mean']:.1f} | {rel} | {row['engine_ttft_ms_mean']:.1f} | "
            f"{row['simulated_ttft_ms_mean']:.1f} | {sim_rel} |"
        )
    print(
        "\nThe engine column is the engines' own queueing + prefill; the rest of the client's TTFT is HTTP,\n"
        "tokenization and streaming on this machine's shared cores (× the time scale), not the policy."
    )
    print(
        f"\nSame comparison in the simulator: kvroute sim --workload {args.workload} --instances "
        f"{args.instances} --rate-scale {args.rate_scale:g} --duration {args.duration:g} --policy lmetric"
        "\nRun it yourself: kvroute up --instances 4 & kvroute bench --url http://127.0.0.1:8080 "
        f"--workload {args.workload}"
    )
    _simulated_only(args, sim_only, simulated)
    if args.json:
        write_json(args.json, rows)
    return 0


def _simulated_only(
    args: argparse.Namespace, policies: list[str], simulated: dict[str, dict[str, Any]]
) -> None:
    """The peers' variants, lmetric +queue and the bound on the demo's workload, in the simulator;
    ``simulated``: runs already made (policy without the queue -> result), not run again."""
    from kvroute.routing.queue import QueueConfig
    from kvroute.sim.bound import spec_bound, spec_engine
    from kvroute.sim.runner import RunSpec, run_spec

    def spec(policy: str, queue: QueueConfig | None = None) -> RunSpec:
        return RunSpec(
            policy=policy,
            instances=args.instances,
            workload=args.workload,
            duration=args.duration,
            rate_scale=args.rate_scale,
            seed=args.seed,
            router_queue=queue,
        )

    arms = [("lmetric", spec("lmetric")), ("lmetric +queue", spec("lmetric", QueueConfig()))]
    arms += [(p, spec(p)) for p in policies]
    known = {name: simulated[name] for name, _ in arms if name in simulated}
    print(
        "\nIn the simulator only (same workload, seed and cluster): lmetric with the router-side queue, "
        "the peers' LMetric variants, and the bound no router beats:\n"
    )
    print("| policy | simulated TTFT mean (ms) | p99 (ms) | KV hit rate | vs lmetric |")
    print("|---|---:|---:|---:|---:|")
    results = [(name, known[name] if name in known else run_spec(s)) for name, s in arms]
    base = float(results[0][1]["ttft_ms"]["mean"])  # lmetric's
    for name, r in results:
        print(
            f"| {name} | {r['ttft_ms']['mean']:.1f} | {r['ttft_ms']['p99']:.1f} | {r['kv_hit_rate']:.3f} | "
            f"{r['ttft_ms']['mean'] / base:.2f}× |"
        )
    b = spec_bound(spec("lmetric"), spec_engine(spec("lmetric")))
    print(
        f"| bound (pooled KV cache, pooled SRPT; docs/results/bound.md) | ≥ {b.ttft_mean_bound_ms:.1f} | "
        f"≥ {b.ttft_floor_p99_ms:.1f} | ≤ {b.kv_hit_rate_ceiling:.3f} | {b.ttft_mean_bound_ms / base:.2f}× |"
    )
