"""Hot-spot mitigation inside :class:`Guarded` on hand-built clusters: ``spread="replica"`` sends one
request of the hot class to the non-holder with the lowest P-token × (BS + 1), then lets the policy
route the class again; ``spread="all"`` (the first implementation) routes every later request by BS."""

from __future__ import annotations

from kvroute.features.hotspot import HotspotConfig
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.views import InstanceView, RequestView

from ._factories import req

PROMPT = 8400  # a 8,192-token hot prefix + 208 new tokens, 16-token blocks


def cluster() -> list[InstanceView]:
    return [
        InstanceView(index=0, running=5, queued_prefill_tokens=1_000),  # the only holder of the prefix
        InstanceView(index=1, running=0, queued_prefill_tokens=30_000),  # idle batch, longer prefill queue
        InstanceView(index=2, running=2),  # less loaded than the holder in both terms
        InstanceView(index=3, running=1, queued_prefill_tokens=900),  # likewise
        InstanceView(index=4, running=6),  # more requests than the holder
    ]


def hot_request(now: float) -> RequestView:
    return req(PROMPT, [8192, 0, 0, 0, 0], prefix_key=0xABC, now=now)


def guarded(spread: str) -> Guarded:
    cfg = HotspotConfig(min_window_requests=1, rank_interval_s=0.0, streak_factor=0.0, spread=spread)
    return Guarded(make_policy("lmetric"), FeatureConfig(hotspot=cfg))


def test_replica_goes_where_the_prefix_prefill_queues_least_then_the_policy_routes_again() -> None:
    g = guarded("replica")
    views = cluster()
    first = g.choose(hot_request(0.0), views)  # alarm; lmetric keeps the class on its holder
    assert (first.choice, first.reason) == (0, "policy")
    second = g.choose(hot_request(0.1), views)  # streak 1 > 0·|M|: one replica
    # only 2 and 3 are less loaded than the holder in BS and queued prefill; P-token × (BS + 1):
    # 2 → 8,400 × 3 = 25,200, 3 → 9,300 × 2 = 18,600
    assert (second.choice, second.reason) == (3, "hotspot")
    assert second.scores == (float("inf"), float("inf"), 25_200.0, 18_600.0, float("inf"))
    third = g.choose(hot_request(0.2), views)  # the replica's prefill has not landed: policy again
    assert (third.choice, third.reason) == (0, "policy")
    assert g.hotspot is not None and g.hotspot.mitigated_requests == 1


def test_spread_all_routes_every_later_request_by_batch_size() -> None:
    g = guarded("all")
    views = cluster()
    g.choose(hot_request(0.0), views)
    picks = [g.choose(hot_request(0.1 * k), views) for k in range(1, 4)]
    assert [(d.choice, d.reason) for d in picks] == [(1, "hotspot")] * 3  # BS 0, behind 30k tokens
    assert g.hotspot is not None and g.hotspot.mitigated_requests == 3


def test_replica_falls_back_to_all_eligible_instances_when_everyone_holds_the_prefix() -> None:
    g = guarded("replica")
    views = cluster()
    g.choose(hot_request(0.0), views)
    # the mitigated request's own view: every instance caches the prefix (|M| = N clears the alarm)
    d = g.choose(req(PROMPT, [8192] * 5, prefix_key=0xABC, now=0.1), views)
    assert d.reason == "policy" and g.hotspot is not None and g.hotspot.clears == 1


def test_no_replica_while_no_instance_is_less_loaded_than_the_holders_then_one_when_there_is() -> None:
    g = guarded("replica")
    busy = [
        InstanceView(index=0, running=2),  # the holder: fewest requests, nothing queued
        InstanceView(index=1, running=4, queued_prefill_tokens=5_000),
        InstanceView(index=2, running=3),
    ]
    request = [req(PROMPT, [8192, 0, 0], prefix_key=0xABC, now=0.1 * k) for k in range(4)]
    assert [g.choose(r, busy).reason for r in request[:3]] == ["policy"] * 3  # armed, deferred
    assert g.hotspot is not None and g.hotspot.deferred == 2 and g.hotspot.mitigated_requests == 0
    relieved = [busy[0], busy[1], InstanceView(index=2, running=1)]
    d = g.choose(request[3], relieved)  # still armed: instance 2 now beats the holder in both terms
    assert (d.choice, d.reason) == (2, "hotspot") and g.hotspot.mitigated_requests == 1
