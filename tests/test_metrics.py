"""LatencyRecorder: what it derives from each request, and merging recorders."""

from __future__ import annotations

import pytest

from kvroute.metrics import LatencyRecorder


def test_recorder_derives_ttft_tpot_e2e_and_hit_rate() -> None:
    r = LatencyRecorder()
    r.add(arrival=1.0, first=1.5, last=3.5, prompt=100, cached=40, output=5)
    r.add(arrival=2.0, first=2.25, last=2.25, prompt=100, cached=0, output=1)  # one token: no TPOT
    assert list(r.ttft) == [0.5, 0.25] and list(r.e2e) == [2.5, 0.25]
    assert list(r.tpot) == [0.5]  # (3.5 - 1.5) / (5 - 1)
    assert r.finished == 2 and r.summary()["kv_hit_rate"] == pytest.approx(0.2)


def test_merge_equals_recording_everything_in_one() -> None:
    reqs = [(0.0, 0.1, 0.5, 50, 10, 3), (1.0, 1.2, 1.2, 80, 80, 1), (2.0, 2.3, 2.9, 20, 0, 4)]
    whole, a, b = LatencyRecorder(), LatencyRecorder(), LatencyRecorder()
    for i, req in enumerate(reqs):
        whole.add(*req)
        (a if i < 2 else b).add(*req)
    a.merge(b)
    assert a.summary() == whole.summary()
    assert (a.finished, a.output_tokens) == (whole.finished, whole.output_tokens)
