"""CPU per routing decision of each policy the main job compares, at 4, 16 and 64 instances.

One decision is ``policy.choose(request, views)`` on precomputed inputs (cached tokens per instance
already matched), so this isolates the score itself from hashing and matching (``bench_route``).
The inputs are drawn once per instance count from a fixed seed: loads of 0–20 running and 0–3
waiting requests, up to 5,000 queued prefill tokens and up to 5,000 KV blocks held per instance,
prompts of 100–8,000 tokens with up to 100 cached. Policies are timed in interleaved rounds (each
round runs every policy over the same 200 decisions) and the figure is the median over rounds of
microseconds per decision (``time.process_time_ns``: this process's CPU, so a busy machine stretches
it less than wall time). ``share_at_main_job_rate``: the fraction of one core that many decisions per
second cost at the main job's arrival rate (≈ 44 requests/s). ``lmetric-time/scalar`` is the default
policy with its cost model behind ``step_time`` alone, so it prices each step with one scalar call (as
before the vectorised path): the A/B, timed in the same rounds; its decisions are checked equal to
``lmetric-time``'s before timing, and ``lmetric_time_speedup_<n>`` is scalar / vectorised µs.
Writes ``benchmarks/results/decide.json``.
"""

from __future__ import annotations

import random
import statistics
import sys
import time

from benchmarks.common import table, write
from kvroute.engine.cost import get_profile
from kvroute.engine.types import CostModel
from kvroute.policies.base import Policy
from kvroute.policies.lmetric_time import LMetricTime
from kvroute.policies.registry import DEFAULT_POLICY, make_policy
from kvroute.views import InstanceView, RequestView

POLICIES = tuple(dict.fromkeys((DEFAULT_POLICY, "lmetric", "llm-d", "dynamo-lmetric", "vllm")))
INSTANCES = (4, 16, 64)
DECISIONS = 200
ROUNDS = 15
MAIN_JOB_RATE = 44.0  # requests/s: multiturn ×1.4 (kvroute.commands.demo)
SCALAR = "lmetric-time/scalar"


class ScalarOnly:
    """A cost model seen through ``step_time`` only: :class:`LMetricTime` then prices one step per call."""

    def __init__(self, cost: CostModel) -> None:
        self.name = cost.name
        self.step_time = cost.step_time


def _policies() -> dict[str, Policy]:
    policies = {name: make_policy(name) for name in POLICIES}
    policies[SCALAR] = LMetricTime(ScalarOnly(get_profile().cost), name="lmetric-time")
    return policies


def _inputs(n: int, rng: random.Random) -> list[tuple[RequestView, list[InstanceView]]]:
    out = []
    for _ in range(DECISIONS):
        views = [
            InstanceView(
                index=i,
                running=rng.randint(0, 20),
                waiting=rng.randint(0, 3),
                queued_prefill_tokens=rng.randint(0, 5000),
                kv_usage=rng.random(),
                kv_capacity_blocks=18_000,
                decode_blocks=rng.randint(0, 5000),
                max_batched_tokens=4096,
                max_num_seqs=256,
            )
            for i in range(n)
        ]
        prompt = rng.randint(100, 8000)
        cached = tuple(rng.randint(0, 100) // 16 * 16 for _ in range(n))
        out.append((RequestView(prompt_tokens=prompt, cached_tokens=cached, block_size=16), views))
    return out


def main() -> int:
    rng = random.Random(7)
    rows: dict[str, dict[str, float]] = {}
    for n in INSTANCES:
        inputs = _inputs(n, rng)
        policies = _policies()
        for req, views in inputs:
            if policies[SCALAR].choose(req, views) != policies["lmetric-time"].choose(req, views):
                raise SystemExit(f"{SCALAR} and lmetric-time disagree at {n} instances")
        per: dict[str, list[float]] = {name: [] for name in policies}
        for _ in range(ROUNDS):
            for name, policy in policies.items():
                t0 = time.process_time_ns()
                for req, views in inputs:
                    policy.choose(req, views)
                per[name].append((time.process_time_ns() - t0) / 1000 / DECISIONS)
        for name, xs in per.items():
            us = statistics.median(xs)
            rows.setdefault(name, {})[f"us_per_decision_{n}"] = round(us, 1)
            if n == 4:
                rows[name]["share_at_main_job_rate"] = round(us * 1e-6 * MAIN_JOB_RATE, 5)
    speedup = {
        f"lmetric_time_speedup_{n}": round(
            rows[SCALAR][f"us_per_decision_{n}"] / rows["lmetric-time"][f"us_per_decision_{n}"], 2
        )
        for n in INSTANCES
    }
    table(
        [(name, *(f"{r[f'us_per_decision_{n}']:.1f}" for n in INSTANCES)) for name, r in rows.items()],
        headers=("policy", *(f"µs/decision, {n} instances" for n in INSTANCES)),
    )
    write(
        "decide.json",
        {
            "policies": rows,
            **speedup,
            "instances": list(INSTANCES),
            "decisions_per_round": DECISIONS,
            "rounds": ROUNDS,
            "main_job_rate_per_s": MAIN_JOB_RATE,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
