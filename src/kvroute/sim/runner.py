"""One simulation run from a picklable spec: what `kvroute sim`, `kvroute compare` (in worker
processes) and the benchmarks call."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvroute.errors import UserError

SAMPLE_POINTS = 2000
"""Most per-request points ``run_spec`` returns per metric with ``keep_samples`` (evenly spaced quantiles)."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """Everything that defines a run. Exactly one of ``trace``/``workload``; exactly one (or none:
    the default profile) of ``profile``/``profile_dir``. ``kv_tokens`` overrides the profile's KV
    capacity per instance (tokens). Times in seconds."""

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
    tp: int = 1
    kv_tokens: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    kv_view: str = "exact"
    scrape_interval: float = 0.05
    event_delay: float = 0.002
    # Production features (kvroute.features, `kvroute sim` flags of the same names; all off by default).
    hotspot_mitigation: bool = False
    hotspot_class_tokens: int = 128
    hotspot_window: float = 60.0
    cold_start: bool = False
    cold_start_window: float = 300.0
    cold_start_cap: str = "admit"  # admit | score | none
    scale_out: tuple[tuple[float, int], ...] = ()  # (time s, instances joining)
    score_monitor: bool = False
    load_adaptive: float | None = None  # BS exponent above load_threshold; None: off
    load_threshold: float = 0.7
    classes: bool = False
    class_weights: tuple[tuple[str, float], ...] = ()
    by_class: bool = False
    p_token_cap: int | None = None
    spot_instances: int = 0
    spot_max_tokens: int | None = None
    quota: tuple[float, float] | None = None  # (tokens per s, burst tokens) per user
    # Opt-in: also return ``out["samples"]`` (TTFT/TPOT quantile points in ms, at most
    # ``SAMPLE_POINTS``) for CDF plots. Not a `kvroute sim` flag; it does not change the run.
    keep_samples: bool = False

    def command_line(self) -> str:
        """The `kvroute sim` command that reproduces this run."""
        parts = ["kvroute sim"]
        parts.append(f"--trace {self.trace}" if self.trace else f"--workload {self.workload}")
        if self.fmt != "auto":
            parts.append(f"--format {self.fmt}")
        if self.duration:
            parts.append(f"--duration {self.duration:g}")
        if self.rate_scale != 1.0:
            parts.append(f"--rate-scale {self.rate_scale:g}")
        parts += [f"--instances {self.instances}", f"--policy {self.policy}"]
        defaults = RunSpec()
        for name in (
            "seed",
            "profile",
            "profile_dir",
            "tp",
            "kv_tokens",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_view",
            "scrape_interval",
            "event_delay",
        ):
            value = getattr(self, name)
            if value != getattr(defaults, name):
                parts.append(f"--{name.replace('_', '-')} {value}")
        from kvroute.features.flags import feature_command_flags

        parts += feature_command_flags(self)
        return " ".join(parts)


def load_profile(spec: RunSpec) -> Any:
    from kvroute.engine.cost import DEFAULT_PROFILE, get_profile, profile_from_dir

    if spec.profile and spec.profile_dir:
        raise UserError("give --profile or --profile-dir, not both")
    if spec.profile_dir:
        return profile_from_dir(spec.profile_dir, tp=spec.tp)
    return get_profile(spec.profile or DEFAULT_PROFILE)


def run_spec(spec: RunSpec, progress: Callable[[float, int, int], None] | None = None) -> dict[str, Any]:
    """Run one simulation; returns the contract's summary dict plus ``profile``, ``workload``,
    ``rate_scale``, ``skipped_lines`` and ``command`` (and ``samples`` with ``spec.keep_samples``)."""
    from kvroute.features.flags import features_from_spec
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
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        kv_view=spec.kv_view,
        scrape_interval=spec.scrape_interval,
        event_delay=spec.event_delay,
        seed=spec.seed,
        scale_out=spec.scale_out,
        spot_instances=spec.spot_instances,
        by_class=spec.by_class or spec.classes or bool(spec.class_weights),
    )
    cfg.check()
    policy = build_policy(spec.policy, features_from_spec(spec), random.Random(spec.seed))
    stream, stats = open_workload(
        spec.trace, spec.fmt, spec.workload, spec.rate_scale, spec.duration, spec.seed, spec.skip_bad_lines
    )
    sim = ClusterSim(cfg, policy, profile.cost)
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
    out["command"] = spec.command_line()
    return out
