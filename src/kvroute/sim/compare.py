"""Comparisons: many :class:`~kvroute.sim.runner.RunSpec` runs in worker processes, the saturation
search, and the paper preset's plan and orchestration. No files, no plots: the CLI layer
(``kvroute.commands.compare``) writes and draws what these functions return.

Saturation (used by ``kvroute compare --preset paper``): a run at rate scale ``r`` is *saturated* when
the reference policy (``vllm``) leaves requests unfinished, or when its mean TTFT exceeds
``threshold`` × its mean TTFT at the light rate (default 10×). The search probes the light rate, then
multiplies the rate by ``factor`` (2) until a probe saturates, then bisects ``refine`` times (2) in log
space between the last unsaturated and the first saturated probe. The *max rate* is the highest probe
that did not saturate (the testbed's max sustainable rate, to within ``factor ** (1 / 2 ** refine)``);
the paper's default load is half of it.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from types import TracebackType
from typing import Any

from kvroute.errors import UserError
from kvroute.policies.registry import DEFAULT_POLICY, DEFAULT_ROUTER_QUEUE, PEER_LMETRICS
from kvroute.routing.queue import QueueConfig
from kvroute.sim.bound import UnchainedBlocks, bound_summary
from kvroute.sim.capacity import Capacity, CapacityRule, CapacitySearch, Slo
from kvroute.sim.runner import RunSpec, run_spec

Summary = dict[str, Any]
BatchRunner = Callable[[Sequence[RunSpec]], list[Summary]]


# ------------------------------------------------------------------------------------------- the grid


def reference_setting(
    base: RunSpec, scrape_intervals: Sequence[float] = (), event_delays: Sequence[float] = ()
) -> tuple[float, float]:
    """The (scrape interval, event delay) whose runs make the per-rate tables and the CDFs: ``base``'s
    value of each unless a sweep list omits it, then the list's first value."""
    scrape = base.scrape_interval
    if scrape_intervals and scrape not in scrape_intervals:
        scrape = scrape_intervals[0]
    delay = base.event_delay
    if event_delays and delay not in event_delays:
        delay = event_delays[0]
    return scrape, delay


def expand_grid(
    base: RunSpec,
    policies: Sequence[str],
    rate_scales: Sequence[float],
    scrape_intervals: Sequence[float] = (),
    event_delays: Sequence[float] = (),
    samples_at: float | None = None,
) -> list[RunSpec]:
    """Every (policy, rate scale, scrape interval, event delay) combination of ``base``, in that
    nesting order (policy outermost). Empty staleness lists mean ``base``'s own value. Runs at rate
    scale ``samples_at`` with the :func:`reference_setting` keep their per-request samples."""
    scrapes = tuple(scrape_intervals) or (base.scrape_interval,)
    delays = tuple(event_delays) or (base.event_delay,)
    ref = reference_setting(base, scrape_intervals, event_delays)
    out = []
    for policy in policies:
        for rate in rate_scales:
            for scrape in scrapes:
                for delay in delays:
                    keep = rate == samples_at and (scrape, delay) == ref
                    out.append(
                        replace(
                            base,
                            policy=policy,
                            rate_scale=rate,
                            scrape_interval=scrape,
                            event_delay=delay,
                            keep_samples=keep,
                        )
                    )
    return out


def run_one(spec: RunSpec) -> Summary:
    """``run_spec(spec)`` plus the spec's staleness settings, duration and ``cpu_seconds`` (this
    process's CPU time for the run: unlike ``wall_seconds``, not inflated by other load); the function
    worker processes call. A user error crosses the process boundary as a plain :class:`UserError`."""
    cpu0 = time.process_time()
    try:
        out = run_spec(spec)
    except UserError as exc:
        raise UserError(str(exc)) from None
    out["cpu_seconds"] = time.process_time() - cpu0
    out["scrape_interval"] = spec.scrape_interval
    out["event_delay"] = spec.event_delay
    out["duration"] = spec.duration
    out["seed"] = spec.seed
    out["prefix_caching"] = spec.prefix_caching
    out["policy"] = arm_name(out["policy"], spec.prefix_caching, spec.router_queue is not None)
    return out


class SpecRunner:
    """Runs batches of specs: in ``jobs`` worker processes (spawned, so no state is inherited), or in
    this process when ``jobs`` is 1. Use as a context manager; ``run`` returns summaries in the order
    of the specs and calls ``on_done(spec, summary)`` as each finishes (in completion order)."""

    def __init__(self, jobs: int, on_done: Callable[[RunSpec, Summary], None] | None = None) -> None:
        if jobs < 1:
            raise UserError(f"--jobs must be at least 1 (got {jobs})")
        self.jobs = jobs
        self.on_done = on_done
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> SpecRunner:
        if self.jobs > 1:
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=exc is None, cancel_futures=True)
            self._pool = None

    def run(self, specs: Sequence[RunSpec]) -> list[Summary]:
        """Run every spec (mutates nothing but the pool's state); raises the first error."""
        results: list[Summary | None] = [None] * len(specs)
        pool = self._pool
        if pool is None or len(specs) <= 1:
            for i, spec in enumerate(specs):
                results[i] = self._done(spec, run_one(spec))
        else:
            pending: dict[Future[Summary], int] = {pool.submit(run_one, s): i for i, s in enumerate(specs)}
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    i = pending.pop(fut)
                    results[i] = self._done(specs[i], fut.result())
        return [r for r in results if r is not None]

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]`` in the worker processes (``fn`` and the items picklable)."""
        pool = self._pool
        if pool is None or len(items) <= 1:
            return [fn(x) for x in items]
        return list(pool.map(fn, items))

    def _done(self, spec: RunSpec, out: Summary) -> Summary:
        if self.on_done is not None:
            self.on_done(spec, out)
        return out


# ------------------------------------------------------------------------------------------ saturation


@dataclass(frozen=True, slots=True)
class SaturationRule:
    """How saturation is searched for; see the module docstring. ``light_rate``: the rate scale whose
    mean TTFT is the light-load reference; ``max_ramp``: most rate multiplications before giving up."""

    light_rate: float
    threshold: float = 10.0
    factor: float = 2.0
    refine: int = 2
    max_ramp: int = 8

    def check(self) -> None:
        """Raise UserError for nonsense settings."""
        if not (self.light_rate > 0 and math.isfinite(self.light_rate)):
            raise UserError(f"light rate must be a positive number (got {self.light_rate})")
        if not self.threshold > 1 or not self.factor > 1:
            raise UserError("saturation threshold and ramp factor must be > 1")
        if self.refine < 0 or self.max_ramp < 1:
            raise UserError("refine must be >= 0 and max_ramp >= 1")


@dataclass(frozen=True, slots=True)
class Probe:
    """One measured rate: mean TTFT (ms), unfinished requests, whether it counts as saturated, and the
    run's wall time (s)."""

    rate: float
    ttft_mean_ms: float
    unfinished: int
    saturated: bool
    wall_seconds: float


@dataclass(frozen=True, slots=True)
class Saturation:
    """The search's outcome. ``max_rate``: highest unsaturated probe; ``saturated_rate``: lowest
    saturated probe (None if the ramp never saturated); ``light_ttft_ms``: the reference."""

    light_ttft_ms: float
    max_rate: float
    saturated_rate: float | None
    probes: tuple[Probe, ...]

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (lists, not tuples)."""
        return _lists(asdict(self))


def _lists(obj: Any) -> Any:
    """``obj`` with every tuple turned into a list, recursively (what a JSON round trip gives)."""
    if isinstance(obj, tuple | list):
        return [_lists(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    return obj


def is_saturated(summary: Summary, light_ttft_ms: float, threshold: float) -> bool:
    """Unfinished requests, no finished one, or mean TTFT above ``threshold`` × the light value."""
    ttft = summary["ttft_ms"]["mean"]
    return summary["unfinished"] > 0 or math.isnan(ttft) or ttft > threshold * light_ttft_ms


class SaturationSearch:
    """The search as a state machine, so that several searches can share one worker pool: ask
    ``next_rate()`` (None when done), measure it, ``record(rate, summary)``; finally ``result()``."""

    def __init__(self, rule: SaturationRule) -> None:
        rule.check()
        self.rule = rule
        self.probes: list[Probe] = []
        self._light_ttft: float | None = None
        self._lo: float | None = None  # highest unsaturated rate so far
        self._hi: float | None = None  # lowest saturated rate so far
        self._ramps = 0
        self._refines = 0

    def next_rate(self) -> float | None:
        """The next rate to measure, or None when the search is over."""
        rule = self.rule
        if self._light_ttft is None:
            return None if self.probes else rule.light_rate
        assert self._lo is not None
        if self._hi is None:
            return self._lo * rule.factor if self._ramps < rule.max_ramp else None
        if self._refines < rule.refine:
            return math.sqrt(self._lo * self._hi)
        return None

    def record(self, rate: float, summary: Summary) -> None:
        """Record the summary of a run at ``rate`` (the rate ``next_rate`` returned)."""
        rule = self.rule
        ttft = float(summary["ttft_ms"]["mean"])
        if self._light_ttft is None:
            if summary["unfinished"] > 0 or math.isnan(ttft) or ttft <= 0:
                raise UserError(
                    f"rate scale {rate:g} is not a light load (mean TTFT {ttft:.1f} ms, "
                    f"{summary['unfinished']} unfinished); lower the light rate"
                )
            self._light_ttft = ttft
            saturated = False
        else:
            saturated = is_saturated(summary, self._light_ttft, rule.threshold)
            if self._hi is None:
                self._ramps += 1
            else:
                self._refines += 1
        self.probes.append(
            Probe(rate, ttft, int(summary["unfinished"]), saturated, float(summary.get("wall_seconds", 0.0)))
        )
        if saturated:
            self._hi = rate if self._hi is None else min(self._hi, rate)
        else:
            self._lo = rate if self._lo is None else max(self._lo, rate)

    @property
    def done(self) -> bool:
        return self.next_rate() is None

    def result(self) -> Saturation:
        """The outcome; only once ``done``."""
        if not self.done or self._light_ttft is None or self._lo is None:
            raise RuntimeError("the saturation search is not finished")
        return Saturation(self._light_ttft, self._lo, self._hi, tuple(self.probes))


def find_saturation(rule: SaturationRule, measure: Callable[[float], Summary]) -> Saturation:
    """Run one search with ``measure(rate) -> summary`` (the reference policy's run at that rate)."""
    search = SaturationSearch(rule)
    while (rate := search.next_rate()) is not None:
        search.record(rate, measure(rate))
    return search.result()


# ----------------------------------------------------------------------------------------- paper preset

PAPER_POLICIES: tuple[str, ...] = tuple(
    dict.fromkeys(
        ("vllm", "llm-d", DEFAULT_POLICY, "lmetric", "lmetric-kv", "sglang", "dynamo", *PEER_LMETRICS)
    )
)
"""The paper preset's fixed policies (registry names; the first is the reference whose saturation sets
the rates): the default, the paper's ``lmetric`` and the peers' own LMetric variants last. To evaluate a new policy in the preset, add its name
here (or pass ``--policies``)."""

NO_PREFIX_CACHING = " (prefix caching off)"
"""Suffix of an *arm* (a policy name in a preset's list) whose engines run without prefix caching."""

SEED_POLICIES: tuple[str, ...] = ("vllm" + NO_PREFIX_CACHING, "vllm", "llm-d", "lmetric")
"""The seed preset's arms: the design document's table compares lmetric and llm-d (engines caching)
against vLLM engines with 0 % KV hits; plain ``vllm`` (caching on) is the fair reference beside it."""


ROUTER_QUEUE = " +queue"
"""Suffix of an arm whose router runs the router-side queue (:mod:`kvroute.routing.queue`, defaults)."""


def arm_name(policy: str, prefix_caching: bool = True, router_queue: bool = False) -> str:
    """The arm's name: the policy, with :data:`NO_PREFIX_CACHING` when its engines do not cache and
    :data:`ROUTER_QUEUE` when its router queues."""
    return policy + ("" if prefix_caching else NO_PREFIX_CACHING) + (ROUTER_QUEUE if router_queue else "")


DEFAULT_ARM = arm_name(DEFAULT_POLICY, router_queue=DEFAULT_ROUTER_QUEUE)
"""The default's arm in a comparison (``lmetric-time +queue``): the default policy
(:data:`~kvroute.policies.registry.DEFAULT_POLICY`), behind the router-side queue when
:data:`~kvroute.policies.registry.DEFAULT_ROUTER_QUEUE`. What the summaries compare every other arm
with."""

PAPER_ARMS: tuple[str, ...] = tuple(
    dict.fromkeys((*PAPER_POLICIES, *(p + ROUTER_QUEUE for p in PAPER_POLICIES), DEFAULT_ARM))
)
"""The paper preset's arms: every fixed policy without and with the router-side queue (so the
default's arm, :data:`DEFAULT_ARM`, always among them)."""


def has_queue(arm: str) -> bool:
    """Whether ``arm``'s router runs the router-side queue."""
    return arm.endswith(ROUTER_QUEUE)


def split_arm(arm: str) -> tuple[str, bool]:
    """``arm`` → (policy, prefix caching on); the queue suffix is dropped (see :func:`has_queue`)."""
    arm = arm.removesuffix(ROUTER_QUEUE)
    if arm.endswith(NO_PREFIX_CACHING):
        return arm.removesuffix(NO_PREFIX_CACHING), False
    return arm, True


def arm_changes(arm: str) -> dict[str, Any]:
    """The :class:`RunSpec` fields an arm sets: policy, prefix caching, the router-side queue."""
    policy, caching = split_arm(arm)
    return {
        "policy": policy,
        "prefix_caching": caching,
        "router_queue": QueueConfig() if has_queue(arm) else None,
    }


def arm_spec(base: RunSpec, arm: str) -> RunSpec:
    """``base`` run as ``arm`` (plain ``kvroute compare``): the arm's policy; its suffixes turn prefix
    caching off or the router-side queue on (``base``'s own queue settings, else the defaults), and
    an arm without them keeps ``base``'s (so ``--router-queue`` still queues every arm)."""
    policy, caching = split_arm(arm)
    queue = base.router_queue
    if queue is None and has_queue(arm):
        queue = QueueConfig()
    return replace(base, policy=policy, prefix_caching=base.prefix_caching and caching, router_queue=queue)


@dataclass(frozen=True, slots=True)
class PaperWorkload:
    """One workload of the preset: a synthetic ``workload`` name or a ``trace`` file; ``light_rate``
    starts its saturation search; ``duration``: seconds of (scaled) arrivals per run."""

    name: str
    duration: float
    light_rate: float
    workload: str | None = None
    trace: str | None = None

    def spec(self, plan: PaperPlan, arm: str, rate: float, **changes: Any) -> RunSpec:
        fields: dict[str, Any] = {
            **arm_changes(arm),
            "instances": plan.instances,
            "trace": self.trace,
            "workload": self.workload,
            "rate_scale": rate,
            "duration": self.duration,
            "seed": plan.seeds[0],
            "profile": plan.profile,
        }
        return RunSpec(**(fields | changes))

    def seeds(self, plan: PaperPlan) -> tuple[int, ...]:
        """The seeds run at the default load: all of the plan's for a synthetic workload; only the
        first for a trace, which is replayed exactly (a seed would change only randomized policies,
        and the preset's are deterministic), so a trace's figures carry no interval."""
        return plan.seeds if self.trace is None else plan.seeds[:1]


@dataclass(frozen=True, slots=True)
class PaperPlan:
    """The preset: workloads, policies (arms: see :func:`split_arm`), the λ grid of ``linear`` (empty:
    none), rates as fractions of each workload's max rate (``default_fraction`` of it is the default
    load), the seeds at the default load (the first one everywhere else), capacity at an SLO (the SLO
    is ``slo_*_ms`` when given, else ``slo_*_factor`` × the reference's p99 at the light rate; searched
    with ``capacity_refine`` bisections for each seed of ``capacity_seeds``), and the staleness study
    (one workload at its default load; scrape intervals at the default event delay, then event delays
    at the default scrape interval)."""

    workloads: tuple[PaperWorkload, ...]
    instances: int = 16
    seeds: tuple[int, ...] = (0, 1, 2)
    policies: tuple[str, ...] = PAPER_ARMS
    lambdas: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    reference: str = "vllm"
    profile: str | None = None
    rate_fractions: tuple[float, ...] = (0.125, 0.25, 0.5, 1.0)
    default_fraction: float = 0.5
    threshold: float = 10.0
    factor: float = 2.0
    refine: int = 2
    capacity: bool = True
    slo_ttft_factor: float = 5.0
    slo_tpot_factor: float = 10.0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    capacity_refine: int = 3
    capacity_seeds: tuple[int, ...] = (0,)
    bound: bool = True  # the bound (kvroute.sim.bound): mean TTFT at the default load, capacity
    staleness_workload: str | None = "chatbot"
    scrape_intervals: tuple[float, ...] = (0.0, 0.05, 0.2, 1.0)
    event_delays: tuple[float, ...] = (0.002, 0.1, 1.0)

    def rule(self, w: PaperWorkload) -> SaturationRule:
        return SaturationRule(w.light_rate, self.threshold, self.factor, self.refine)

    def check(self) -> PaperPlan:
        """Raise UserError for an unusable plan; returns self."""
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise UserError("the preset needs distinct seeds")
        if self.reference not in self.policies:
            raise UserError(f"the policies must include the reference {self.reference!r}")
        if not set(self.capacity_seeds) <= set(self.seeds):
            raise UserError("capacity seeds must be among the seeds")
        return self

    def slo(self, light: Summary) -> Slo:
        """The SLO of a workload whose reference run at the light rate is ``light``."""
        return Slo(
            self.slo_ttft_ms or self.slo_ttft_factor * float(light["ttft_ms"]["p99"]),
            self.slo_tpot_ms or self.slo_tpot_factor * float(light["tpot_ms"]["p99"]),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-native (lists, not tuples)."""
        return _lists(asdict(self))


def paper_plan(mooncake_trace: str | None, duration: float | None = None, **changes: Any) -> PaperPlan:
    """The paper preset on this machine: the four synthetic workloads (300 s of arrivals each, the
    paper replays 1200 s) and, when its file is given, the Mooncake conversation trace (1200 s, the
    paper's length: it is cheap). ``duration`` overrides every workload's; ``changes`` the plan's
    other fields."""
    workloads = [
        PaperWorkload("chatbot", 300.0, 0.5, workload="chatbot"),
        PaperWorkload("coder", 300.0, 0.5, workload="coder"),
        PaperWorkload("api", 300.0, 0.5, workload="api"),
        PaperWorkload("agent", 300.0, 0.5, workload="agent"),
    ]
    if mooncake_trace is not None:
        workloads.append(PaperWorkload("mooncake", 1200.0, 0.25, trace=mooncake_trace))
    if duration is not None:
        workloads = [replace(w, duration=duration) for w in workloads]
    return PaperPlan(tuple(workloads), **changes).check()


SEED_PROFILE = "design-a100-qwen30b"


def seed_plan(duration: float | None = None, **changes: Any) -> PaperPlan:
    """The design document's own setup (seed/lmetric-seed.zh.txt §5): 16 A100 instances (the
    ``design-a100-qwen30b`` profile), its four workloads, vLLM's engines without prefix caching as the
    baseline whose saturation sets the rates, llm-d and lmetric on caching engines, plus ``vllm`` on
    caching engines. No λ grid, no staleness study. The profile saturates near ×1 (15 ms per decoding
    sequence), so the search starts at ×0.125."""
    workloads = [
        PaperWorkload(name, duration or 300.0, 0.125, workload=name)
        for name in ("chatbot", "coder", "api", "agent")
    ]
    fields: dict[str, Any] = {
        "policies": SEED_POLICIES,
        "reference": SEED_POLICIES[0],
        "profile": SEED_PROFILE,
        "lambdas": (),
        "staleness_workload": None,
    }
    return PaperPlan(tuple(workloads), **(fields | changes)).check()


def linear_name(lam: float) -> str:
    return f"linear:{lam:g}"


def best_lambda(runs: Iterable[Summary], lambdas: Sequence[float]) -> float:
    """The λ whose ``linear:<λ>`` run has the lowest mean TTFT (NaN counts as worst; ties → smaller λ)."""
    by_name = {r["policy"]: r for r in runs}

    def key(lam: float) -> tuple[float, float]:
        ttft = by_name[linear_name(lam)]["ttft_ms"]["mean"]
        return (math.inf if math.isnan(ttft) else ttft, lam)

    return min(lambdas, key=key)


@dataclass(slots=True)
class _Memo:
    """Summaries by spec within one preset run (a spec run twice gives the same summary). Each
    summary is labelled with its arm (:func:`arm_name`) and seed."""

    runner: BatchRunner
    known: dict[RunSpec, Summary] = field(default_factory=dict)

    def run(self, specs: Sequence[RunSpec]) -> list[Summary]:
        todo = []
        for s in specs:
            if s not in self.known and replace(s, keep_samples=True) not in self.known and s not in todo:
                todo.append(s)
        for s, out in zip(todo, self.runner(todo), strict=True):
            out["policy"] = arm_name(s.policy, s.prefix_caching, s.router_queue is not None)
            out["seed"] = s.seed
            self.known[s] = out
        return [self.known.get(s) or self.known[replace(s, keep_samples=True)] for s in specs]


def _by_cost(specs: list[RunSpec], probes: dict[str | None, tuple[Probe, ...]]) -> list[RunSpec]:
    """Specs sorted by estimated wall time, longest first (so the pool's tail is short): the wall time
    of the workload's nearest saturation probe, scaled by the rate ratio."""

    def estimate(s: RunSpec) -> float:
        ps = probes.get(s.trace or s.workload, ())
        if not ps:
            return s.rate_scale
        p = min(ps, key=lambda p: abs(math.log(p.rate / s.rate_scale)))
        return p.wall_seconds * s.rate_scale / p.rate

    return sorted(specs, key=estimate, reverse=True)


def _ordered(memo: _Memo, specs: list[RunSpec], probes: dict[str | None, tuple[Probe, ...]]) -> list[Summary]:
    """Run ``specs`` longest first; the summaries in the order of ``specs``."""
    memo.run(_by_cost(specs, probes))
    return memo.run(specs)


def run_capacity(
    searches: dict[Any, CapacitySearch],
    spec_for: Callable[[Any, float], RunSpec],
    run: Callable[[list[RunSpec]], list[Summary]],
) -> dict[Any, Capacity]:
    """Run capacity searches in lockstep (one batch per round): ``spec_for(key, rate)`` is the run
    that measures ``key``'s search at ``rate``; ``run`` measures a batch."""
    while True:
        asks = [(k, r) for k, s in searches.items() if (r := s.next_rate()) is not None]
        if not asks:
            return {k: s.result() for k, s in searches.items()}
        outs = run([spec_for(k, r) for k, r in asks])
        for (k, r), out in zip(asks, outs, strict=True):
            searches[k].record(r, out)


def _serial(fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    return [fn(x) for x in items]


def _bound_task(task: tuple[PaperWorkload, PaperPlan, float, tuple[float, float] | None, float]) -> Any:
    """One workload's bound (worker process): see :func:`kvroute.sim.bound.bound_summary`."""
    w, plan, default_rate, slo, start = task
    try:
        return bound_summary(lambda r: w.spec(plan, plan.reference, r), [default_rate], slo, start)
    except UnchainedBlocks as exc:
        return {"skipped": str(exc)}


def run_paper(
    plan: PaperPlan,
    runner: BatchRunner,
    note: Callable[[str], None] = lambda _: None,
    mapper: Callable[[Callable[[Any], Any], Sequence[Any]], list[Any]] | None = None,
) -> dict[str, Any]:
    """Run the preset with ``runner`` (a batch of specs → summaries); returns a JSON-able dict:
    ``{"plan", "workloads": [{"name", "duration", "saturation", "rates", "default_rate",
    "best_lambda", "seeds", "runs", "seed_runs", "slo", "capacity"}], "staleness": {"workload",
    "rate", "runs"} | None, "simulations", "cpu_seconds"}`` (distinct runs and their total CPU time).
    ``runs`` (first seed) holds every fixed policy at every rate, every ``linear:<λ>`` at the default
    rate and the best λ at every rate; ``seed_runs`` the shown policies (fixed and best λ) at the
    default rate with the other seeds; ``capacity``: one entry per shown policy and capacity seed;
    ``best_lambda`` is None without a λ grid."""
    memo = _Memo(runner)
    seed0 = plan.seeds[0]
    # 1. Saturation searches, all workloads in lockstep (one batch per round).
    searches = {w.name: SaturationSearch(plan.rule(w)) for w in plan.workloads}
    while True:
        asks = [(w, r) for w in plan.workloads if (r := searches[w.name].next_rate()) is not None]
        if not asks:
            break
        outs = memo.run([w.spec(plan, plan.reference, r) for w, r in asks])
        for (w, r), out in zip(asks, outs, strict=True):
            searches[w.name].record(r, out)
    sats = {name: s.result() for name, s in searches.items()}
    probes = {w.trace or w.workload: sats[w.name].probes for w in plan.workloads}
    for w in plan.workloads:
        sat = sats[w.name]
        note(
            f"{w.name}: max rate ×{sat.max_rate:.3g} (saturated at "
            f"{'none probed' if sat.saturated_rate is None else f'×{sat.saturated_rate:.3g}'}), "
            f"light mean TTFT {sat.light_ttft_ms:.0f} ms"
        )
    rates = {w.name: [sats[w.name].max_rate * f for f in plan.rate_fractions] for w in plan.workloads}
    default = {w.name: sats[w.name].max_rate * plan.default_fraction for w in plan.workloads}

    # 2. Fixed policies at every rate, the λ grid at the default rate, other seeds at the default rate.
    def grid(w: PaperWorkload, policies: Sequence[str], rs: Sequence[float]) -> list[RunSpec]:
        return [w.spec(plan, p, r, keep_samples=r == default[w.name]) for p in policies for r in rs]

    def seeded(w: PaperWorkload, policies: Sequence[str]) -> list[RunSpec]:
        return [
            w.spec(plan, p, default[w.name], seed=s) for p in policies for s in w.seeds(plan) if s != seed0
        ]

    lambdas = [linear_name(lam) for lam in plan.lambdas]
    first = [s for w in plan.workloads for s in grid(w, plan.policies, rates[w.name])]
    first += [s for w in plan.workloads for s in grid(w, lambdas, [default[w.name]])]
    first += [s for w in plan.workloads for s in seeded(w, plan.policies)]
    memo.run(_by_cost(first, probes))
    best: dict[str, float | None] = {w.name: None for w in plan.workloads}
    if plan.lambdas:
        for w in plan.workloads:
            best[w.name] = best_lambda(memo.run(grid(w, lambdas, [default[w.name]])), plan.lambdas)
            note(f"{w.name}: best λ = {best[w.name]:g}")

    def shown(w: PaperWorkload) -> list[str]:
        lam = best[w.name]
        return [*plan.policies, *([] if lam is None else [linear_name(lam)])]

    # 3. The best λ at every rate and at the other seeds; the staleness study.
    second = []
    for w in plan.workloads:
        if (lam := best[w.name]) is not None:
            second += grid(w, [linear_name(lam)], rates[w.name]) + seeded(w, [linear_name(lam)])
    stale_w = next((w for w in plan.workloads if w.name == plan.staleness_workload), None)
    stale_specs: list[RunSpec] = []
    if stale_w is not None:
        r = default[stale_w.name]
        base = stale_w.spec(plan, plan.reference, r)
        pols = [p for p in shown(stale_w) if not has_queue(p)]  # the queue arms are not in this study
        stale_specs = expand_grid(base, pols, [r], scrape_intervals=plan.scrape_intervals)
        stale_specs += expand_grid(base, pols, [r], event_delays=plan.event_delays)
        stale_specs = [replace(s, **arm_changes(s.policy)) for s in dict.fromkeys(stale_specs)]
    memo.run(_by_cost(second + stale_specs, probes))

    # 4. Capacity at the SLO: every shown policy, from the light rate, for each capacity seed.
    slos = {
        w.name: plan.slo(memo.run([w.spec(plan, plan.reference, w.light_rate)])[0]) for w in plan.workloads
    }
    caps: dict[tuple[str, str, int], Capacity] = {}
    if plan.capacity:
        wmap = {w.name: w for w in plan.workloads}
        cap_searches = {
            (w.name, p, s): CapacitySearch(
                CapacityRule(w.light_rate, slos[w.name], plan.factor, plan.capacity_refine)
            )
            for w in plan.workloads
            for p in shown(w)
            for s in plan.capacity_seeds
            if s in w.seeds(plan)
        }
        caps = run_capacity(
            cap_searches,
            lambda k, r: wmap[k[0]].spec(plan, k[1], r, seed=k[2]),
            lambda specs: _ordered(memo, specs, probes),
        )
        for w in plan.workloads:
            note(
                f"{w.name}: capacity at TTFT p99 ≤ {slos[w.name].ttft_p99_ms:.0f} ms, TPOT p99 ≤ "
                f"{slos[w.name].tpot_p99_ms:.1f} ms: "
                + ", ".join(
                    f"{p} ×{c.rate:.3g}" if c.rate is not None else f"{p} none"
                    for (n, p, _), c in caps.items()
                    if n == w.name
                )
            )

    # 5. The bound: what no router beats on each workload (kvroute.sim.bound), seed 0; its capacity
    # search starts at the best capacity a policy reached (a true bound is at least that).
    bounds: dict[str, dict[str, Any] | None] = {w.name: None for w in plan.workloads}
    if plan.bound:
        tasks = []
        for w in plan.workloads:
            slo = (slos[w.name].ttft_p99_ms, slos[w.name].tpot_p99_ms) if plan.capacity else None
            reached = [c.rate for (n, _, _), c in caps.items() if n == w.name and c.rate is not None]
            tasks.append((w, plan, default[w.name], slo, max(reached, default=w.light_rate)))
        for w, b in zip(plan.workloads, (mapper or _serial)(_bound_task, tasks), strict=True):
            if "skipped" in b:
                note(f"{w.name}: no bound: {b['skipped']}")
                continue
            bounds[w.name] = b
            cap = b.get("capacity")
            note(
                f"{w.name}: bound: mean TTFT ≥ {b['rates'][0]['ttft_mean_ms']:.1f} ms at the default load"
                + (
                    ""
                    if not plan.capacity
                    else f", capacity ≤ ×{cap:.3g}"
                    if cap is not None
                    else ", no capacity"
                )
            )

    workloads = []
    for w in plan.workloads:
        specs = grid(w, plan.policies, rates[w.name]) + grid(w, lambdas, [default[w.name]])
        if (lam := best[w.name]) is not None:
            specs += [s for s in grid(w, [linear_name(lam)], rates[w.name]) if s not in specs]
        light = memo.run([w.spec(plan, plan.reference, w.light_rate)])[0]
        workloads.append(
            {
                "name": w.name,
                "workload": w.workload,
                "trace": w.trace,
                "duration": w.duration,
                "saturation": sats[w.name].to_dict(),
                "rates": rates[w.name],
                "default_rate": default[w.name],
                "best_lambda": best[w.name],
                "seeds": list(w.seeds(plan)),
                "slo": {
                    "ttft_p99_ms": slos[w.name].ttft_p99_ms,
                    "tpot_p99_ms": slos[w.name].tpot_p99_ms,
                    "light_ttft_p99_ms": light["ttft_ms"]["p99"],
                    "light_tpot_p99_ms": light["tpot_ms"]["p99"],
                },
                "capacity": [
                    {"policy": p, "seed": s, **c.to_dict()} for (n, p, s), c in caps.items() if n == w.name
                ],
                "runs": memo.run(specs),
                "seed_runs": memo.run(seeded(w, shown(w))),
                "bound": bounds[w.name],
            }
        )
    staleness = None
    if stale_w is not None:
        staleness = {"workload": stale_w.name, "rate": default[stale_w.name], "runs": memo.run(stale_specs)}
    return {
        "plan": plan.to_dict(),
        "workloads": workloads,
        "staleness": staleness,
        "simulations": len(memo.known),
        "cpu_seconds": sum(float(out.get("cpu_seconds", 0.0)) for out in memo.known.values()),
    }
