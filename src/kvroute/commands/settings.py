"""The one place that maps command-line flags and YAML onto the features' settings and the router's
config: the feature flags shared by `kvroute sim`, `kvroute compare`, `kvroute serve` and `kvroute up`,
the YAML ``features:`` section, the router's YAML file, and the flags that reproduce a run.

Each feature's frozen settings class lives with the feature (:mod:`kvroute.features`); which are on is
:class:`~kvroute.features.settings.FeatureConfig`. Types and defaults come from those dataclasses' fields;
the only table here, :data:`FLAGS`, spells which flag sets which field, and adding the arguments,
parsing them and writing them back out are all driven by it.

Feature flags (every flag defaults to off; a feature's sub-flags only matter while it is on):

- ``--hotspot-mitigation`` [``--hotspot-class-tokens N``, ``--hotspot-window S``];
- ``--cold-start`` [``--cold-start-cap admit|score|none``, ``--cold-start-window S``];
- ``--score-monitor``;
- ``--load-adaptive [W]`` [``--load-threshold X``];
- ``--classes``, ``--class-weight CLASS=W`` (either turns classes on);
- ``--p-token-cap N``, ``--spot-max-tokens N`` (limits);
- ``--quota RATE:BURST``;
- ``--feature-setting FEATURE.FIELD=VALUE``: any other field of a feature that is on, e.g.
  ``hotspot.top_k=3`` (the YAML key names and types);
- simulation only (`sim`, `compare`): ``--scale-out T:N``, ``--spot-instances N``, ``--by-class``.

The router-side queue (:mod:`kvroute.routing.queue`): on by default in `sim`, `serve` and `up`
(:data:`~kvroute.policies.registry.DEFAULT_ROUTER_QUEUE`), off per arm in `compare` (an arm named
with `` +queue`` runs behind it); ``--router-queue`` / ``--no-router-queue`` [``--queue-ttl S``,
``--queue-tick S``]; in YAML the top-level key ``router_queue: false``, ``true`` or
``router_queue: {ttl_s: 30, tick_s: 0.01}``. Live, it only holds a request back where the engines'
limits are known (``--engine-max-num-batched-tokens`` / ``--engine-max-num-seqs``, YAML
``engine_limits``); without them it never does.

With a config file (`serve`, `up`), a feature's on-flag replaces that feature's section of the file;
the limits flags change only the limit they name.

YAML (every key optional; ``true`` turns a feature on with its defaults, a mapping sets fields)::

    features:
      hotspot: {window_s: 60, top_k: 5, class_tokens: 128, mitigate: true}
      cold_start: {window_s: 300, cap_mode: admit, preload_prefixes: 4}
      monitor: {window: 2000, quantile: 0.95, persist: 20}
      load_adaptive: {threshold: 0.7, bs_weight: 0.5, seq_capacity: 256}
      classes:
        weights: {ttft: 0.5, tpot: 2.0}
        users: {batch-bot: tpot}            # user field → class
        models: {my-chat-model: ttft}       # model → class
      limits: {p_token_cap: 16384, spot_max_tokens: 4096}   # spot: backends with tags: [spot]
      quota: {tokens_per_s: 2000, burst: 20000, key: user}  # key: user | api_key

The router's YAML file (``backends``, ``policy``, ..., ``features``) is read by
:func:`load_config_file`; its layout is in :mod:`kvroute.server.config`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.features.limits import QuotaConfig
from kvroute.features.mapping import FEATURES, default_of, features_from_mapping, typed
from kvroute.features.settings import FeatureConfig
from kvroute.routing.queue import QueueConfig, default_queue, queue_from_mapping
from kvroute.server.config import BackendSpec, RouterConfig, parse_backend_url
from kvroute.sim.runner import RunSpec, SimScenario

__all__ = [
    "FLAGS",
    "add_feature_arguments",
    "config_from_mapping",
    "feature_flags",
    "features_from_args",
    "features_from_mapping",
    "load_config_file",
    "parse_class_weight",
    "parse_quota",
    "parse_scale_out",
    "queue_flags",
    "queue_from_args",
    "queue_from_mapping",
    "scenario_flags",
    "scenario_from_args",
    "sim_command",
]


# ------------------------------------------------------------------------------------ value parsers


def parse_scale_out(text: str) -> tuple[float, int]:
    """``T:N`` → (seconds, instances); UserError when malformed."""
    t, sep, n = text.partition(":")
    try:
        when, count = float(t), int(n)
    except ValueError:
        raise UserError(f"--scale-out {text!r}: expected T:N, e.g. 300:4") from None
    if not sep or not when >= 0 or count < 1:
        raise UserError(f"--scale-out {text!r}: T must be >= 0 seconds and N >= 1 instances")
    return when, count


def parse_quota(text: str) -> tuple[float, float]:
    """``RATE:BURST`` (tokens/s, tokens) → floats; UserError when malformed."""
    r, sep, b = text.partition(":")
    try:
        rate, burst = float(r), float(b)
    except ValueError:
        raise UserError(f"--quota {text!r}: expected TOKENS_PER_S:BURST, e.g. 2000:20000") from None
    if not sep or not rate > 0 or not burst > 0:
        raise UserError(f"--quota {text!r}: rate and burst must be > 0")
    return rate, burst


def parse_class_weight(text: str) -> tuple[str, float]:
    """``CLASS=W`` → (class, BS exponent)."""
    c, sep, w = text.partition("=")
    try:
        weight = float(w)
    except ValueError:
        raise UserError(f"--class-weight {text!r}: expected CLASS=WEIGHT, e.g. ttft=0.5") from None
    if not sep or not c or not weight >= 0:
        raise UserError(f"--class-weight {text!r}: a class name and a weight >= 0")
    return c, weight


def _num(x: float) -> str:
    """A number as a flag value: short (``30``, ``0.7``) where that is exact, else ``repr``."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


# ------------------------------------------------------------------------------ settings classes


# ------------------------------------------------------------------------------------- the flags


@dataclass(frozen=True, slots=True)
class Flag:
    """One feature flag: ``--flag`` sets ``feature``'s ``field`` (its type and default come from the
    settings class). ``switch``: the flag turns the feature on (``field`` None: a plain on-switch)."""

    flag: str
    feature: str
    field: str | None = None
    switch: bool = False
    help: str = ""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    Flag("--hotspot-mitigation", "hotspot", switch=True, help="KV hot-spot detection and mitigation"),
    Flag(
        "--hotspot-class-tokens", "hotspot", "class_tokens", metavar="N", help="prefix-class length, tokens"
    ),
    Flag("--hotspot-window", "hotspot", "window_s", metavar="S", help="hot-spot window, seconds"),
    Flag("--cold-start", "cold_start", switch=True, help="warming instances: BS cap, +10 P-token, preload"),
    Flag("--cold-start-window", "cold_start", "window_s", metavar="S", help="warming window, seconds"),
    Flag(
        "--cold-start-cap",
        "cold_start",
        "cap_mode",
        choices=("admit", "score", "none"),
        help="BS cap of warming instances: admit (not chosen above it), score (BS in the score capped), none",
    ),
    Flag("--score-monitor", "monitor", switch=True, help="P-token×BS histogram, rolling p95 alert"),
    Flag(
        "--load-adaptive",
        "load_adaptive",
        "bs_weight",
        switch=True,
        metavar="W",
        help="above --load-threshold use score P×(BS+1)^W",
    ),
    Flag("--load-threshold", "load_adaptive", "threshold", metavar="X", help="cluster load threshold"),
    Flag("--classes", "classes", switch=True, help="request classes with per-class BS weights"),
    Flag(
        "--p-token-cap",
        "limits",
        "p_token_cap",
        switch=True,
        metavar="N",
        help="avoid instances with P-token above N",
    ),
    Flag(
        "--spot-max-tokens",
        "limits",
        "spot_max_tokens",
        switch=True,
        metavar="N",
        help="keep requests longer than this off spot instances",
    ),
)
"""The feature flags with a value of their own; ``--class-weight``, ``--quota`` and
``--feature-setting`` have composite values and are handled beside them."""

_BY_FEATURE: dict[str, list[Flag]] = {}
for _f in FLAGS:
    _BY_FEATURE.setdefault(_f.feature, []).append(_f)


def _flag_type(cls: type, name: str) -> Callable[[str], Any]:
    default = default_of(cls, name)
    if isinstance(default, bool):
        raise TypeError(f"{cls.__name__}.{name}: a bool field has no value flag")
    if default is None:  # the limits: ``int | None``
        return int
    return type(default)


def add_feature_arguments(p: argparse.ArgumentParser, simulation: bool = False, arms: bool = False) -> None:
    """The feature flags (see the module docstring); ``simulation`` adds the simulator-only ones;
    ``arms``: the command compares arms (`compare`), so the queue is off unless an arm or the flag
    says otherwise."""
    g = p.add_argument_group("production features (all off by default; also the config's 'features')")
    for f in FLAGS:
        cls = FEATURES[f.feature]
        if f.field is None:
            g.add_argument(f.flag, action="store_true", help=f.help)
            continue
        default = default_of(cls, f.field)
        shown = f" ({default})" if default is not None else ""
        if f.switch and default is not None:  # --load-adaptive [W]
            g.add_argument(
                f.flag,
                type=_flag_type(cls, f.field),
                nargs="?",
                const=default,
                default=None,
                metavar=f.metavar,
                help=f"{f.help} (W default {default})",
            )
        else:
            g.add_argument(
                f.flag,
                type=_flag_type(cls, f.field),
                choices=f.choices,
                default=None,
                metavar=f.metavar,
                help=f.help + shown,
            )
    g.add_argument(
        "--class-weight", action="append", default=[], metavar="CLASS=W", help="BS exponent of a class"
    )
    g.add_argument(
        "--quota", default=None, metavar="RATE:BURST", help="per-user token bucket (tokens/s:tokens)"
    )
    g.add_argument(
        "--feature-setting",
        action="append",
        default=[],
        metavar="FEATURE.FIELD=VALUE",
        help="any other setting of a feature that is on, by its YAML name, e.g. hotspot.top_k=3",
    )
    on = "off per arm: a policy named with ' +queue' runs behind it" if arms else "on by default"
    q = p.add_argument_group(f"router-side queue ({on}; also the config's 'router_queue')")
    q.add_argument(
        "--router-queue",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="late binding: a request whose chosen instance is saturated waits at the router "
        + ("(every arm)" if arms else "(default on; --no-router-queue: off)")
        + (
            ""
            if simulation
            else "; it only holds a request back where the engines' limits are known "
            "(--engine-max-num-batched-tokens/--engine-max-num-seqs or the config's engine_limits), "
            "else it never does"
        ),
    )
    q.add_argument(
        "--queue-ttl",
        type=float,
        default=None,
        metavar="S",
        help=f"longest wait at the router, seconds ({QueueConfig().ttl_s:g}); then 503 with Retry-After",
    )
    q.add_argument(
        "--queue-tick",
        type=float,
        default=None,
        metavar="S",
        help="decide queued requests together every S seconds (0: each at once; design §3.1: 0.01)",
    )
    if simulation:
        s = p.add_argument_group("simulated cluster")
        s.add_argument(
            "--scale-out", action="append", default=[], metavar="T:N", help="N instances join at T seconds"
        )
        s.add_argument("--spot-instances", type=int, default=0, help="tag the last N initial instances spot")
        s.add_argument("--by-class", action="store_true", help="report latencies per request class")


def _on(args: argparse.Namespace, feature: str) -> bool:
    """Does a flag turn ``feature`` on?"""
    if feature == "classes" and getattr(args, "class_weight", []):
        return True
    if feature == "quota":
        return bool(getattr(args, "quota", None))
    return any(
        (getattr(args, f.dest, None) is not None and getattr(args, f.dest, None) is not False)
        for f in _BY_FEATURE.get(feature, [])
        if f.switch
    )


def _setting_value(cls: type, name: str, text: str, where: str) -> Any:
    """``text`` as the type of ``cls.name`` (its default's type; bools: true/false), checked like YAML."""
    f = next((f for f in dataclasses.fields(cls) if f.name == name), None)
    value: Any = text
    if f is not None and f.default is not dataclasses.MISSING and not isinstance(f.default, str):
        if text in ("true", "false"):
            value = text == "true"
        elif text in ("none", "null"):
            value = None
        else:
            for convert in (int, float):
                try:
                    value = convert(text)
                    break
                except ValueError:
                    pass
    return typed(cls, {name: value}, where)[name]


def _feature_settings(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--feature-setting FEATURE.FIELD=VALUE`` → {feature: {field: value}}."""
    out: dict[str, dict[str, Any]] = {}
    for item in getattr(args, "feature_setting", []) or []:
        key, sep, text = item.partition("=")
        feature, dot, name = key.partition(".")
        where = f"--feature-setting {item!r}"
        if not sep or not dot:
            raise UserError(f"{where}: expected FEATURE.FIELD=VALUE, e.g. hotspot.top_k=3")
        cls = FEATURES.get(feature)
        if cls is None:
            raise UserError(f"{where}: unknown feature {feature!r}; known: {', '.join(FEATURES)}")
        if feature == "classes":
            raise UserError(
                f"{where}: classes are set with --class-weight (users and models: the config file)"
            )
        out.setdefault(feature, {})[name] = _setting_value(cls, name, text, where)
    return out


def _from_flags(args: argparse.Namespace, feature: str, start: Any) -> Any:
    """``start`` (or the defaults) with the feature's flags applied."""
    cls = FEATURES[feature]
    changes: dict[str, Any] = {}
    for f in _BY_FEATURE.get(feature, []):
        value = getattr(args, f.dest, None)
        if f.field is not None and value is not None:
            changes[f.field] = value
    if feature == "classes":
        weights = dict(ClassConfig().weights)
        weights.update(parse_class_weight(s) for s in getattr(args, "class_weight", []))
        changes["weights"] = tuple(weights.items())
    if feature == "quota":
        rate, burst = parse_quota(args.quota)
        changes.update(tokens_per_s=rate, burst=burst)
        return QuotaConfig(**changes) if start is None else dataclasses.replace(start, **changes)
    return dataclasses.replace(start if start is not None else cls(), **changes)


def features_from_args(
    args: argparse.Namespace, base: FeatureConfig | None = None, *, seq_capacity: int | None = None
) -> FeatureConfig:
    """The features the flags ask for, on top of ``base`` (from a config file): a feature turned on
    by a flag replaces its section of ``base`` (the limits: only the limit named); ``--feature-setting``
    then changes fields of features that are on. ``seq_capacity``: the default of
    ``load_adaptive.seq_capacity`` (the simulator: its engines' ``max_num_seqs``). Flags a command does
    not have count as absent."""
    out = base or FeatureConfig()
    changes: dict[str, Any] = {}
    for feature in FEATURES:
        if not _on(args, feature):
            continue
        start = getattr(out, feature) if feature == "limits" else None
        if feature == "load_adaptive" and seq_capacity is not None:
            start = FEATURES[feature](seq_capacity=seq_capacity)
        changes[feature] = _from_flags(args, feature, start)
    out = dataclasses.replace(out, **changes)
    for feature, fields in _feature_settings(args).items():
        current = getattr(out, feature)
        if current is None:
            raise UserError(
                f"--feature-setting {feature}.{next(iter(fields))}: the feature {feature} is not on"
            )
        out = dataclasses.replace(out, **{feature: dataclasses.replace(current, **fields)})
    return out.check()


def _unflagged(feature: str, value: Any, baseline: Any) -> Iterator[str]:
    """``--feature-setting`` flags for fields that differ from ``baseline`` and have no flag."""
    flagged = {f.field for f in _BY_FEATURE.get(feature, []) if f.field is not None}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if f.name in flagged or v == getattr(baseline, f.name):
            continue
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, int | float):
            text = _num(v) if isinstance(v, float) else str(v)
        elif isinstance(v, str):
            text = v
        else:
            raise ValueError(f"{feature}.{f.name}={v!r} has no flag (set it in a config file)")
        yield f"--feature-setting {feature}.{f.name}={text}"


def _class_flags(classes: ClassConfig) -> list[str]:
    base = ClassConfig()
    if classes.users != base.users or classes.models != base.models:
        raise ValueError("classes.users and classes.models have no flags (set them in a config file)")
    weights = dict(base.weights)
    extra = [(c, w) for c, w in classes.weights if weights.get(c) != w]
    weights.update(extra)
    if tuple(weights.items()) != classes.weights:
        raise ValueError(f"class weights {classes.weights!r} are not the defaults plus --class-weight flags")
    if not extra:
        return ["--classes"]
    return [f"--class-weight {c}={_num(w)}" for c, w in extra]


def feature_flags(features: FeatureConfig, *, seq_capacity: int | None = None) -> list[str]:
    """The flags that reproduce ``features`` through :func:`features_from_args` (with the same
    ``seq_capacity``); defaults are left out. ValueError for settings no flag can express
    (class users and models: config file only)."""
    parts: list[str] = []
    for feature, cls in FEATURES.items():
        value = getattr(features, feature)
        if value is None:
            continue
        if feature == "classes":
            parts += _class_flags(value)
            continue
        if feature == "quota":
            parts.append(f"--quota {_num(value.tokens_per_s)}:{_num(value.burst)}")
            parts += _unflagged(feature, value, QuotaConfig(value.tokens_per_s, value.burst))
            continue
        baseline = cls()
        if feature == "load_adaptive" and seq_capacity is not None:
            baseline = cls(seq_capacity=seq_capacity)
        flags = _BY_FEATURE[feature]
        if any(f.switch and f.field is None for f in flags):
            parts.append(next(f.flag for f in flags if f.switch and f.field is None))
        for f in flags:
            if f.field is None:
                continue
            v = getattr(value, f.field)
            if f.switch and default_of(cls, f.field) is not None:  # --load-adaptive W: always written
                parts.append(f"{f.flag} {_num(v)}")
            elif v != getattr(baseline, f.field):
                parts.append(f"{f.flag} {_num(v) if isinstance(v, float) else v}")
        parts += _unflagged(feature, value, baseline)
    return parts


# ------------------------------------------------------------------------------ simulated cluster


def queue_from_args(args: argparse.Namespace, base: QueueConfig | None) -> QueueConfig | None:
    """The router-side queue from the flags over ``base``, what runs when no flag says otherwise (the
    config file's, else the command's default: :func:`~kvroute.routing.queue.default_queue` for
    `sim`, `serve` and `up`; None for `compare`, whose arms say it). ``--router-queue`` turns it on
    (``base``'s settings, else the defaults), ``--no-router-queue`` off; ``--queue-ttl`` /
    ``--queue-tick`` set its fields (UserError for bad values, or for either with the queue off)."""
    ttl, tick = getattr(args, "queue_ttl", None), getattr(args, "queue_tick", None)
    flag = getattr(args, "router_queue", None)
    if flag is False:
        q = None
    elif flag and base is None:
        q = QueueConfig()
    else:
        q = base
    if q is None:
        if ttl is not None or tick is not None:
            raise UserError("--queue-ttl and --queue-tick need the router-side queue on (--router-queue)")
        return None
    if ttl is not None:
        q = dataclasses.replace(q, ttl_s=ttl)
    if tick is not None:
        q = dataclasses.replace(q, tick_s=tick)
    return q.check()


def queue_flags(queue: QueueConfig | None) -> list[str]:
    """The flags that reproduce ``queue`` in `kvroute sim` (whose default is
    :func:`~kvroute.routing.queue.default_queue`): ``--no-router-queue`` when off and the default is
    on; ``--router-queue`` and the fields that differ from the defaults when on."""
    if queue is None:
        return [] if default_queue() is None else ["--no-router-queue"]
    parts = ["--router-queue"]
    default = QueueConfig()
    if queue.ttl_s != default.ttl_s:
        parts.append(f"--queue-ttl {_num(queue.ttl_s)}")
    if queue.tick_s != default.tick_s:
        parts.append(f"--queue-tick {_num(queue.tick_s)}")
    return parts


def scenario_from_args(args: argparse.Namespace) -> SimScenario:
    """The simulator-only settings (absent flags → defaults)."""
    return SimScenario(
        scale_out=tuple(parse_scale_out(s) for s in getattr(args, "scale_out", [])),
        spot_instances=getattr(args, "spot_instances", 0),
        by_class=getattr(args, "by_class", False),
    )


def scenario_flags(scenario: SimScenario) -> list[str]:
    parts = [f"--scale-out {_num(t)}:{n}" for t, n in scenario.scale_out]
    if scenario.spot_instances:
        parts.append(f"--spot-instances {scenario.spot_instances}")
    if scenario.by_class:
        parts.append("--by-class")
    return parts


_SIM_FLAGS = (
    "seed",
    "profile",
    "profile_dir",
    "model_config",
    "tp",
    "kv_tokens",
    "max_num_seqs",
    "max_num_batched_tokens",
    "kv_view",
    "scrape_interval",
    "event_delay",
)


def sim_command(spec: RunSpec) -> str:
    """The `kvroute sim` command that reproduces ``spec``."""
    parts = ["kvroute sim"]
    parts.append(f"--trace {spec.trace}" if spec.trace else f"--workload {spec.workload}")
    if spec.fmt != "auto":
        parts.append(f"--format {spec.fmt}")
    if spec.duration:
        parts.append(f"--duration {spec.duration:g}")
    if spec.rate_scale != 1.0:
        parts.append(f"--rate-scale {spec.rate_scale:g}")
    parts += [f"--instances {spec.instances}", f"--policy {spec.policy}"]
    defaults = RunSpec()
    for name in _SIM_FLAGS:
        value = getattr(spec, name)
        if value != getattr(defaults, name):
            parts.append(f"--{name.replace('_', '-')} {value}")
    if not spec.prefix_caching:
        parts.append("--no-prefix-caching")
    parts += feature_flags(spec.features, seq_capacity=spec.max_num_seqs)
    parts += scenario_flags(spec.scenario)
    if spec.shadow:
        parts.append(f"--shadow {','.join(spec.shadow)}")
    parts += queue_flags(spec.router_queue)
    return " ".join(parts)


# ------------------------------------------------------------------------------ YAML: features


# ----------------------------------------------------------------------------- YAML: router file


def _backend_from(item: Any, where: str) -> BackendSpec:
    if isinstance(item, str):
        return BackendSpec(parse_backend_url(item))
    if isinstance(item, Mapping):
        unknown = set(item) - {f.name for f in dataclasses.fields(BackendSpec)}
        if unknown:
            raise UserError(f"{where}: unknown backend keys {sorted(unknown)}")
        url = item.get("url")
        if not isinstance(url, str):
            raise UserError(f"{where}: a backend needs a string 'url'")
        kv, rep = item.get("kv_events"), item.get("kv_replay")
        for name, val in (("kv_events", kv), ("kv_replay", rep)):
            if val is not None and not (isinstance(val, str) and val.startswith(("tcp://", "ipc://"))):
                raise UserError(f"{where}: {name} must be a tcp:// or ipc:// endpoint")
        lists = {}
        for name in ("tags", "models", "lora_adapters"):
            val = item.get(name, [])
            if not isinstance(val, list) or not all(isinstance(t, str) and t for t in val):
                raise UserError(f"{where}: a backend's {name} must be a list of strings")
            lists[name] = tuple(val)
        engine = item.get("engine")
        if engine is not None and engine not in ("vllm", "sglang"):
            raise UserError(f"{where}: a backend's engine must be vllm or sglang, not {engine!r}")
        role = item.get("role")
        if role is not None and role not in ("prefill", "decode"):
            raise UserError(f"{where}: a backend's role must be prefill or decode, not {role!r}")
        return BackendSpec(parse_backend_url(url), kv, rep, engine=engine, role=role, **lists)
    raise UserError(f"{where}: a backend is a URL string or a mapping with 'url'")


_ROUTER_FIELDS = {f.name: f for f in dataclasses.fields(RouterConfig)}
_OPTIONAL_STR = ("tokenizer", "chat_template", "admin_token", "discover_kv_events", "access_log", "record")


def config_from_mapping(data: Mapping[str, Any], where: str = "config") -> RouterConfig:
    """Build a router config from a parsed YAML mapping; raise :class:`UserError` naming the bad key."""
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: the top level must be a mapping")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "backends":
            if not isinstance(value, list):
                raise UserError(f"{where}: 'backends' must be a list")
            kwargs["backends"] = tuple(_backend_from(v, where) for v in value)
            continue
        if key == "features":
            kwargs["features"] = features_from_mapping(value, where)
            continue
        if key == "discover":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UserError(f"{where}: 'discover' must be a list of dns:// or file:// strings")
            kwargs["discover"] = tuple(value)
            continue
        if key == "peers":  # a list of endpoints (checked by RouterConfig.validate)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UserError(f"{where}: 'peers' must be a list of tcp://HOST:PORT or dns://NAME:PORT")
            kwargs["peers"] = tuple(value)
            continue
        if key == "router_queue":
            kwargs["router_queue"] = queue_from_mapping(value, where)
            continue
        if key == "engine_limits":
            kwargs["engine_limits"] = _engine_limits(value, where)
            continue
        if key == "shadow":  # shadow policies: a list or "a,b" (names checked by RouterConfig.validate)
            if isinstance(value, str):
                value = value.split(",")
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise UserError(f"{where}: 'shadow' must be a list of policy names")
            kwargs["shadow"] = tuple(v.strip() for v in value if v.strip())
            continue
        f = _ROUTER_FIELDS.get(key)
        if f is None:
            raise UserError(f"{where}: unknown key {key!r}")
        default = f.default
        if value is None and default is not None:  # a key left empty: its default, as if absent
            continue
        if key in _OPTIONAL_STR and value is not None and not isinstance(value, str):
            raise UserError(f"{where}: {key} must be a string, got {type(value).__name__}")
        if value is not None and default is not None and default is not dataclasses.MISSING:
            want = type(default)
            if want is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, want) or isinstance(value, bool) != isinstance(default, bool):
                raise UserError(f"{where}: {key} must be a {want.__name__}, got {value!r}")
            if want in (int, float) and not isinstance(value, bool) and not 0 <= value < float("inf"):
                raise UserError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
            if key == "port" and value > 65535:
                raise UserError(f"{where}: port must be in 0..65535, got {value}")
        kwargs[key] = value
    kwargs.setdefault("backends", ())
    return RouterConfig(**kwargs)


def _engine_limits(value: Any, where: str) -> tuple[int, int]:
    """The YAML ``engine_limits: {max_num_batched_tokens: N, max_num_seqs: N}`` (each optional)."""
    if not isinstance(value, Mapping):
        raise UserError(f"{where}: engine_limits must be a mapping")
    out = {"max_num_batched_tokens": 0, "max_num_seqs": 0}
    for k, v in value.items():
        if k not in out:
            raise UserError(f"{where}: engine_limits: unknown key {k!r}; known: {', '.join(out)}")
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"{where}: engine_limits: {k} must be an integer >= 0, got {v!r}")
        out[k] = v
    return out["max_num_batched_tokens"], out["max_num_seqs"]


def backends_from_text(text: str, where: str) -> tuple[BackendSpec, ...]:
    """Backends listed in a discovery file (``--discover file://PATH``): YAML, a list like the
    config's ``backends:`` or a mapping with only ``backends:``; or plain text, one URL per line
    (``#`` comments). Raises :class:`UserError` naming ``where``."""
    import yaml

    from kvroute.server.sync.discovery import parse_backends_text

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: invalid YAML: {exc}") from None
    if data is None:
        return ()
    if isinstance(data, list):
        data = {"backends": data}
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"backends"})
        if extra:
            raise UserError(f"{where}: only 'backends' may be listed, not {extra}")
        return config_from_mapping(data, where).backends
    return parse_backends_text(text, where)  # plain lines (YAML reads them as one string)


def load_config_file(path: str | Path) -> RouterConfig:
    """Read a router YAML file (see the module docstring). Raises :class:`UserError` on any problem."""
    import yaml

    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read config {p}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UserError(f"{p}: invalid YAML: {exc}") from None
    return config_from_mapping(data or {}, str(p))
