from __future__ import annotations

import random

import pytest

from kvroute.errors import UserError
from kvroute.policies import POLICIES, Policy, make_policy, policy_names
from kvroute.policies.linear import LinearCombo
from kvroute.policies.lmetric import LMetric


def test_names_match_registry() -> None:
    assert policy_names() == list(POLICIES)
    assert "lmetric" in policy_names()


@pytest.mark.parametrize("name", policy_names())
def test_every_name_builds_a_policy(name: str) -> None:
    policy = make_policy(name, random.Random(1))
    assert isinstance(policy, Policy)
    assert policy.name == name


def test_fresh_instances() -> None:
    assert make_policy("round-robin") is not make_policy("round-robin")


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(UserError) as exc:
        make_policy("nope")
    for name in policy_names():
        assert name in str(exc.value)


@pytest.mark.parametrize(
    "name",
    [
        "lmetric:abc",
        "lmetric:-1",
        "lmetric:",
        "round-robin:3",
        "p2c:x",
        "linear:abc",
        "linear:1.5",
        "linear:-0.1",
        "linear:nan",
        "vllm:v9",
        "bailian:sum",
        "aibrix:1",
    ],
)
def test_bad_parameters(name: str) -> None:
    with pytest.raises(UserError):
        make_policy(name)


def test_lmetric_param_sets_bs_weight() -> None:
    p = make_policy("lmetric:0.5")
    assert isinstance(p, LMetric)
    assert p.bs_weight == 0.5
    assert p.name == "lmetric:0.5"


def test_linear_params() -> None:
    p = make_policy("linear")
    assert isinstance(p, LinearCombo)
    assert p.lam == 0.7
    assert p.name == "linear"
    q = make_policy("linear:0.55")
    assert isinstance(q, LinearCombo)
    assert q.lam == 0.55
    assert q.name == "linear:0.55"


def test_variants() -> None:
    assert make_policy("vllm:new").name == "vllm:new"
    assert make_policy("bailian:minmax").name == "bailian:minmax"
