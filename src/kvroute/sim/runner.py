"""One simulation run from a picklable spec: what `kvroute sim`, `kvroute compare` (in worker
processes) and the benchmarks call."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvroute.errors import UserError
from kvroute.features.settings import FeatureConfig
from kvroute.routing.queue import QueueConfig

SAMPLE_POINTS = 2000
"""Most per-request points ``run_spec`` returns per metric with ``keep_samples`` (evenly spaced quantiles)."""


@dataclass(frozen=True, slots=True)
class SimScenario:
    """The simulated cluster's side of the production features, which the live router does not set:
    ``scale_out`` = ((time s, instances joining), ...); the last ``spot_instances`` initial instances
    carry the tag ``spot``; ``by_class``: report latencies per request class (also on with classes)."""

    scale_out: tuple[tuple[float, int], ...] = ()
    spot_instances: int = 0
    by_class: bool = False


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything that defines a run. Exactly one of ``trace``/``workload``; exactly one (or none:
    the default profile) of ``profile``/``profile_dir``. ``kv_tokens`` overrides the profile's KV
    capacity per instance (tokens). Times in seconds. ``features``: the router's production features
    (the same settings the live router takes); ``scenario``: what happens to the simulated cluster.
    `kvroute sim` builds one from its flags (:mod:`kvroute.commands.settings`, which also writes the
    command that reproduces it)."""

    policy: str = "lmetric"
    instances: int = 16
    trace: str | None = None
    fmt: str = "auto"
    workload: str | None = None
    rate_scale: float = 1.0
    duration: float | None = None
    seed: int = 0
    skip_bad_lines: bool = False
    profile: str | None = None
    profile_dir: str | None = None
    model_config: str | None = None  # the model's HF config.json for ``profile_dir`` (else found beside it)
    tp: int = 1
    kv_tokens: int | None = None
    # False: every engine runs with prefix caching off (vLLM's --no-enable-prefix-caching): no prompt
    # block is ever reused, so no KV hits and no KV events; the router's view stays empty.
    prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_view: str = "exact"
    scrape_interval: float = 0.05
    event_delay: float = 0.002
    features: FeatureConfig = field(default_factory=FeatureConfig)
    scenario: SimScenario = SimScenario()
    # Opt-in: also return ``out["samples"]`` (TTFT/TPOT quantile points in ms, at most
    # ``SAMPLE_POINTS``) for CDF plots. Not a `kvroute sim` flag; it does not change the run.
    keep_samples: bool = False
    # Shadow policies (kvroute.routing.shadow): computed at every decision from the same views;
    # ``out["shadow"]`` = {name: {"decisions", "agreement", "mean_score_diff", "mean_cached_diff"}}.
    shadow: tuple[str, ...] = ()
    # Prefill/decode disaggregation (kvroute.sim.pd): (P, D) pool sizes instead of ``instances``
    # colocated ones; the P-to-D link in GB/s (KV bytes per token from the profile's model config);
    # ``pd_conditional``: allow the conditional skip of P.
    pd: tuple[int, int] | None = None
    pd_bandwidth_gbps: float = 25.0
    pd_conditional: bool = True
    # The router-side queue (kvroute.routing.queue; None: off): late binding, bands, fair share, TTL.
    router_queue: QueueConfig | None = None


def load_profile(spec: RunSpec) -> Any:
    from kvroute.engine.cost import DEFAULT_PROFILE, get_profile, profile_from_dir

    if spec.profile and spec.profile_dir:
        raise UserError("give --profile or --profile-dir, not both")
    if spec.model_config and not spec.profile_dir:
        raise UserError("--model-config goes with --profile-dir")
    if spec.profile_dir:
        return profile_from_dir(spec.profile_dir, tp=spec.tp, model_config=spec.model_config)
    return get_profile(spec.profile or DEFAULT_PROFILE)


def run_spec(spec: RunSpec, progress: Callable[[float, int, int], None] | None = None) -> dict[str, Any]:
    """Run one simulation; returns the contract's summary dict plus ``profile``, ``workload``,
    ``rate_scale`` and ``skipped_lines`` (and ``samples`` with ``spec.keep_samples``). The command line
    that reproduces it is the CLI's to write (:func:`kvroute.commands.settings.sim_command`)."""
    from kvroute.metrics import quantile_points_ms
    from kvroute.routing.core import build_policy
    from kvroute.sim.cluster import ClusterSim, SimConfig
    from kvroute.workloads import open_workload

    if spec.trace is None and spec.workload is None:
        raise UserError("give --trace FILE or --workload NAME")
    profile = load_profile(spec)
    cfg = SimConfig(
        instances=spec.instances,
        kv_capacity_tokens=spec.kv_tokens or profile.kv_capacity_tokens,
        prefix_caching=spec.prefix_caching,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        kv_view=spec.kv_view,
        scrape_interval=spec.scrape_interval,
        event_delay=spec.event_delay,
        seed=spec.seed,
        scale_out=spec.scenario.scale_out,
        spot_instances=spec.scenario.spot_instances,
        by_class=spec.scenario.by_class or spec.features.classes is not None,
        router_queue=spec.router_queue,
    )
    cfg.check()
    policy = build_policy(spec.policy, spec.features.check(), random.Random(spec.seed))
    stream, stats = open_workload(
        spec.trace, spec.fmt, spec.workload, spec.rate_scale, spec.duration, spec.seed, spec.skip_bad_lines
    )
    sim: Any
    if spec.pd is not None:
        sim = _pd_sim(spec, profile)
        out = sim.run(stream)
    else:
        sim = ClusterSim(cfg, policy, profile.cost, spec.shadow)
        out = sim.run(stream, progress)
    if spec.keep_samples:
        out["samples"] = {
            "ttft_ms": quantile_points_ms(sim.recorder.ttft, SAMPLE_POINTS),
            "tpot_ms": quantile_points_ms(sim.recorder.tpot, SAMPLE_POINTS),
        }
    out["profile"] = profile.name
    out["workload"] = spec.trace or spec.workload
    out["rate_scale"] = spec.rate_scale
    out["skipped_lines"] = stats.bad_lines
    return out


def _pd_sim(spec: RunSpec, profile: Any) -> Any:
    """The disaggregated cluster of ``spec.pd`` (features and shadows are not simulated there)."""
    from kvroute.engine.transfer import TransferModel
    from kvroute.sim.pd import PDClusterSim, PDSimConfig

    if spec.features.any or spec.shadow or spec.kv_view != "exact" or spec.router_queue is not None:
        raise UserError(
            "--pd simulates the exact KV view without features, shadow policies or the router queue"
        )
    if not spec.pd_bandwidth_gbps > 0:
        raise UserError("--pd-bandwidth must be positive (GB/s)")
    link = TransferModel.from_gbps(profile.model.kv_bytes_per_token_per_rank(spec.tp), spec.pd_bandwidth_gbps)
    assert spec.pd is not None
    p, d = spec.pd
    cfg = PDSimConfig(
        prefill=p,
        decode=d,
        kv_capacity_tokens=spec.kv_tokens or profile.kv_capacity_tokens,
        transfer=link,
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        prefix_caching=spec.prefix_caching,
        conditional=spec.pd_conditional,
        event_delay=spec.event_delay,
        seed=spec.seed,
    )
    return PDClusterSim(cfg, spec.policy, profile.cost)
