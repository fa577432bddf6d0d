"""Guarded: any registry policy wrapped with the production features of :mod:`kvroute.features`.

A policy like any other (the same ``choose``), built by :func:`kvroute.routing.core.build_policy` for
every driver when features are on. It is pure like every policy: time comes with the request
(``RequestView.now``), it does no I/O, and what it noticed (alarms, alerts) is recorded in ``log`` for
the caller to print.

A decision, in order:

1. **Eligibility** (any policy): spot instances out of long requests, then the P-token cap
   (:mod:`kvroute.features.limits`), then the BS cap of warming instances
   (:mod:`kvroute.features.coldstart`) — each rule only applies if it leaves an instance.
2. **Hot-spot mitigation** (any policy): the request's prefix class is observed by the
   :class:`~kvroute.features.hotspot.HotspotDetector`; if the detector says so the request goes to an
   eligible instance outside the instances caching the class (all eligible ones if none is outside):
   in ``spread="replica"`` mode the one with the lowest P-token × (BS + 1) (the new replica pays
   the prefix's prefill where it queues least; ties → BS, queued prefill, index), in ``"all"`` mode
   the least loaded (BS, then queued prefill tokens, then index).
3. **Score**: with an ``lmetric`` or ``lmetric-kv`` inner policy and any of cold start, request
   classes or load-adaptive weighting on, the score is computed here:
   ``(P-token + offset) × (BS + 1) ^ w`` (× the KV pressure C / (C − D) for ``lmetric-kv``) with ``offset`` = 10 on warming instances (else 0) and
   ``w = w_policy × w_class × w_load``; ties → lower BS, then lower index (as
   :class:`~kvroute.policies.lmetric.LMetric`). Otherwise the inner policy chooses among the
   eligible instances.
4. **Bookkeeping**: stage-2 streak of the hot-spot detector; the chosen instance's
   ``P-token × (BS + 1)`` goes to the :class:`~kvroute.features.monitor.ScoreMonitor`.

Scores of ineligible instances are reported as +inf (lower is better) or −inf.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from kvroute.errors import UserError
from kvroute.features.classes import class_weight
from kvroute.features.coldstart import FrequentPrefixes, Prefix, WarmupTracker
from kvroute.features.hotspot import HotspotDetector
from kvroute.features.limits import TokenBuckets, limit_mask, narrow_mask
from kvroute.features.loadadapt import cluster_load, load_bs_weight
from kvroute.features.monitor import ScoreMonitor
from kvroute.features.prefix import DEFAULT_CLASS_TOKENS, class_blocks, prefix_class
from kvroute.features.settings import FeatureConfig
from kvroute.policies.base import Policy, check_inputs
from kvroute.policies.lmetric import LMetric
from kvroute.policies.lmetric_kv import LMetricKV, kv_pressure
from kvroute.policies.lmetric_time import LMetricTime
from kvroute.views import Choice, InstanceView, RequestView

__all__ = ["Guarded"]

LOG_KEPT = 1000


class Guarded:
    """``inner`` wrapped with ``features`` (see the module docstring). State: the detector, warm-up
    tracker, frequent prefixes, score monitor, quota buckets and counters; mutated by ``choose``,
    ``note``, ``instance_reset`` and ``admit``."""

    def __init__(self, inner: Policy, features: FeatureConfig) -> None:
        self.features = features.check()
        self.inner = inner
        lm = inner if isinstance(inner, (LMetric, LMetricKV, LMetricTime)) else None
        if lm is None and (features.classes is not None or features.load_adaptive is not None):
            raise UserError(
                "request classes and load-adaptive weighting need policy lmetric, lmetric-kv or lmetric-time, "
                f"not {inner.name}"
            )
        self._lmetric = lm
        self._own_score = lm is not None and (
            features.cold_start is not None
            or features.classes is not None
            or features.load_adaptive is not None
        )
        if self._own_score and isinstance(lm, LMetricTime) and (lm.load != "bs"):
            raise UserError(
                f"{inner.name} (a load term other than BS + 1) does not combine with cold start, request "
                "classes or load-adaptive weighting, which reweight BS + 1: use lmetric-time"
            )
        names = features.names()
        self.name = "+".join([inner.name, *names]) if names else inner.name
        self.hotspot = HotspotDetector(features.hotspot) if features.hotspot is not None else None
        cs = features.cold_start
        self.warmup = WarmupTracker(cs.window_s) if cs is not None else None
        self._frequent: FrequentPrefixes | None = None
        self.monitor = ScoreMonitor(features.monitor) if features.monitor is not None else None
        self.quota = TokenBuckets(features.quota) if features.quota is not None else None
        self._class_weights = features.classes.weight_map if features.classes is not None else {}
        self._class_tokens = (
            features.hotspot.class_tokens if features.hotspot is not None else DEFAULT_CLASS_TOKENS
        )
        self.log: deque[str] = deque(maxlen=LOG_KEPT)
        self.decisions = 0
        self.counts: Counter[str] = Counter()
        self.load_sum = 0.0
        self._events_logged = 0

    # -- around a decision -------------------------------------------------------------------------
    @property
    def tracks_prefixes(self) -> bool:
        """Whether callers must pass the block chain to :meth:`note` (hot spots or preloading on)."""
        return self.hotspot is not None or self.warmup is not None

    def note(
        self,
        chain: Sequence[int],
        block_size: int,
        now: float,
        tokens: Sequence[int] | None = None,
        model: str | None = None,
    ) -> int:
        """The prefix class key of a request with block ids ``chain`` (see
        :mod:`kvroute.features.prefix`); with cold start on it also counts the prefix for preloading.
        Returns 0 when prefix tracking is off."""
        if not self.tracks_prefixes:
            return 0
        key = prefix_class(chain, class_blocks(self._class_tokens, block_size))
        cs = self.features.cold_start
        if cs is not None and cs.preload_prefixes:
            if self._frequent is None:
                self._frequent = FrequentPrefixes(cs.preload_window_s, block_size, cs.preload_max_blocks)
            self._frequent.observe(key, chain, now, tokens, model)
        return key

    def instance_reset(self, instance: int, now: float) -> list[Prefix]:
        """Instance ``instance`` (``InstanceView.index``) joined, restarted or lost its cache at
        ``now``: it is warming from now on. Returns the prefixes to preload on it (most frequent
        first; classes seen at least twice), empty when cold start is off."""
        if self.warmup is None:
            return []
        self.warmup.reset(instance, now)
        self.counts["warmups"] += 1
        self.log.append(f"cold start: instance {instance} warming until {now + self.warmup.window_s:.1f}")
        cs = self.features.cold_start
        assert cs is not None
        if self._frequent is None or not cs.preload_prefixes:
            return []
        out = [p for p in self._frequent.top(cs.preload_prefixes, now) if p.count >= 2 and p.chain]
        self.counts["preloads"] += len(out)
        return out

    def quota_wait(self, key: str | None, cost: float, now: float) -> float:
        """Quota check for a request costing ``cost`` tokens from ``key`` (user or API key): 0.0 if
        admitted, else seconds until it would be. Always 0.0 without quotas."""
        if self.quota is None:
            return 0.0
        wait = self.quota.take(key, cost, now)
        if wait:
            self.counts["quota_rejected"] += 1
        return wait

    # -- the decision --------------------------------------------------------------------------------
    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Choose an instance for ``request`` at ``request.now`` (seconds); see the module docstring.
        The same interface as every policy; ``Choice.reason`` names a feature that overrode the policy
        (``"hotspot"``) or narrowed its candidates (``"cold_start_cap"``, ``"limits"``)."""
        n = check_inputs(request, instances)
        now = request.now
        self.decisions += 1
        feats = self.features
        cached = request.cached_tokens
        prompt = request.prompt_tokens
        p_token = [prompt - c + v.queued_prefill_tokens for c, v in zip(cached, instances, strict=True)]
        bs = [v.running + v.waiting for v in instances]
        mask = [True] * n
        reason = "policy"
        if feats.limits is not None and feats.limits.active:
            mask, spot_out, cap_out = limit_mask(request, instances, p_token, feats.limits, mask)
            if spot_out:
                self.counts["spot_excluded"] += 1
            if cap_out:
                self.counts["p_token_capped"] += 1
            if spot_out or cap_out:
                reason = "limits"
        warming = self._warming(instances, now)
        score_bs = bs
        if warming is not None:
            narrowed = mask.count(True)
            mask, score_bs = self._cap_warming(mask, warming, bs)
            if mask.count(True) < narrowed:
                reason = "cold_start_cap"
        hot: list[bool] | None = None
        key = request.prefix_key
        det = self.hotspot
        if det is not None and key:
            threshold = class_blocks(self._class_tokens, request.block_size) * request.block_size
            hot = [c >= threshold for c in cached]
            targets = _replica_targets(hot, bs, mask, instances)
            if det.observe(key, sum(hot), n, now, bool(targets)):
                decision = self._mitigate(mask, hot, bs, p_token, instances, targets)
                self._after(decision.choice, key, hot, p_token, bs, now)
                return decision
        if self._own_score:
            decision = self._score(request, instances, p_token, score_bs, mask, warming)
        else:
            decision = self._inner(request, instances, mask)
        self._after(decision.choice, key, hot, p_token, bs, now)
        return decision if reason == "policy" else dataclasses.replace(decision, reason=reason)

    def _warming(self, instances: Sequence[InstanceView], now: float) -> list[bool] | None:
        tracker = self.warmup
        if tracker is None:
            return None
        if not tracker.any_warming() and not any(v.warming for v in instances):
            return None
        warming = [v.warming or tracker.warming(v.index, now) for v in instances]
        return warming if any(warming) else None

    def _cap_warming(
        self, mask: list[bool], warming: list[bool], bs: list[int]
    ) -> tuple[list[bool], list[int]]:
        """The BS cap of warming instances: ``"admit"`` mode narrows the mask, ``"score"`` mode
        returns the BS the score uses (``min(BS, cap)`` on warming instances)."""
        cs = self.features.cold_start
        assert cs is not None
        warm = [b for b, w in zip(bs, warming, strict=True) if not w]
        if not warm or cs.cap_mode == "none":
            return mask, bs
        cap = cs.bs_cap_fraction * sum(warm) / len(warm)
        if cs.cap_mode == "score":
            capped = [min(b, int(cap)) if w else b for w, b in zip(warming, bs, strict=True)]
            if capped != bs:
                self.counts["warming_capped"] += 1
            return mask, capped
        limit = max(1.0, cap)
        mask, out = narrow_mask(mask, [not w or b < limit for w, b in zip(warming, bs, strict=True)])
        if out:
            self.counts["warming_capped"] += 1
        return mask, bs

    def _mitigate(
        self,
        mask: list[bool],
        hot: list[bool],
        bs: list[int],
        p_token: list[int],
        instances: Sequence[InstanceView],
        targets: list[int],
    ) -> Choice:
        cfg = self.features.hotspot
        assert cfg is not None
        n = len(mask)
        if cfg.spread == "replica":
            cand = targets if cfg.exclude_hot and targets else [i for i in range(n) if mask[i]]
        else:
            cand = [i for i in range(n) if mask[i] and not hot[i]] if cfg.exclude_hot else []
        if not cand:
            cand = [i for i in range(n) if mask[i]]
        if cfg.spread == "replica":
            score = [float(p * (b + 1)) for p, b in zip(p_token, bs, strict=True)]
        else:
            score = [float(b) for b in bs]
        choice = min(
            cand, key=lambda i: (score[i], bs[i], instances[i].queued_prefill_tokens, instances[i].index)
        )
        scores = tuple(score[i] if i in cand else math.inf for i in range(n))
        self.counts["mitigated"] += 1
        return Choice(choice, scores, self.name, True, {"mitigated": (1.0,)}, reason="hotspot")

    def _score(
        self,
        request: RequestView,
        instances: Sequence[InstanceView],
        p_token: list[int],
        bs: list[int],
        mask: list[bool],
        warming: list[bool] | None,
    ) -> Choice:
        lm = self._lmetric
        assert lm is not None
        feats = self.features
        w = lm.bs_weight if isinstance(lm, LMetric) else 1.0
        kv = isinstance(lm, LMetricKV)
        if feats.classes is not None:
            wc = class_weight(request.req_class, self._class_weights)
            w *= wc
            self.counts[f"class:{request.req_class}"] += 1
        if feats.load_adaptive is not None:
            load = cluster_load(instances, feats.load_adaptive.seq_capacity)
            self.load_sum += load
            wl = load_bs_weight(load, feats.load_adaptive)
            if wl != 1.0:
                self.counts["load_reweighted"] += 1
            w *= wl
        offset = feats.cold_start.p_token_offset if feats.cold_start is not None and warming else 0
        n = len(instances)
        if isinstance(lm, LMetricTime):  # its prefill time × K in place of P-token (offset: queued tokens)
            views = [
                dataclasses.replace(v, queued_prefill_tokens=v.queued_prefill_tokens + offset)
                if offset and warming is not None and warming[i]
                else v
                for i, v in enumerate(instances)
            ]
            times, _, ks = lm.parts(request, views)
            base = [(t0 + t1) * k for (t0, t1), k in zip(times, ks, strict=True)]
        scores: list[float] = []
        for i in range(n):
            if not mask[i]:
                scores.append(math.inf)
                continue
            if isinstance(lm, LMetricTime):
                scores.append(base[i] * (bs[i] + 1) ** w)
                continue
            p = p_token[i] + (offset if warming is not None and warming[i] else 0)
            score = float(p * (bs[i] + 1)) if w == 1.0 else p * (bs[i] + 1) ** w
            scores.append(score * kv_pressure(instances[i]) if kv else score)
        best_s = min(scores)
        best = min((i for i in range(n) if scores[i] == best_s), key=lambda i: (bs[i], instances[i].index))
        return Choice(
            best,
            tuple(scores),
            self.name,
            True,
            {"p_token": tuple(map(float, p_token)), "bs": tuple(map(float, bs)), "bs_weight": (w,)},
        )

    def _inner(self, request: RequestView, instances: Sequence[InstanceView], mask: list[bool]) -> Choice:
        if all(mask):
            d = self.inner.choose(request, instances)
            return dataclasses.replace(d, policy=self.name) if self.name != d.policy else d
        sub = [i for i, ok in enumerate(mask) if ok]
        sub_req = dataclasses.replace(request, cached_tokens=tuple(request.cached_tokens[i] for i in sub))
        d = self.inner.choose(sub_req, [instances[i] for i in sub])
        worst = math.inf if d.lower_is_better else -math.inf
        scores = [worst] * len(instances)
        for pos, i in enumerate(sub):
            scores[i] = d.scores[pos]
        return Choice(sub[d.choice], tuple(scores), self.name, d.lower_is_better, d.detail)

    def _after(
        self, choice: int, key: int, hot: list[bool] | None, p_token: list[int], bs: list[int], now: float
    ) -> None:
        det = self.hotspot
        if det is not None:
            if hot is not None:
                det.routed(key, hot[choice], now)
            fresh = det.event_count - self._events_logged
            if fresh:
                events = list(det.events)
                self.log.extend(e.message() for e in events[max(0, len(events) - fresh) :])
                self._events_logged = det.event_count
        mon = self.monitor
        if mon is not None and mon.observe(float(p_token[choice] * (bs[choice] + 1)), now):
            self.log.append(
                f"score alert: {mon.config.persist} consecutive decisions above the rolling "
                f"p{mon.config.quantile * 100:g} ({mon.threshold:.0f})"
            )

    # -- reporting -----------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Counters of every feature that is on, for the simulator's JSON output."""
        out: dict[str, Any] = {"features": self.features.names(), "decisions": self.decisions}
        out.update(sorted(self.counts.items()))
        if self.hotspot is not None:
            out["hotspot"] = self.hotspot.summary()
        if self.monitor is not None:
            out["score"] = self.monitor.summary()
        if self.features.load_adaptive is not None and self.decisions:
            out["mean_cluster_load"] = self.load_sum / self.decisions
        if self.quota is not None:
            out["quota_admitted"] = self.quota.admitted
        return out


def _replica_targets(
    hot: list[bool], bs: list[int], mask: list[bool], instances: Sequence[InstanceView]
) -> list[int]:
    """Positions of the eligible instances that do not cache the class and are less loaded than
    *every* holder in both terms of the score: fewer requests (BS) and no more queued prefill tokens.
    Empty when nobody caches the class or no such instance exists: the holders are not saturated
    (they carry the class no worse than anyone else could), so a replica would only add a full prefix
    prefill behind a longer queue."""
    held = [i for i, h in enumerate(hot) if h]
    if not held:
        return []
    min_bs = min(bs[i] for i in held)
    min_q = min(instances[i].queued_prefill_tokens for i in held)
    return [
        i
        for i in range(len(hot))
        if mask[i] and not hot[i] and bs[i] < min_bs and instances[i].queued_prefill_tokens <= min_q
    ]
