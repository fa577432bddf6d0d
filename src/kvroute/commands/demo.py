"""`kvroute demo`: the main job — kvroute's default policy against its rivals, live over real HTTP.

For each arm (the default, :data:`~kvroute.sim.compare.DEFAULT_ARM`: the default policy behind the
router-side queue; then ``lmetric`` when the default is another, ``llm-d``, ``dynamo-lmetric`` and the
cache-blind balancer ``vllm``, each as it ships: without kvroute's queue) it does what
``kvroute up --instances 4`` does — starts 4 fresh emulated engines (``kvroute engine`` subprocesses,
KV events on) and the router in front of them on loopback (an arm named with `` +queue`` behind the
router-side queue, told the engines' limits, since the job started them) — replays 60 s of the generated
``multiturn`` workload through the router with the load generator of ``kvroute bench`` (open loop,
every response streamed) under a progress bar, and stops everything. It then prints one table: each
policy's measured TTFT, the engines' own share of it, the simulator's prediction, whether the default
leads, ties or trails that policy, and the bound (:mod:`kvroute.sim.bound`) no router beats; then a
simulator-only table (the first arm with the router-side queue toggled, the peers' other LMetric
variants).

The regime is chosen where routing matters: ``multiturn``'s prompts are mostly their own
conversation's history, and the rate (×1.4, ≈ 44 requests/s) sits at the cache-blind balancer's knee
on 4 instances, where recomputing history turns into queueing. Answers are short (~32 tokens), so the
load on the machine's cores is the requests, not the streamed tokens; the engines' own TTFT (from
their ``/metrics``) beside the client's shows when a busy machine adds to it. Engines run
``--time-scale`` times faster than real time and arrivals are sped up by the same factor; latencies
are in *model time* (measured wall time × time scale: with the default 1, plain wall time). Needs
nothing outside the package; about five minutes on 2 cores.

The router and the load generator share this process, arm after arm, so every arm starts level
(:func:`~kvroute.commands.demo_meter.level`: every prompt's text made before the first arm, a full
collection and a freeze before each), and each arm's line says what it cost this process: CPU per
request, the router's own routing time per request (decide alone: the match and the policy, where a
policy's price shows) and its garbage-collector pauses. On a busy machine a policy that costs the
router more CPU per decision pays for it in the client's TTFT, not in the engines'.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from typing import Any

from kvroute.commands.up import GATEWAYS
from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY, PEER_LMETRICS
from kvroute.sim.compare import DEFAULT_ARM, ROUTER_QUEUE, has_queue, split_arm

HELP = (
    "the main job: 4 emulated engines + the router on this machine; kvroute's default policy against "
    "lmetric, llm-d, dynamo-lmetric and a cache-blind balancer over HTTP, beside the bound"
)

WORKLOAD = "multiturn"
RATE_SCALE = 1.4
RIVALS = ("lmetric", "llm-d", "dynamo-lmetric", "vllm")
"""The live rivals of the default, in the table's order (the default itself is left out of them)."""


def default_policies() -> tuple[str, ...]:
    """The default's arm first (:data:`~kvroute.sim.compare.DEFAULT_ARM`), then each rival that is not
    the default policy."""
    return (DEFAULT_ARM, *(p for p in RIVALS if p != DEFAULT_POLICY))


def add_arguments(p: argparse.ArgumentParser) -> None:
    policies = ",".join(default_policies())
    sim_only = ",".join(p for p in PEER_LMETRICS if p not in default_policies())
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
        "--policies",
        default=policies,
        help="comma-separated arms: a policy, or a policy behind the router-side queue ('NAME +queue'); "
        f"the first is the one compared with the others (default {policies})",
    )
    p.add_argument(
        "--sim-policies",
        default=sim_only,
        help="also in the simulator only, beside the first arm with the router-side queue toggled and "
        f"the bound (default the peers' other LMetric variants: {sim_only}; '' for none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gateway",
        choices=GATEWAYS,
        default="none",
        help="envoy: every run goes through a real Envoy with kvroute as its endpoint picker (the "
        "gateway extra), as `kvroute up --gateway envoy`; none: kvroute's own proxy (default)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
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


def _standard_error_ms(ttft_s: Any, factor: float) -> float:
    """Standard error of the mean TTFT (model ms) from the per-request TTFTs (wall seconds)."""
    n = len(ttft_s)
    return 1000.0 * factor * statistics.stdev(ttft_s) / math.sqrt(n) if n > 1 else math.inf


async def _routing_ms(url: str) -> tuple[float, float]:
    """The router's own routing time per request, wall ms (not model time): (parse + prepare + decide,
    decide alone: the match and the policy), from its ``/metrics`` (``kvroute_routing_seconds``,
    ``kvroute_routing_stage_seconds{stage="plan"}``, ``kvroute_routed``); NaN when it routed nothing."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as resp:
        body = await resp.text()
    total = plan = routed = 0.0
    for fam in text_string_to_metric_families(body):
        for sample in fam.samples:
            if sample.name == "kvroute_routing_seconds_total":
                total = sample.value
            elif (
                sample.name == "kvroute_routing_stage_seconds_total" and sample.labels.get("stage") == "plan"
            ):
                plan = sample.value
            elif sample.name == "kvroute_routed_total":
                routed = sample.value
    if not routed:
        return math.nan, math.nan
    return 1000.0 * total / routed, 1000.0 * plan / routed


def _requests(args: argparse.Namespace) -> list[Any]:
    """The workload every arm replays (arrivals in wall seconds: sped up by ``--time-scale``)."""
    from kvroute.workloads import make_workload

    return list(
        make_workload(
            args.workload,
            seed=args.seed,
            rate_scale=args.rate_scale * args.time_scale,
            duration=args.duration / args.time_scale,
        )
    )


async def _one(
    arm: str,
    label: str,
    args: argparse.Namespace,
    text: Any,
    reqs: list[Any],
    bar: Any,
    shadow: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Start the engines and the router with ``arm`` (:func:`router_config`), replay ``reqs``, stop
    everything; the row (model ms; what the arm cost this process in :mod:`~kvroute.commands.demo_meter`'s terms, with the
    router's own routing time in wall ms). ``bar``: a rich ``Progress`` (or None), one task added for
    this arm. ``shadow``: shadow policies the router also computes for every request (its own
    proxy only; ``benchmarks/study_demo_arms.py`` prices a policy's scoring with them)."""
    from kvroute.commands.demo_meter import ArmMeter
    from kvroute.loadgen import run_bench
    from kvroute.server.app import RouterServer
    from kvroute.server.cluster import EngineCluster

    load_before = os.getloadavg()  # the machine's drift between arms shows in the client's TTFT
    span = args.duration / args.time_scale  # wall seconds of arrivals
    task = bar.add_task(arm, total=span, start=False, unit="s") if bar is not None else None

    def say(line: str) -> None:
        if bar is not None:
            bar.console.print(line, soft_wrap=True, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def progress(sent: int, _finished: int) -> None:
        if bar is not None:
            bar.update(task, completed=min(reqs[sent - 1].arrival, span))

    cluster = EngineCluster(args.instances, ["--time-scale", str(args.time_scale)], kv_events=True)
    backends = await cluster.start()
    try:
        if args.gateway == "envoy":  # Envoy on a free port in front of the engines, kvroute its picker
            from kvroute.server.cluster import free_port
            from kvroute.server.extproc.gateway import Gateway

            gateway = Gateway(router_config(arm, backends, port=free_port()))
            router: Any = gateway.picker
            try:
                await gateway.start()
            except BaseException:
                gateway.stop()
                await router.stop()
                raise
            url, via = gateway.url, f"Envoy {gateway.url} with kvroute epp as its picker"
        else:
            gateway = None
            router = RouterServer(
                router_config(arm, backends, port=0, shadow=shadow), tokenizer=text.tokenizer
            )
            url = await router.start()
            via = f"router {url}/v1"
        try:
            if bar is not None:
                bar.start_task(task)
            with ArmMeter(text) as meter:
                result = await run_bench(url, reqs, text, progress=progress)
            engine_ttft = await _engine_ttft_ms([b.url for b in backends])
            routing = await _routing_ms(url) if gateway is None else (math.nan, math.nan)
        finally:
            if gateway is not None:
                gateway.stop()
            await router.stop()
    finally:
        cluster.stop()
    if bar is not None:
        bar.update(task, completed=span)
        bar.stop_task(task)
    out = _scaled(result.summary(arm, args.instances), args.time_scale)
    out["label"] = label
    out["engine_ttft_ms_mean"] = engine_ttft
    out["ttft_se_ms"] = _standard_error_ms(result.recorder.ttft, args.time_scale)
    cost = meter.cost
    assert cost is not None
    n = max(result.requests, 1)
    out["process_cpu_ms_per_request"] = 1000.0 * cost.cpu_s / n
    out["routing_ms_per_request"], out["decide_ms_per_request"] = routing
    out["gc_passes"], out["gc_full"], out["gc_pause_ms"] = (
        cost.gc_passes,
        cost.gc_full,
        1000.0 * cost.gc_pause_s,
    )
    out["text_blocks_made"] = cost.text_blocks
    out["loadavg_before"] = list(load_before)
    routed = (
        f", routing {out['routing_ms_per_request']:.2f} (decide {out['decide_ms_per_request']:.2f})"
        if math.isfinite(out["routing_ms_per_request"])
        else ""
    )
    say(
        f"  {arm}: {out['requests']} requests, {out['unfinished']} unfinished, "
        f"{result.wall_seconds:.1f} s wall ({via} before {args.instances} engines); this process "
        f"(router and client): {out['process_cpu_ms_per_request']:.2f} ms CPU{routed} ms per request, "
        f"{cost.gc_full} full GC passes ({out['gc_pause_ms']:.0f} ms in the collector); load average "
        f"{load_before[0]:.2f} before"
    )
    return out


def router_config(arm: str, backends: Any, **more: Any) -> Any:
    """The router's config for ``arm`` in front of the job's emulated engines: the arm's policy; an arm
    named with `` +queue`` behind the router-side queue (its defaults) with the engines' limits (the
    job starts them with the engine model's defaults, so it knows them), any other without it (a
    rival as it ships). ``more``: other :class:`~kvroute.server.config.RouterConfig` fields."""
    from kvroute.engine.types import EngineConfig
    from kvroute.routing.queue import QueueConfig
    from kvroute.server.config import RouterConfig

    policy, _ = split_arm(arm)
    if not has_queue(arm):
        return RouterConfig(backends=backends, policy=policy, router_queue=None, **more)
    ecfg = EngineConfig()
    limits = (ecfg.max_num_batched_tokens, ecfg.max_num_seqs)
    return RouterConfig(
        backends=backends, policy=policy, router_queue=QueueConfig(), engine_limits=limits, **more
    )


def _progress(show: bool) -> Any:
    """A rich progress display for the job (elapsed and remaining time per bar), or None: not asked
    for, or not a terminal (a log or a pipe gets the plain lines only)."""
    from rich.console import Console

    if not show or not Console().is_terminal:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(bar_width=24),
        TextColumn("{task.completed:>3.0f}/{task.total:.0f} {task.fields[unit]}"),
        TextColumn("elapsed"),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
    )


def _check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    from kvroute.policies.registry import make_policy
    from kvroute.workloads import WORKLOADS

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    sim_only = [p.strip() for p in args.sim_policies.split(",") if p.strip()]
    if not policies:
        raise UserError("--policies: give at least one policy")
    if len(set(policies)) != len(policies):
        raise UserError("--policies: a policy is given twice")
    for p in policies:
        name, caching = split_arm(p)
        if not caching:
            raise UserError(f"--policies {p!r}: the job's engines always cache prefixes")
        make_policy(name)
    for p in sim_only:
        make_policy(p)
    if args.workload not in WORKLOADS:
        raise UserError(f"unknown workload {args.workload!r}; choose one of {', '.join(WORKLOADS)}")
    if args.gateway == "envoy":
        from kvroute.commands.epp import require_gateway
        from kvroute.server.extproc.envoyproc import find_envoy

        require_gateway()
        find_envoy()  # UserError naming what is missing
    if args.instances < 1 or not args.duration > 0 or not args.time_scale > 0 or not args.rate_scale > 0:
        raise UserError("--instances, --duration, --time-scale and --rate-scale must be positive")
    return policies, sim_only


def run(args: argparse.Namespace) -> int:
    from kvroute.commands import demo_report as report
    from kvroute.commands.demo_meter import level, unlevel
    from kvroute.commands.sim import write_json
    from kvroute.loadgen import BlockText
    from kvroute.server.run import run_loop
    from kvroute.tokenizer import load_tokenizer

    policies, sim_only = _check(args)
    first = policies[0]
    print(
        f"kvroute demo: {args.instances} emulated engines (vLLM-compatible servers that model "
        f"Qwen3-30B-A3B's timing; no GPU) behind the kvroute router, on this machine.\n"
        f"Each routing policy in turn gets the same {args.duration:g} s of generated chat "
        f"conversations (`{args.workload}` at ×{args.rate_scale:g}),\nstreamed over HTTP. An engine "
        "that already holds a conversation's history in its KV cache skips recomputing it,\nso a "
        "policy that sends each turn back to that engine answers sooner (lower time to first token, "
        "TTFT).\n",
        flush=True,
    )
    print(_machine(), flush=True)
    text = BlockText(load_tokenizer())
    rows: list[dict[str, Any]] = []
    bar = _progress(not args.no_progress)

    reqs = _requests(args)

    async def main() -> int:
        try:
            for p in policies:
                level(text, reqs)  # no arm pays for another's prompt text or leftovers (demo_meter)
                rows.append(await _one(p, report.plain_name(p, first), args, text, reqs, bar))
        finally:
            unlevel()
        return 0

    if bar is not None:
        with bar:
            run_loop(main)
    else:
        run_loop(main)
    simulated, bound = _simulate(args, policies, sim_only, not args.no_progress)
    for row in rows:
        row["simulated_ttft_ms_mean"] = simulated[row["policy"]]["ttft_ms"]["mean"]
    _mark(rows)
    print(
        f"\n### kvroute's default against its rivals: {args.instances} engines, `{args.workload}` "
        f"×{args.rate_scale:g}, {args.duration:g} s, over HTTP\n"
    )
    print(report.live_table(rows, DEFAULT_ARM, bound))
    verdicts = {r["policy"]: v for r in rows if (v := r.get("_verdict")) is not None}
    print(f"\n{report.summary_sentence(first, verdicts)}")
    if (warning := report.busy_machine_warning(rows)) is not None:
        print(f"\n{warning}")
    print(
        "\nHow to read it: TTFT is the time from sending a request to its first streamed token (model "
        f"time; the engines\nrun at ×{args.time_scale:g}). `vs balancer` is the mean TTFT as a fraction of the cache-blind "
        "balancer's. The engines' own TTFT\n(from their /metrics) is their queueing and prefill; the rest "
        "of the client's is HTTP, tokenizing, routing and streaming\non this machine's cores. A "
        "tie: the two means differ by less than two standard errors. Every arm starts level (the\n"
        "prompts' text made, the garbage collector cleared); each arm's line above gives this process's "
        "CPU and\nrouting time per request (router and load generator share it)."
    )
    print(f"\n{report.BOUND_MEANING}")
    if len(simulated) > len(policies):
        print(
            "\nIn the simulator only (same workload, seed and cluster): the first arm with the "
            "router-side queue toggled,\nand the peers' other LMetric variants:\n"
        )
        print(report.sim_table([(name, r) for name, r in simulated.items()], bound))
    print(
        f"\nThe same in the simulator: kvroute sim --workload {args.workload} --instances {args.instances} "
        f"--rate-scale {args.rate_scale:g} --duration {args.duration:g} {arm_flags(first)}\n"
        "Run it yourself: "
        + run_yourself(args.instances, first, args.workload, args.rate_scale, args.duration, args.gateway)
    )
    if args.json:
        for row in rows:
            row.pop("_verdict", None)
        write_json(args.json, {"rows": rows, "bound": bound, "simulated": simulated})
    return 0


def _machine() -> str:
    """One line on where the job runs: CPU model and count, and the load average before it started
    (other work on the cores shows in the client's TTFT, not in the engines')."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"Machine: {os.cpu_count()} cores ({model}); load average {load} (1, 5, 15 min) at the start.\n"


def arm_flags(arm: str) -> str:
    """The flags of `kvroute sim` / `up` that run ``arm``: its policy, and ``--no-router-queue`` /
    ``--router-queue`` where the arm differs from the commands' default
    (:func:`~kvroute.routing.queue.default_queue`)."""
    from kvroute.routing.queue import default_queue

    policy, _ = split_arm(arm)
    queued = has_queue(arm)
    if queued == (default_queue() is not None):
        return f"--policy {policy}"
    return f"--policy {policy} " + ("--router-queue" if queued else "--no-router-queue")


def run_yourself(
    instances: int, arm: str, workload: str, rate_scale: float, duration: float, gateway: str = "none"
) -> str:
    """A shell line that does one of the job's runs by hand: ``kvroute up`` in the background (with
    ``arm``'s flags, :func:`arm_flags`), the bench (which waits, bounded, until the router answers
    ready), then stops ``up``."""
    via = f" --gateway {gateway}" if gateway != "none" else ""
    return (
        f"kvroute up --instances {instances} {arm_flags(arm)}{via} & kvroute bench --url "
        f"http://127.0.0.1:8080 --workload {workload} --rate-scale {rate_scale:g} --duration {duration:g}; "
        "kill $!"
    )


def _mark(rows: list[dict[str, Any]]) -> None:
    """Set each rival's verdict against the first row (the default) on mean TTFT; the first row's
    ``ttft_mean_vs_vllm`` and every row's are set when the balancer ran."""
    from kvroute.commands.demo_report import BALANCER, verdict

    head = rows[0]
    base = next((r for r in rows if r["policy"] == BALANCER), None)
    for r in rows:
        if base is not None:
            r["ttft_mean_vs_vllm"] = r["ttft_ms"]["mean"] / base["ttft_ms"]["mean"]
        if r is head:
            continue
        v = verdict(head["ttft_ms"]["mean"], head["ttft_se_ms"], r["ttft_ms"]["mean"], r["ttft_se_ms"])
        r["_verdict"] = v
        r["verdict"] = str(v)


def _simulate(
    args: argparse.Namespace, policies: list[str], sim_only: list[str], show: bool
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Every live arm, the first with the router-side queue toggled (the default without it, or a
    first arm without it behind it) and ``sim_only`` in the simulator (same workload, seed and
    cluster), and the bound: (arm → summary, bound in model ms)."""
    from kvroute.sim.bound import spec_bound, spec_engine
    from kvroute.sim.compare import arm_changes
    from kvroute.sim.runner import RunSpec, run_spec

    def spec(arm: str) -> RunSpec:
        return RunSpec(
            **arm_changes(arm),
            instances=args.instances,
            workload=args.workload,
            duration=args.duration,
            rate_scale=args.rate_scale,
            seed=args.seed,
        )

    first = policies[0]
    toggled = first.removesuffix(ROUTER_QUEUE) if has_queue(first) else first + ROUTER_QUEUE
    arms = [(p, spec(p)) for p in policies]
    if toggled not in policies:
        arms.insert(1, (toggled, spec(toggled)))
    arms += [(p, spec(p)) for p in sim_only if p not in policies]
    bar = _progress(show)
    out: dict[str, dict[str, Any]] = {}
    if bar is None:
        out = {name: run_spec(s) for name, s in arms}
        b = spec_bound(spec(policies[0]), spec_engine(spec(policies[0])))
    else:
        with bar:
            task = bar.add_task("simulator + bound", total=len(arms) + 1, unit="runs")
            for name, s in arms:
                out[name] = run_spec(s)
                bar.advance(task)
            b = spec_bound(spec(policies[0]), spec_engine(spec(policies[0])))
            bar.advance(task)
    bound = {
        "ttft_mean_ms": b.ttft_mean_bound_ms,
        "ttft_p99_ms": b.ttft_floor_p99_ms,
        # the bound's KV-capacity ceiling on hits (one pooled cache of every instance's capacity)
        "kv_hit_rate": b.kv_hit_rate_ceiling,
    }
    return out, bound
