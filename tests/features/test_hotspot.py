"""Hot-spot detector: the alarm condition at its boundary, stage-2 streak counting, clearing, ranking."""

from __future__ import annotations

from fractions import Fraction

import pytest

from kvroute.errors import UserError
from kvroute.features.hotspot import HotspotConfig, HotspotDetector, alarm_condition
from kvroute.features.prefix import class_blocks, prefix_class
from kvroute.features.window import SlidingCounts


@pytest.mark.parametrize(
    ("n_c", "total", "m", "n"),
    [(1, 4, 4, 16), (1, 2, 8, 16), (3, 16, 3, 16), (5, 20, 4, 16), (6, 12, 2, 4)],
)
def test_alarm_condition_exactly_equal_does_not_fire_just_above_does(
    n_c: int, total: int, m: int, n: int
) -> None:
    # the fixtures sit exactly on x/(1-x) == |M|/(N-|M|)
    x = Fraction(n_c, total)
    assert x / (1 - x) == Fraction(m, n - m)
    assert not alarm_condition(n_c, total, m, n)
    # one more class request (and one more in the window): x/(1-x) just above
    assert alarm_condition(n_c + 1, total + 1, m, n)
    # one more non-class request: just below
    assert not alarm_condition(n_c, total + 1, m, n)


def test_alarm_condition_edge_cases() -> None:
    assert not alarm_condition(10, 10, 0, 16)  # nobody caches it: nothing to protect
    assert not alarm_condition(10, 10, 16, 16)  # everybody caches it
    assert alarm_condition(10, 10, 15, 16)  # x = 1 with one instance left out
    assert not alarm_condition(0, 10, 1, 16)


def _det(**kw: object) -> HotspotDetector:
    base: dict[str, object] = {"min_window_requests": 1, "rank_interval_s": 0.0}
    base.update(kw)
    return HotspotDetector(HotspotConfig(**base))  # type: ignore[arg-type]


def test_stage_two_needs_more_than_two_m_consecutive_requests_into_m() -> None:
    det = _det()
    key, m, n = 7, 2, 16
    t = 0.0
    assert not det.observe(key, m, n, t)  # x = 1 > 2/16: alarm raised, not mitigating yet
    assert det.alarms == 1 and det.mitigations == 0
    det.routed(key, True, t)
    for _ in range(2 * m - 1):  # streak reaches 2|M| = 4: not more than 2|M| yet
        t += 0.1
        assert not det.observe(key, m, n, t)
        det.routed(key, True, t)
    assert det.mitigations == 0
    t += 0.1
    assert not det.observe(key, m, n, t)
    det.routed(key, True, t)  # streak 5 > 4
    assert det.mitigations == 1
    t += 0.1
    assert det.observe(key, m, n, t)  # the next request of the class is mitigated
    assert det.mitigated_requests == 1
    assert [e.kind for e in det.events] == ["alarm", "mitigation"]


def test_a_request_routed_outside_m_resets_the_streak() -> None:
    det = _det()
    key, m, n = 9, 1, 8
    t = 0.0
    det.observe(key, m, n, t)
    det.routed(key, True, t)
    det.routed(key, True, t)  # streak 2 = 2|M|
    det.observe(key, m, n, t)
    det.routed(key, False, t)  # spilled out of M: streak 0
    for _ in range(2):
        det.observe(key, m, n, t)
        det.routed(key, True, t)
    assert det.mitigations == 0
    det.observe(key, m, n, t)
    det.routed(key, True, t)
    assert det.mitigations == 1


def test_spread_all_mitigates_every_request_until_the_condition_clears() -> None:
    det = _det(streak_factor=0.0, spread="all")
    key = 3
    det.observe(key, 1, 4, 0.0)
    det.routed(key, True, 0.0)  # streak 1 > 0
    assert det.observe(key, 1, 4, 0.1)
    assert det.observe(key, 2, 4, 0.2)  # |M| grew, x = 1 still > 2/4
    assert not det.observe(key, 4, 4, 0.3)  # every instance caches it: clear
    assert det.clears == 1 and det.active_alarms == 0
    assert [e.kind for e in det.events] == ["alarm", "mitigation", "clear"]


def test_min_window_requests_and_window_expiry() -> None:
    det = _det(min_window_requests=3, window_s=10.0)
    assert not det.observe(5, 1, 16, 0.0)
    assert not det.observe(5, 1, 16, 1.0)
    assert det.alarms == 0  # 2 requests in the window < 3
    det.observe(5, 1, 16, 2.0)
    assert det.alarms == 1
    det.observe(0, 0, 16, 12.5)  # the three class requests left the window
    assert det.window.count.get(5) is None and det.window.total == 1


def test_only_top_k_classes_by_hits_are_monitored() -> None:
    det = _det(top_k=1)
    # class 1: many hits; class 2: one hit
    for i in range(5):
        det.observe(1, 1, 16, i * 0.01)
    det.observe(2, 1, 16, 0.1)
    assert det.active_alarms == 1  # only class 1 alarmed
    assert {e.key for e in det.events} == {1}


def test_unclassified_requests_only_count_in_the_window() -> None:
    det = _det()
    assert not det.observe(0, 3, 16, 0.0)
    assert det.window.total == 1 and det.alarms == 0


def test_sliding_counts() -> None:
    w = SlidingCounts(5.0)
    w.add(1, 0.0, hit=True)
    w.add(1, 1.0)
    w.add(2, 2.0, hit=True)
    assert (w.total, w.count, w.hits) == (3, {1: 2, 2: 1}, {1: 1, 2: 1})
    w.expire(5.0)  # drops the event at 0.0 (at or before now - window)
    assert (w.total, w.count, w.hits) == (2, {1: 1, 2: 1}, {2: 1})
    with pytest.raises(ValueError):
        SlidingCounts(0)


def test_prefix_class_definition() -> None:
    assert class_blocks(128, 16) == 8 and class_blocks(128, 512) == 1 and class_blocks(100, 16) == 7
    chain = list(range(100, 120))
    k = 8
    assert prefix_class(chain, k) == prefix_class([*chain[:8], 999], k) != 0  # same first 8 blocks
    assert prefix_class(chain, k) != prefix_class([*chain[:7], 5, *chain[8:]], k)
    assert prefix_class(chain[:7], k) == 0  # too short: no class
    assert prefix_class([0], 1) != 0  # block id 0 still gives a non-zero key


def test_bad_config() -> None:
    with pytest.raises(UserError):
        HotspotDetector(HotspotConfig(window_s=0))
    with pytest.raises(UserError):
        HotspotDetector(HotspotConfig(top_k=0))


def test_spread_replica_sends_one_request_out_per_streak_then_counts_again() -> None:
    det = _det(streak_factor=1.0)  # spread="replica" is the default
    key, n = 11, 8
    t = 0.0
    assert not det.observe(key, 1, n, t)  # alarm (x = 1 > 1/8)
    det.routed(key, True, t)  # streak 1 = 1·|M|
    t += 0.1
    assert not det.observe(key, 1, n, t)
    det.routed(key, True, t)  # streak 2 > 1: mitigation armed
    assert det.mitigations == 1
    t += 0.1
    assert det.observe(key, 1, n, t)  # this one makes a replica
    det.routed(key, False, t)
    # the next requests go back to the policy: the replica's prefill is still running (|M| = 1)
    t += 0.1
    assert not det.observe(key, 1, n, t)
    det.routed(key, True, t)
    assert det.mitigated_requests == 1 and det.mitigations == 1
    # the replica landed: |M| = 2, another one only after a streak of more than 1·2 into M
    for _ in range(1):  # streak 2 (counted from the replica, the request above included)
        t += 0.1
        assert not det.observe(key, 2, n, t)
        det.routed(key, True, t)
    assert det.mitigations == 1
    t += 0.1
    assert not det.observe(key, 2, n, t)
    det.routed(key, True, t)  # streak 3 > 2
    assert det.mitigations == 2
    t += 0.1
    assert det.observe(key, 2, n, t)
    assert det.mitigated_requests == 2
    assert [e.kind for e in det.events] == ["alarm", "mitigation", "mitigation"]


def test_spread_must_be_a_known_mode() -> None:
    with pytest.raises(UserError, match="spread"):
        HotspotConfig(spread="some").check()
