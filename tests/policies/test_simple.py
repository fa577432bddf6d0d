from __future__ import annotations

import random

import pytest

from kvroute.policies.simple import LeastRequests, PowerOfTwo, RandomChoice, RoundRobin
from kvroute.views import InstanceView

from ._factories import make_instances, make_request


def test_round_robin_cycles_positions() -> None:
    rr = RoundRobin()
    insts = make_instances((9, 9), (0, 0), (5, 0))
    req = make_request(10, (0, 0, 0))
    assert [rr.choose(req, insts).choice for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    d = rr.choose(req, insts)
    assert d.scores == (0.0, 1.0, 0.0)
    assert not d.lower_is_better
    # fewer instances now: counter 8 % 2 == 0
    assert rr.choose(make_request(10, (0, 0)), insts[:2]).choice == 0


LEAST_CASES = [
    # running + waiting = [3, 2, 5] -> 1
    ([(1, 2), (2, 0), (0, 5)], 1, (3.0, 2.0, 5.0)),
    # tie [2, 2, 3] -> lower index 0
    ([(2, 0), (1, 1), (3, 0)], 0, (2.0, 2.0, 3.0)),
]


@pytest.mark.parametrize(("loads", "choice", "scores"), LEAST_CASES)
def test_least_requests(loads, choice, scores) -> None:
    d = LeastRequests().choose(make_request(10, (0,) * len(loads)), make_instances(*loads))
    assert d.choice == choice
    assert d.scores == scores


def test_least_requests_tie_uses_instance_index_not_position() -> None:
    insts = [InstanceView(index=5, running=1), InstanceView(index=2, running=1)]
    assert LeastRequests().choose(make_request(10, (0, 0)), insts).choice == 1


def test_random_is_seeded_and_covers_all() -> None:
    insts = make_instances(*[(0, 0)] * 4)
    req = make_request(10, (0,) * 4)
    a, b = RandomChoice(random.Random(3)), RandomChoice(random.Random(3))
    seq = [a.choose(req, insts).choice for _ in range(60)]
    assert seq == [b.choose(req, insts).choice for _ in range(60)]
    assert set(seq) == {0, 1, 2, 3}


class FixedSample(random.Random):
    """``sample`` returns the given pair."""

    def __init__(self, pair: tuple[int, int]) -> None:
        super().__init__(0)
        self.pair = pair

    def sample(self, population, k, *, counts=None):  # type: ignore[override]
        return list(self.pair)


@pytest.mark.parametrize(
    ("pair", "choice"),
    [
        ((0, 2), 2),  # BS [4, 1, 3, 0]: 4 vs 3 -> 2
        ((3, 1), 3),  # 0 vs 1 -> 3 (never the global-min-aware pick beyond the two)
        ((1, 2), 1),  # 1 vs 3 -> 1
    ],
)
def test_p2c_picks_less_loaded_of_the_two(pair, choice) -> None:
    insts = make_instances((4, 0), (1, 0), (2, 1), (0, 0))
    d = PowerOfTwo(FixedSample(pair)).choose(make_request(10, (0,) * 4), insts)
    assert d.choice == choice
    assert d.scores == (4.0, 1.0, 3.0, 0.0)
    assert sum(d.detail["sampled"]) == 2.0


def test_p2c_tie_goes_to_lower_index() -> None:
    insts = make_instances((1, 0), (1, 0), (1, 0))
    assert PowerOfTwo(FixedSample((2, 1))).choose(make_request(10, (0, 0, 0)), insts).choice == 1


def test_p2c_seeded_sequence_and_single_instance() -> None:
    insts = make_instances((3, 0), (0, 0), (1, 0), (2, 0))
    req = make_request(10, (0,) * 4)
    a, b = PowerOfTwo(random.Random(11)), PowerOfTwo(random.Random(11))
    seq = [a.choose(req, insts).choice for _ in range(40)]
    assert seq == [b.choose(req, insts).choice for _ in range(40)]
    assert 0 not in seq  # the most loaded instance never beats its partner
    assert PowerOfTwo(random.Random(0)).choose(make_request(10, (0,)), insts[:1]).choice == 0
