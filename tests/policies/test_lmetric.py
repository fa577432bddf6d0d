from __future__ import annotations

import pytest

from kvroute.policies.lmetric import LMetric
from kvroute.views import InstanceView

from ._factories import make_instances, make_request

# (prompt, cached, loads (running, waiting, queued), expected choice, expected scores)
CASES = [
    # P = [1000-0+0, 1000-800+0, 1000-0+0] = [1000, 200, 1000]; BS+1 = [1, 5, 1]
    # scores = [1000, 1000, 1000] -> all tie -> lower BS (pos 0, pos 2 BS 0) -> lower index -> 0
    (1000, (0, 800, 0), [(0, 0), (3, 1), (0, 0)], 0, (1000, 1000, 1000)),
    # P = [1000, 200, 1000]; BS+1 = [3, 4, 2] -> scores [3000, 800, 2000] -> 1
    (1000, (0, 800, 0), [(2, 0), (2, 1), (1, 0)], 1, (3000, 800, 2000)),
    # queued prefill counts: P = [100-64+500, 100-0+0, 100-0+50] = [536, 100, 150]; BS+1 = [2, 3, 2]
    # scores = [1072, 300, 300] -> tie 1 vs 2 -> lower BS -> 2
    (100, (64, 0, 0), [(1, 0, 500), (2, 0, 0), (1, 0, 50)], 2, (1072, 300, 300)),
    # full hits everywhere: P = [0, 0], scores [0, 0] -> lower BS -> 1
    (32, (32, 32), [(5, 5), (1, 0)], 1, (0, 0)),
]


@pytest.mark.parametrize(("prompt", "cached", "loads", "choice", "scores"), CASES)
def test_lmetric_table(prompt, cached, loads, choice, scores) -> None:
    d = LMetric().choose(make_request(prompt, cached), make_instances(*loads))
    assert d.choice == choice
    assert d.scores == scores
    assert d.lower_is_better
    assert d.policy == "lmetric"


def test_lmetric_detail() -> None:
    d = LMetric().choose(make_request(100, (64, 0)), make_instances((1, 2, 10), (0, 0)))
    assert d.detail == {"p_token": (46, 100), "bs": (3, 0)}


def test_lmetric_tie_goes_to_lower_instance_index_not_position() -> None:
    insts = [InstanceView(index=7, running=1), InstanceView(index=3, running=1)]
    # P = [50, 50], BS equal -> scores equal -> index 3 (position 1)
    assert LMetric().choose(make_request(50, (0, 0)), insts).choice == 1


def test_lmetric_bs_weight() -> None:
    # P = [100, 400]; BS+1 = [9, 1]; w=1 -> [900, 400] -> 1; w=0.5 -> [300, 400] -> 0
    req = make_request(400, (300, 0))
    insts = make_instances((8, 0), (0, 0))
    assert LMetric().choose(req, insts).choice == 1
    d = LMetric(bs_weight=0.5).choose(req, insts)
    assert d.choice == 0
    assert d.scores == pytest.approx((300.0, 400.0))
    # w=0 ignores load entirely: pure P-token
    assert LMetric(bs_weight=0.0).choose(req, insts).scores == (100.0, 400.0)


def test_lmetric_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError):
        LMetric(bs_weight=-1.0)
    with pytest.raises(ValueError):
        LMetric().choose(make_request(10, ()), [])
    with pytest.raises(ValueError):
        LMetric().choose(make_request(10, (0,)), make_instances((0, 0), (0, 0)))
