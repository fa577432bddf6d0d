"""kvroute's router in Ray Serve, against Ray's own routers, on a laptop.

Starts a local Ray (``--num-cpus``, default 2) and a Serve app whose deployment runs kvroute's
emulated engine (:class:`kvroute.integrations.ray_engine.EmulatedEngine`: the engine model of
``kvroute engine``, on the wall clock) in ``--replicas`` replicas, then replays one multi-turn chat
workload through the deployment's handle once per router:

- ``kvroute``: :class:`kvroute.integrations.ray_serve.KVRouteRequestRouter` (``lmetric``, or the
  registry policy ``--kvroute-policy`` names);
- ``ray-default``: Ray Serve's default (power of two choices);
- ``ray-prefix``: Ray Serve LLM's ``PrefixCacheAffinityRouter``, when it imports here (it needs no
  GPU library; its public module also pulls ``pyarrow``, so the internal module is tried as well).

The workload (seeded): ``--conversations`` chats start as a Poisson process at ``--rate`` per second;
each has ``--turns`` turns separated by an exponential think time (mean ``--think`` s). A chat's
system prompt is one of ``--system-prompts`` shared prompts (about 300 tokens), its user messages
200-500 words, so a conversation's own history dominates its prompt; every request asks for ``--max-tokens`` tokens. The replicas' KV pools are small
(``--kv-blocks``, 16-token blocks) so that caches fill up and where a turn goes matters.

TTFT is measured by the client: from the handle call to the first streamed item (so it includes the
routing decision and Ray's transport). KV hit rate = prompt tokens served from cache (the engine's
``cached_tokens``) / all prompt tokens. ``--repeat N`` replays the workload N times per router,
interleaved (round k runs every router once, the order rotated by k, each on a fresh app), and
prints each run and the mean over the runs. ``--record FILE`` writes the first router's first run as
a ``kvroute`` trace (arrival times as replayed, the router's block chains), so that
``kvroute sim --trace FILE --instances 2 --kv-tokens 16384`` replays the same traffic under every
policy of the registry with exact views. ``--json FILE`` writes
``{"routers": {NAME: {"requests", "kv_hit_rate", "ttft_ms": {"mean", "p99"}, "per_replica"}}, "runs": [...], ...}``
(``routers``: the means over the runs; ``runs``: one such mapping per round).

Run: ``PYTHONPATH=src python examples/ray_serve/app.py --replicas 2`` (after ``pip install -e '.[ray]'``:
``python examples/ray_serve/app.py``). About two minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from kvroute.policies.registry import DEFAULT_POLICY

WORDS = [
    "river",
    "stone",
    "light",
    "garden",
    "window",
    "paper",
    "silver",
    "market",
    "winter",
    "engine",
    "forest",
    "signal",
    "harbor",
    "letter",
    "mountain",
    "pocket",
    "thunder",
    "candle",
    "bridge",
    "orchard",
    "lantern",
    "meadow",
    "compass",
    "anchor",
    "velvet",
]


@dataclass
class Turn:
    conversation: int
    at: float = 0.0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    replica: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Chat:
    """One conversation: its start time, system prompt, user messages and think times (seconds)."""

    index: int
    start: float
    system: str
    users: list[str]
    thinks: list[float]
    turns: list[Turn] = field(default_factory=list)


def workload(args: argparse.Namespace) -> list[Chat]:
    rng = random.Random(args.seed)
    systems = [
        f"System prompt {k}. " + " ".join(rng.choice(WORDS) for _ in range(300))
        for k in range(args.system_prompts)
    ]
    chats, t = [], 0.0
    for i in range(args.conversations):
        t += rng.expovariate(args.rate)
        users = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 500))) for _ in range(args.turns)]
        thinks = [rng.expovariate(1.0 / args.think) for _ in range(args.turns)]
        chats.append(Chat(i, t, systems[i % len(systems)], users, thinks))
    return chats


class ChatBody:
    """The request as Ray Serve LLM passes it: attributes (its router reads ``.messages``) and
    ``model_dump()`` (kvroute's router and the engine read the dict)."""

    def __init__(self, messages: list[dict[str, str]], max_tokens: int) -> None:
        self.messages = messages
        self.max_tokens = max_tokens

    def model_dump(self) -> dict[str, Any]:
        return {"messages": self.messages, "max_tokens": self.max_tokens}


async def run_chat(handle: Any, chat: Chat, max_tokens: int, t0: float) -> None:
    await asyncio.sleep(max(0.0, t0 + chat.start - time.perf_counter()))
    msgs = [{"role": "system", "content": chat.system}]
    for user, think in zip(chat.users, chat.thinks, strict=True):
        msgs.append({"role": "user", "content": user})
        turn = Turn(chat.index, time.perf_counter() - t0, messages=list(msgs))
        start = time.perf_counter()
        last: dict[str, Any] = {}
        async for item in handle.options(stream=True).remote(ChatBody(list(msgs), max_tokens)):
            if item.get("first"):
                turn.ttft_s = time.perf_counter() - start
            last = item
        if "error" in last:
            raise RuntimeError(f"request failed: {last}")
        usage = last["usage"]
        turn.prompt_tokens = usage["prompt_tokens"]
        turn.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        turn.replica = last["replica"]
        chat.turns.append(turn)
        msgs.append({"role": "assistant", "content": last["text"]})
        await asyncio.sleep(think)


def router_classes() -> tuple[dict[str, Any], str | None]:
    """name → request_router_class (None: Ray's default); and why ray-prefix is missing, if it is."""
    from kvroute.integrations.ray_serve import KVRouteRequestRouter

    out: dict[str, Any] = {"kvroute": KVRouteRequestRouter, "ray-default": None}
    try:
        from ray.serve.llm.request_router import PrefixCacheAffinityRouter

        out["ray-prefix"] = PrefixCacheAffinityRouter
        return out, None
    except ImportError:
        pass
    try:  # the same class; its public module also imports Ray Serve LLM's configs (pyarrow)
        from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
            PrefixCacheAffinityRouter as Internal,
        )

        out["ray-prefix"] = Internal
        return out, None
    except ImportError as exc:
        return out, f"ray-prefix skipped: Ray Serve LLM's router does not import here ({exc})"


def deploy(args: argparse.Namespace, app: str, router: Any) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from kvroute.integrations.ray_engine import EmulatedEngine
    from kvroute.integrations.ray_serve import KVRouteRequestRouter

    cfg = RequestRouterConfig(request_routing_stats_period_s=0.5)
    if router is not None:
        kwargs = {"policy": args.kvroute_policy} if router is KVRouteRequestRouter else {}
        cfg = RequestRouterConfig(
            request_router_class=router, request_router_kwargs=kwargs, request_routing_stats_period_s=0.5
        )
    dep = serve.deployment(
        EmulatedEngine,
        name="engine",
        num_replicas=args.replicas,
        max_ongoing_requests=256,
        ray_actor_options={"num_cpus": 0},
        request_router_config=cfg,
    )
    # One app per router: a process keeps a deployment's handle router across redeploys of one name.
    return serve.run(dep.bind(kv_blocks=args.kv_blocks), name=app, route_prefix=None)


def traffic(chats: list[Chat], max_tokens: int) -> list[Any]:
    """The turns of ``chats`` as the router saw them: ``Request``s with the router's block chains, in
    arrival order (what ``--record`` writes and the hit-rate ceiling reads)."""
    from kvroute.integrations.prompts import PromptChains
    from kvroute.prepare.tokenize import RequestTokenizer
    from kvroute.tokenizer import load_tokenizer
    from kvroute.workloads.request import Request

    chains = PromptChains(RequestTokenizer(load_tokenizer()), 16)
    turns = sorted((t for c in chats for t in c.turns), key=lambda t: t.at)
    out = []
    for i, t in enumerate(turns):
        req = chains.route_request({"messages": t.messages, "max_tokens": max_tokens})
        out.append(
            Request(i, t.at, req.prompt_tokens, max_tokens, tuple(req.chain), 16, session=t.conversation)
        )
    return out


def summarize(chats: list[Chat], wall_s: float, max_tokens: int) -> dict[str, Any]:
    from kvroute.sim.bound import hit_rate_ceiling

    turns = [t for c in chats for t in c.turns]
    ttft = sorted(t.ttft_s * 1000 for t in turns)
    p99 = ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)]
    per_replica: dict[str, int] = {}
    for t in turns:
        per_replica[t.replica] = per_replica.get(t.replica, 0) + 1
    return {
        "requests": len(turns),
        "kv_hit_rate": sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
        # no router keeps more of this run's prompt tokens cached (docs/results/bound.md)
        "kv_hit_rate_ceiling": hit_rate_ceiling(traffic(chats, max_tokens)),
        "ttft_ms": {"mean": sum(ttft) / len(ttft), "p99": p99},
        "per_replica": sorted(per_replica.values(), reverse=True),
        "wall_seconds": wall_s,
    }


def record(chats: list[Chat], path: str, max_tokens: int) -> int:
    """Write the turns of ``chats`` (their arrival times as replayed, their prompts as the router's
    block chains) as a ``kvroute`` trace that ``kvroute sim --trace`` replays; returns the count."""
    from kvroute.workloads.record import RecordedRequest, TraceRecorder

    reqs = traffic(chats, max_tokens)
    with open(path, "wb") as f:
        rec = TraceRecorder(f, 16, clock=lambda: 0.0, started_unix=time.time())
        for r in reqs:
            ticket, at = rec.begin(r.arrival)
            rec.finish(
                ticket,
                RecordedRequest(at, r.prompt_len, max_tokens, r.block_ids, "emulated", str(r.session)),
            )
        rec.close()
    return len(reqs)


def mean_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean of one router's run summaries (requests, KV hit rate, TTFT mean and p99, wall)."""
    n = len(runs)
    return {
        "runs": n,
        "requests": sum(r["requests"] for r in runs) / n,
        "kv_hit_rate": sum(r["kv_hit_rate"] for r in runs) / n,
        "kv_hit_rate_ceiling": sum(r["kv_hit_rate_ceiling"] for r in runs) / n,
        "ttft_ms": {k: sum(r["ttft_ms"][k] for r in runs) / n for k in ("mean", "p99")},
        "per_replica": [r["per_replica"] for r in runs],
        "wall_seconds": sum(r["wall_seconds"] for r in runs) / n,
    }


def table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    out = [
        "| run | router | requests | TTFT mean (ms) | TTFT p99 (ms) | KV hit rate | ceiling | requests per replica |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for run, (name, r) in rows:
        per = r["per_replica"]
        counts = " / ".join(str(n) for n in per) if per and isinstance(per[0], int) else "-"
        out.append(
            f"| {run} | {name} | {r['requests']:g} | {r['ttft_ms']['mean']:.1f} | {r['ttft_ms']['p99']:.1f} "
            f"| {r['kv_hit_rate']:.3f} | {r['kv_hit_rate_ceiling']:.3f} | {counts} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--rate", type=float, default=1.0, help="new conversations per second")
    p.add_argument("--think", type=float, default=1.5, help="mean think time between turns (s)")
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV pool per replica, 16-token blocks")
    p.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray")
    p.add_argument("--routers", default=None, help="comma-separated subset of kvroute,ray-default,ray-prefix")
    p.add_argument(
        "--kvroute-policy", default=DEFAULT_POLICY, help="the policy of kvroute's router (any registry name)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=1, help="runs per router, interleaved")
    p.add_argument(
        "--record",
        default=None,
        metavar="FILE",
        help="write the first run's traffic of the first router as a kvroute trace (for kvroute sim --trace)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "record")}
    if args.replicas < 1 or args.conversations < 1 or args.turns < 1 or args.rate <= 0 or args.repeat < 1:
        print(
            "error: --replicas, --conversations, --turns, --rate and --repeat must be positive",
            file=sys.stderr,
        )
        return 2
    try:
        import ray
        from ray import serve
    except ImportError:
        print("error: this example needs Ray: pip install -e '.[ray]'", file=sys.stderr)
        return 2
    classes, note = router_classes()
    names = list(classes)
    if args.routers:
        names = [n.strip() for n in args.routers.split(",") if n.strip()]
        unknown = [n for n in names if n not in classes]
        if unknown:
            print(
                f"error: unknown or unavailable router(s) {unknown}; available: {list(classes)}",
                file=sys.stderr,
            )
            return 2
    try:  # a bad policy name: one line here, not a failed deployment later
        from kvroute.errors import UserError
        from kvroute.features.settings import FeatureConfig
        from kvroute.routing.core import build_policy

        build_policy(args.kvroute_policy, FeatureConfig(), random.Random(0))
    except UserError as exc:
        print(f"error: --kvroute-policy: {exc}", file=sys.stderr)
        return 2
    if note:
        print(note)
    ray.init(
        num_cpus=args.num_cpus, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False
    )
    runs: list[dict[str, Any]] = []
    try:
        for k in range(args.repeat):
            order = names[k % len(names) :] + names[: k % len(names)]  # rotate: no router always first
            results: dict[str, Any] = {}
            for name in order:
                app = f"example-{name}-{k}"  # one app per router and run (see deploy)
                handle = deploy(args, app, classes[name])
                chats = workload(args)
                warm = Chat(-1, 0.0, "warm-up", ["warm-up"], [0.0])  # Ray builds the router on first use
                asyncio.run(run_chat(handle, warm, 1, time.perf_counter()))
                used = type(handle._router._asyncio_router.request_router).__name__  # private: a check only
                print(f"run {k + 1}, {name}: routing with {used}", flush=True)

                async def replay(h: Any = handle, cs: list[Chat] = chats) -> None:
                    t0 = time.perf_counter()
                    await asyncio.gather(*(run_chat(h, c, args.max_tokens, t0) for c in cs))

                t0 = time.perf_counter()
                asyncio.run(replay())
                results[name] = summarize(chats, time.perf_counter() - t0, args.max_tokens)
                if args.record and k == 0 and name == names[0]:
                    print(f"recorded {record(chats, args.record, args.max_tokens)} requests to {args.record}")
                print(f"run {k + 1}, {name}: done in {results[name]['wall_seconds']:.1f} s", flush=True)
                serve.delete(app)
            runs.append({n: results[n] for n in names})
    finally:
        serve.shutdown()
        ray.shutdown()
    means = {n: mean_summary([r[n] for r in runs]) for n in names}
    rows = [(str(k + 1), (n, r[n])) for k, r in enumerate(runs) for n in names]
    if args.repeat > 1:
        rows += [("mean", (n, means[n])) for n in names]
    print()
    print("\n".join(table(rows)))
    if args.json:
        doc = {
            "routers": means if args.repeat > 1 else runs[0],
            "runs": runs,
            "settings": settings,
            "machine": {
                "cpus": args.num_cpus,
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "command": "python examples/ray_serve/app.py "
            + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
