"""The one flag set and YAML mapping of the features (kvroute.commands.settings): round trips, the
flag set shared by sim, compare and serve, one-line errors naming the bad key."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.cli import build_parser, main
from kvroute.commands.settings import (
    FEATURES,
    FLAGS,
    add_feature_arguments,
    feature_flags,
    features_from_args,
    features_from_mapping,
    sim_command,
)
from kvroute.commands.sim import spec_from_args
from kvroute.errors import UserError
from kvroute.features.classes import ClassConfig
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.limits import LimitsConfig, QuotaConfig
from kvroute.features.loadadapt import LoadAdaptiveConfig
from kvroute.features.monitor import ScoreMonitorConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import DEFAULT_POLICY, DEFAULT_ROUTER_QUEUE
from kvroute.routing.queue import QueueConfig, default_queue
from kvroute.sim.runner import RunSpec, SimScenario

floats = st.floats(min_value=0.001, max_value=1e6, allow_nan=False, allow_infinity=False)
fractions = st.floats(min_value=0.01, max_value=0.99)
counts = st.integers(min_value=1, max_value=5000)

hotspots = st.builds(
    HotspotConfig,
    window_s=floats,
    top_k=counts,
    class_tokens=counts,
    streak_factor=floats,
    min_window_requests=counts,
    rank_interval_s=floats,
    exclude_hot=st.booleans(),
    mitigate=st.booleans(),
)
cold_starts = st.builds(
    ColdStartConfig,
    window_s=floats,
    bs_cap_fraction=fractions,
    p_token_offset=st.integers(0, 100),
    preload_prefixes=st.integers(0, 10),
    cap_mode=st.sampled_from(["admit", "score", "none"]),
)
monitors = st.builds(ScoreMonitorConfig, persist=counts, quantile=fractions)
load_adaptives = st.builds(LoadAdaptiveConfig, threshold=fractions, bs_weight=floats, seq_capacity=counts)
weights = st.dictionaries(st.sampled_from(["ttft", "tpot", "batch", "bulk"]), floats, max_size=3)
classes = weights.map(lambda w: ClassConfig(weights=tuple(({**dict(ClassConfig().weights), **w}).items())))
limits = st.builds(
    LimitsConfig,
    p_token_cap=st.none() | counts,
    spot_max_tokens=st.none() | counts,
    spot_tag=st.sampled_from(["spot", "preemptible"]),
).filter(lambda lim: lim.active)
quotas = st.builds(QuotaConfig, tokens_per_s=floats, burst=floats, key=st.sampled_from(["user", "api_key"]))
feature_configs = st.builds(
    FeatureConfig,
    hotspot=st.none() | hotspots,
    cold_start=st.none() | cold_starts,
    monitor=st.none() | monitors,
    load_adaptive=st.none() | load_adaptives,
    classes=st.none() | classes,
    limits=st.none() | limits,
    quota=st.none() | quotas,
)


def _parser(simulation: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_feature_arguments(p, simulation)
    return p


@settings(max_examples=200, deadline=None)
@given(feature_configs, st.none() | counts)
def test_feature_config_to_flags_and_back_is_the_same(features: FeatureConfig, capacity: int | None) -> None:
    argv = shlex.split(" ".join(feature_flags(features, seq_capacity=capacity)))
    assert features_from_args(_parser().parse_args(argv), seq_capacity=capacity) == features


@settings(max_examples=50, deadline=None)
@given(
    feature_configs,
    st.lists(st.tuples(st.floats(0, 1e4), st.integers(1, 8)), max_size=2),
    st.integers(0, 4),
    st.booleans(),
    st.sampled_from([64, 256]),
    st.sampled_from([None, QueueConfig(), QueueConfig(ttl_s=5.0, tick_s=0.01)]),
)
def test_sim_command_parses_back_to_the_same_spec(
    features: FeatureConfig,
    scale_out: list[tuple[float, int]],
    spot: int,
    by_class: bool,
    seqs: int,
    queue: QueueConfig | None,
) -> None:
    if features.load_adaptive is not None:  # `kvroute sim` defaults the capacity to --max-num-seqs
        la = dataclasses.replace(features.load_adaptive, seq_capacity=seqs)
        features = dataclasses.replace(features, load_adaptive=la)
    spec = RunSpec(
        workload="coder",
        instances=8,
        max_num_seqs=seqs,
        duration=12.5,
        features=features,
        scenario=SimScenario(tuple(scale_out), spot, by_class),
        router_queue=queue,
    )
    argv = shlex.split(sim_command(spec).removeprefix("kvroute "))
    args = build_parser().parse_args(argv)
    # as `kvroute sim` reads it: its queue is on unless the command says otherwise
    assert spec_from_args(args, args.policy, queue=default_queue()) == spec


def test_every_feature_has_flags_and_every_flag_a_field() -> None:
    p = _parser()
    for feature in FEATURES:  # each feature can be turned on from the command line
        assert feature_flags(FeatureConfig(**{feature: _example(feature)}))
    for f in FLAGS:
        assert f.feature in FEATURES
        if f.field is not None:
            assert f.field in {x.name for x in dataclasses.fields(FEATURES[f.feature])}
    assert p.parse_args([]).feature_setting == []


def _example(feature: str) -> object:
    return (
        QuotaConfig(1.0, 2.0)
        if feature == "quota"
        else FEATURES[feature](**({"p_token_cap": 10} if feature == "limits" else {}))
    )


@pytest.mark.parametrize("command", ["sim", "compare", "serve", "up"])
def test_sim_compare_serve_and_up_share_the_feature_flags(command: str) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    flags = {s for a in sub._actions for s in a.option_strings}
    shared = {f.flag for f in FLAGS} | {"--class-weight", "--quota", "--feature-setting"}
    assert shared <= flags
    simulated = {"--scale-out", "--spot-instances", "--by-class"}
    assert (simulated <= flags) == (command in ("sim", "compare"))


def test_serve_flags_change_only_the_features_they_name() -> None:
    base = features_from_mapping(
        {"hotspot": {"window_s": 10}, "limits": {"spot_max_tokens": 50}, "monitor": {"persist": 3}}
    )
    argv = ["--hotspot-mitigation", "--hotspot-window", "30", "--p-token-cap", "100"]
    argv += ["--load-adaptive", "0.25", "--load-threshold", "0.5", "--feature-setting", "monitor.persist=7"]
    f = features_from_args(_parser().parse_args(argv), base)
    assert f.hotspot == HotspotConfig(window_s=30.0)  # replaced, then the sub-flag
    assert f.limits == LimitsConfig(p_token_cap=100, spot_max_tokens=50)  # merged
    assert f.load_adaptive == LoadAdaptiveConfig(threshold=0.5, bs_weight=0.25)
    assert f.monitor == ScoreMonitorConfig(persist=7)


def test_sub_flags_without_their_feature_change_nothing() -> None:
    args = _parser().parse_args(
        ["--hotspot-window", "30", "--cold-start-cap", "score", "--load-threshold", "0.2"]
    )
    assert features_from_args(args) == FeatureConfig()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--feature-setting", "hotspot.top_k=3"], "the feature hotspot is not on"),
        (["--hotspot-mitigation", "--feature-setting", "hotspot.topk=3"], "unknown key 'topk'"),
        (["--hotspot-mitigation", "--feature-setting", "hotspot.top_k=lots"], "top_k must be a int"),
        (["--feature-setting", "turbo.x=1"], "unknown feature 'turbo'"),
        (["--feature-setting", "hotspot"], "expected FEATURE.FIELD=VALUE"),
        (["--classes", "--feature-setting", "classes.users=x"], "--class-weight"),
        (["--quota", "5"], "--quota '5'"),
        (["--class-weight", "ttft"], "--class-weight 'ttft'"),
        (["--cold-start", "--feature-setting", "cold_start.cap_mode=x"], "cap mode"),
    ],
)
def test_bad_feature_flags_give_one_line_naming_the_flag(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(UserError) as exc:
        features_from_args(_parser().parse_args(argv))
    assert needle in str(exc.value) and "\n" not in str(exc.value)
    assert main(["sim", "--workload", "coder", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_settings_no_flag_can_express_are_refused() -> None:
    with pytest.raises(ValueError, match="users"):
        feature_flags(FeatureConfig(classes=ClassConfig(users=(("u", "ttft"),))))


def test_run_spec_with_features_pickles() -> None:
    spec = RunSpec(
        workload="coder",
        features=FeatureConfig(hotspot=HotspotConfig(top_k=2), quota=QuotaConfig(5.0, 9.0)),
        scenario=SimScenario(scale_out=((3.0, 1),)),
    )
    assert pickle.loads(pickle.dumps(spec)) == spec and hash(spec) == hash(pickle.loads(pickle.dumps(spec)))


@pytest.mark.parametrize("command", ["sim", "compare", "serve", "up"])
def test_every_command_has_the_queue_flags(command: str) -> None:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--router-queue", "--queue-ttl", "--queue-tick"} <= flags
    assert ("--engine-max-num-batched-tokens" in flags) == (command in ("serve", "up"))


def test_router_yaml_queue_and_engine_limits() -> None:
    from kvroute.commands.settings import config_from_mapping
    from kvroute.routing.queue import QueueConfig

    cfg = config_from_mapping(
        {
            "backends": ["http://127.0.0.1:8000"],
            "router_queue": {"ttl_s": 5, "tick_s": 0.01},
            "engine_limits": {"max_num_batched_tokens": 8192},
        }
    )
    assert cfg.router_queue == QueueConfig(ttl_s=5.0, tick_s=0.01) and cfg.engine_limits == (8192, 0)
    assert config_from_mapping({"backends": [], "router_queue": True}).router_queue == QueueConfig()
    assert config_from_mapping({"backends": [], "router_queue": False}).router_queue is None
    # a key left empty (YAML null) changes nothing: the default, on
    assert config_from_mapping({"backends": [], "router_queue": None}).router_queue == QueueConfig()
    for bad, needle in (
        ({"router_queue": "yes"}, "router_queue must be true, false or a mapping"),
        (
            {"router_queue": {"ttl_s": None}},
            "r.yaml: router_queue: ttl_s must be a number of seconds, got null",
        ),
        ({"router_queue": {"tick_s": True}}, "tick_s must be a float"),
        ({"router_queue": {"ttl": 3}}, "unknown key 'ttl'"),
        ({"engine_limits": {"max_num_seqs": -1}}, "max_num_seqs must be an integer >= 0"),
        ({"engine_limits": {"seqs": 4}}, "unknown key 'seqs'"),
    ):
        with pytest.raises(UserError, match=needle):
            config_from_mapping({"backends": [], **bad}, "r.yaml")


def test_serve_queue_flags_over_the_file() -> None:
    from kvroute.commands.serve import with_feature_flags
    from kvroute.routing.queue import QueueConfig
    from kvroute.server.config import RouterConfig

    sub = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    args = sub.parse_args(["--queue-tick", "0.02", "--engine-max-num-seqs", "64"])
    base = RouterConfig(backends=(), router_queue=QueueConfig(ttl_s=9.0), engine_limits=(4096, 256))
    cfg = with_feature_flags(base, args)
    assert cfg.router_queue == QueueConfig(ttl_s=9.0, tick_s=0.02) and cfg.engine_limits == (4096, 64)
    off = with_feature_flags(RouterConfig(backends=()), sub.parse_args(["--no-router-queue"]))
    assert off.router_queue is None


def _sub(command: str) -> argparse.ArgumentParser:
    return build_parser()._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr,no-any-return]


def test_the_default_runs_behind_the_queue_in_sim_and_no_router_queue_turns_it_off() -> None:
    sim = _sub("sim")
    assert DEFAULT_ROUTER_QUEUE and default_queue() == QueueConfig()
    on = spec_from_args(sim.parse_args([]), DEFAULT_POLICY, queue=default_queue())
    assert on.policy == DEFAULT_POLICY and on.router_queue == QueueConfig(ttl_s=30.0, tick_s=0.0)
    assert spec_from_args(sim.parse_args(["--router-queue"]), "x", queue=default_queue()).router_queue == (
        QueueConfig()
    )
    ttl = spec_from_args(sim.parse_args(["--queue-ttl", "5"]), "x", queue=default_queue())
    assert ttl.router_queue == QueueConfig(ttl_s=5.0)
    off = sim.parse_args(["--no-router-queue"])
    assert spec_from_args(off, "x", queue=default_queue()).router_queue is None
    for bad in (["--no-router-queue", "--queue-ttl", "5"], ["--no-router-queue", "--queue-tick", "0.01"]):
        with pytest.raises(UserError, match="need the router-side queue on"):
            spec_from_args(sim.parse_args(bad), "x", queue=default_queue())


def test_kvroute_sim_runs_the_default_behind_the_queue(tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    argv = ["sim", "--workload", "chatbot", "--instances", "2", "--duration", "3", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 0
    on = json.loads(out.read_text())
    assert on["policy"] == DEFAULT_POLICY and "router_queue" in on  # the queue's own counters
    assert main([*argv, "--no-router-queue", "--json", str(out)]) == 0
    assert "router_queue" not in json.loads(out.read_text())
    assert main([*argv, "--no-router-queue", "--queue-ttl", "3"]) == 2


def test_serve_and_up_queue_on_by_default_off_by_flag_or_config(tmp_path: Path) -> None:
    from kvroute.commands.serve import config_from_args, with_feature_flags
    from kvroute.commands.settings import config_from_mapping
    from kvroute.server.config import RouterConfig

    assert RouterConfig(backends=()).router_queue == QueueConfig() == default_queue()
    for command in ("serve", "up"):
        sub = _sub(command)
        base = RouterConfig(backends=())
        assert with_feature_flags(base, sub.parse_args([])).router_queue == QueueConfig()
        assert with_feature_flags(base, sub.parse_args(["--router-queue"])).router_queue == QueueConfig()
        assert with_feature_flags(base, sub.parse_args(["--no-router-queue"])).router_queue is None
        ttl = with_feature_flags(base, sub.parse_args(["--queue-ttl", "7"]))
        assert ttl.router_queue == QueueConfig(ttl_s=7.0)
        with pytest.raises(UserError, match="need the router-side queue on"):
            with_feature_flags(base, sub.parse_args(["--no-router-queue", "--queue-tick", "0.01"]))
    # the config file: absent → on; false → off (and a flag over it); true / a mapping → on
    assert config_from_mapping({"backends": []}).router_queue == QueueConfig()
    off = config_from_mapping({"backends": [], "router_queue": False})
    assert off.router_queue is None
    serve = _sub("serve")
    assert with_feature_flags(off, serve.parse_args([])).router_queue is None
    assert with_feature_flags(off, serve.parse_args(["--router-queue"])).router_queue == QueueConfig()
    with pytest.raises(UserError, match="need the router-side queue on"):
        with_feature_flags(off, serve.parse_args(["--queue-ttl", "3"]))
    cfg = tmp_path / "r.yaml"
    cfg.write_text("backends: [http://127.0.0.1:9]\nrouter_queue: false\n")
    assert config_from_args(serve.parse_args(["--config", str(cfg)])).router_queue is None
    cfg.write_text("backends: [http://127.0.0.1:9]\nrouter_queue: {ttl_s: 4}\n")
    assert config_from_args(serve.parse_args(["--config", str(cfg)])).router_queue == QueueConfig(ttl_s=4.0)
    assert (
        config_from_args(serve.parse_args(["--config", str(cfg), "--no-router-queue"])).router_queue is None
    )
    assert main(["serve", "--backend", "http://127.0.0.1:9", "--no-router-queue", "--queue-ttl", "3"]) == 2


def test_the_start_up_line_says_whether_the_queue_can_hold_anything() -> None:
    import dataclasses

    from kvroute.server.config import RouterConfig, queue_note

    base = RouterConfig(backends=())
    assert queue_note(dataclasses.replace(base, router_queue=None)) == "router-queue=off"
    assert queue_note(base).startswith("router-queue=on (idle: engine limits unknown")
    limited = dataclasses.replace(base, engine_limits=(8192, 0))
    assert queue_note(limited) == "router-queue=on (engine limits: 8192 batched tokens, ? sequences)"


def test_up_takes_the_engines_limits_for_vllm_only(capsys: pytest.CaptureFixture[str]) -> None:
    from kvroute.commands.serve import with_feature_flags
    from kvroute.server.config import RouterConfig

    up = _sub("up")
    args = up.parse_args(["--engine-max-num-batched-tokens", "2048", "--engine-max-num-seqs", "64"])
    assert with_feature_flags(RouterConfig(backends=()), args).engine_limits == (2048, 64)
    # the emulated engines' limits are known: a flag that says otherwise is refused, not ignored
    assert main(["up", "--instances", "1", "--engine-max-num-seqs", "64"]) == 2
    assert "are for --engine vllm" in capsys.readouterr().err


def test_compare_arms_keep_their_queue_explicit() -> None:
    """The default's queue does not leak into compare: an arm runs behind the queue only when named
    with ' +queue' (or every arm with --router-queue), as before the default had it."""
    from kvroute.sim.compare import DEFAULT_ARM, arm_spec

    compare = _sub("compare")
    args = compare.parse_args(["--workload", "chatbot", "--policies", "x"])
    base = spec_from_args(args, "lmetric")
    assert base.router_queue is None
    assert arm_spec(base, "lmetric").router_queue is None
    assert arm_spec(base, DEFAULT_POLICY).router_queue is None  # the default policy, named bare
    assert arm_spec(base, DEFAULT_ARM).router_queue == QueueConfig()
    assert arm_spec(base, "vllm +queue").router_queue == QueueConfig()
    every = spec_from_args(compare.parse_args(["--workload", "chatbot", "--router-queue"]), "lmetric")
    assert arm_spec(every, "lmetric").router_queue == QueueConfig()
    no = spec_from_args(compare.parse_args(["--workload", "chatbot", "--no-router-queue"]), "lmetric")
    assert arm_spec(no, "lmetric").router_queue is None
    assert arm_spec(no, DEFAULT_ARM).router_queue == QueueConfig()


@pytest.mark.parametrize(
    "key", ["max_body_bytes", "max_response_bytes", "health_interval_s", "port", "policy"]
)
def test_a_typed_key_left_empty_in_the_yaml_is_its_default(key: str) -> None:
    """Regression: ``max_body_bytes:`` with no value (YAML null) reached the range checks as None and
    stopped start-up with a TypeError traceback; it means the default, as for ``router_queue``."""
    from kvroute.commands.settings import config_from_mapping
    from kvroute.server.config import RouterConfig

    cfg = config_from_mapping({"backends": ["http://127.0.0.1:8000"], key: None})
    cfg.validate()
    assert getattr(cfg, key) == getattr(RouterConfig(backends=()), key)
