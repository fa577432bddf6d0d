"""Limits: P-token cap, spot exclusion for long requests, token-bucket quotas (refill, Retry-After)."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute.errors import UserError
from kvroute.features.limits import LimitsConfig, QuotaConfig, TokenBuckets
from kvroute.features.settings import FeatureConfig
from kvroute.policies.registry import make_policy
from kvroute.routing.guarded import Guarded
from kvroute.views import InstanceView, RequestView

from ._factories import insts, req


def at(request: RequestView, now: float) -> RequestView:
    """``request`` routed at ``now`` (seconds): the time Guarded reads."""
    return dataclasses.replace(request, now=now)


def limited(policy: str = "lmetric", **kw: object) -> Guarded:
    return Guarded(make_policy(policy), FeatureConfig(limits=LimitsConfig(**kw)))  # type: ignore[arg-type]


def test_p_token_cap_excludes_instances_above_it_while_one_is_within() -> None:
    g = limited(p_token_cap=1500)
    # instance 0: P = 2000 (nothing cached) at BS 0 → lmetric's pick (2000 < 500 × 5 = 2500)
    views = insts(0, 4)
    r = req(2000, [0, 1500])
    assert make_policy("lmetric").choose(r, views).choice == 0
    d = g.choose(at(r, 0.0), views)
    assert d.choice == 1 and d.scores[0] == float("inf")
    assert g.counts["p_token_capped"] == 1
    # queued prefill counts in P-token: 1000 queued + 500 new = 1500 is within the cap
    views = [InstanceView(index=0, running=0), InstanceView(index=1, running=4, queued_prefill_tokens=1000)]
    assert g.choose(at(r, 0.0), views).choice == 1
    views = [InstanceView(index=0, running=0), InstanceView(index=1, running=4, queued_prefill_tokens=1001)]
    assert g.choose(at(r, 0.0), views).choice == 0  # both above the cap: no restriction


def test_p_token_cap_applies_to_any_inner_policy_and_maps_positions_back() -> None:
    g = limited("least-requests", p_token_cap=100)
    views = insts(0, 5, 7)
    d = g.choose(at(req(1000, [0, 0, 950]), 0.0), views)
    assert d.choice == 2  # the only instance within the cap, despite its load
    assert d.scores == (float("inf"), float("inf"), 7.0)


def test_spot_instances_are_kept_out_of_long_requests_only() -> None:
    g = limited(spot_max_tokens=4096)
    views = [
        dataclasses.replace(v, tags=frozenset({"spot"}) if v.index == 0 else frozenset()) for v in insts(0, 6)
    ]
    short = req(1000, [0, 0], max_tokens=100)
    assert g.choose(at(short, 0.0), views).choice == 0  # short: the idle spot instance is fine
    long = req(4000, [0, 0], max_tokens=200)  # 4200 > 4096
    assert g.choose(at(long, 0.0), views).choice == 1
    assert g.counts["spot_excluded"] == 1
    all_spot = [dataclasses.replace(v, tags=frozenset({"spot"})) for v in insts(0, 6)]
    assert g.choose(at(long, 0.0), all_spot).choice == 0  # nothing else: spot it is


def test_token_bucket_refill_and_retry_after() -> None:
    b = TokenBuckets(QuotaConfig(tokens_per_s=100.0, burst=1000.0))
    assert b.take("alice", 800, 0.0) == 0.0  # 200 left
    wait = b.take("alice", 500, 0.0)
    assert wait == pytest.approx(3.0)  # 300 more tokens at 100/s
    assert b.take("alice", 500, 2.9) > 0.0  # 490 at 2.9 s: still short, nothing charged
    assert b.take("alice", 500, 3.0) == 0.0  # 500 at 3.0 s
    assert b.level("alice", 3.0) == pytest.approx(0.0)
    assert b.take("bob", 1000, 3.0) == 0.0  # separate bucket
    assert b.level("alice", 100.0) == 1000.0  # refills up to the burst, no further
    assert (b.admitted, b.rejected) == (3, 2)


def test_token_bucket_caps_a_cost_above_the_burst_and_shares_anonymous() -> None:
    b = TokenBuckets(QuotaConfig(tokens_per_s=10.0, burst=100.0))
    assert b.take(None, 5000, 0.0) == 0.0  # a full bucket admits it (charged the burst)
    assert b.take(None, 1, 0.0) == pytest.approx(0.1)  # the anonymous key is shared


def test_token_bucket_prunes_full_buckets() -> None:
    b = TokenBuckets(QuotaConfig(tokens_per_s=1000.0, burst=10.0))
    for i in range(TokenBuckets.PRUNE_EVERY - 1):
        b.take(f"user{i}", 5, 0.0)
    assert len(b) == TokenBuckets.PRUNE_EVERY - 1
    b.take("late", 5, 100.0)  # the PRUNE_EVERY-th take: every earlier bucket is full again
    assert len(b) == 1


def test_guarded_admit_counts_rejections() -> None:
    g = Guarded(make_policy("lmetric"), FeatureConfig(quota=QuotaConfig(10.0, 100.0)))
    assert g.quota_wait("u", 100, 0.0) == 0.0
    assert g.quota_wait("u", 50, 0.0) == pytest.approx(5.0)
    assert g.counts["quota_rejected"] == 1
    assert Guarded(make_policy("lmetric"), FeatureConfig()).quota_wait("u", 1e9, 0.0) == 0.0


def test_bad_limits() -> None:
    with pytest.raises(UserError):
        limited(p_token_cap=-1)
    with pytest.raises(UserError):
        TokenBuckets(QuotaConfig(0.0, 10.0))
