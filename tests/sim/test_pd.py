"""The simulated P/D cluster: one request's timeline by hand, the conditional skip, P's blocks freed
after the read, the routing step's choices, and the run_spec contract."""

from __future__ import annotations

import random

import pytest

from kvroute.engine.cost import LinearCostModel
from kvroute.engine.transfer import TransferModel
from kvroute.errors import UserError
from kvroute.policies.registry import make_policy
from kvroute.routing.core import RouteRequest, RoutingCore
from kvroute.routing.kvview import KVView
from kvroute.routing.pd import PDRouter
from kvroute.sim.pd import PDClusterSim, PDSimConfig, parse_ratio
from kvroute.sim.runner import RunSpec, run_spec
from kvroute.views import InstanceView
from kvroute.workloads.request import Request

COST = LinearCostModel("t", decode_s_per_seq=0.01, prefill_s_per_token=1e-4)
BS = 16


def request(rid: int, t: float, prompt: int = 160, out: int = 4, base: int = 0) -> Request:
    return Request(rid, t, prompt, out, tuple(range(base, base + prompt // BS)), BS)


def sim(link: TransferModel, p: int = 1, d: int = 1, conditional: bool = True) -> PDClusterSim:
    cfg = PDSimConfig(p, d, 64 * BS, link, event_delay=0.0, conditional=conditional)
    return PDClusterSim(cfg, "lmetric", COST)


def test_one_request_timeline_by_hand():
    link = TransferModel(kv_bytes_per_token=1000.0, bandwidth_bytes_per_s=1e6)  # 1 ms per token
    s = sim(link, conditional=False)  # D's own prefill (16 ms) would beat this slow link
    out = s.run(iter([request(0, 0.0)]))
    # P: 160 prefill tokens (16 ms); transfer 160 tokens (160 ms); D: the last token again (0.1 ms)
    ttft = 160e-4 + 0.160 + 1e-4
    assert out["ttft_ms"]["mean"] == pytest.approx(ttft * 1e3)
    assert out["tpot_ms"]["mean"] == pytest.approx(10.0)  # D decodes one sequence: 10 ms a token
    assert out["pd"]["transferred_tokens"] == 160 and out["pd"]["skipped_prefill"] == 0
    p_eng, d_eng = s._pools["prefill"][0], s._pools["decode"][0]
    assert p_eng.stats().used_blocks == 0 and p_eng.stats().held_requests == 0  # freed after the read
    assert d_eng.stats().external_hit_tokens == 160
    assert out["unfinished"] == 0 and out["kv_hit_rate"] == 0.0


def test_conditional_skip_when_d_holds_most_of_the_prompt():
    link = TransferModel(10.0, 1e6, latency_s=0.005)  # 5 ms + 0.01 ms per token
    s = sim(link)
    # first: D's 160-token prefill (16 ms) loses to the transfer (5 + 1.6 ms, + 0.1 ms last token);
    # the second shares the prompt and D cached it when it read it: its remainder (16 tokens, 1.6 ms)
    # beats moving 16 tokens (5.16 ms + 0.1 ms) → P skipped
    out = s.run(iter([request(0, 0.0), request(1, 1.0)]))
    assert out["pd"]["skipped_prefill"] == 1 and out["pd"]["transferred_tokens"] == 160
    ttft_second = 16 * 1e-4  # D prefills the 16 uncached tokens in one step
    assert out["ttft_ms"]["p50"] >= 0 and min_ttft(s) == pytest.approx(ttft_second * 1e3)


def min_ttft(s: PDClusterSim) -> float:
    return min(s.recorder.ttft) * 1e3


def test_no_skip_without_conditional():
    link = TransferModel(10.0, 1e6, latency_s=0.005)
    out = sim(link, conditional=False).run(iter([request(0, 0.0), request(1, 1.0)]))
    assert out["pd"]["skipped_prefill"] == 0
    assert out["pd"]["transferred_tokens"] == 160 + 16  # D holds 9 blocks of the second: it reads 16


def test_pd_router_picks_d_by_load_and_p_by_cache():
    def core(n: int) -> RoutingCore:
        kv = KVView(n, BS, 1000, None, 0.0, range(n), rehash=False, history=False)
        return RoutingCore(make_policy("lmetric", random.Random(0)), kv)

    p, d = core(2), core(2)
    from kvroute.engine.types import BlockStored

    chain = tuple(range(10))
    p.kv.apply_events(1, [BlockStored(chain, None, (), BS)])  # P1 holds the prompt
    d.kv.apply_events(0, [BlockStored(chain, None, (), BS)])  # so does D0, but D0 is busy
    fast = TransferModel(1.0, 1e12)
    router = PDRouter(p, d, COST, fast, 4096)
    pv = [InstanceView(0), InstanceView(1)]
    dv = [InstanceView(0, running=5), InstanceView(1, running=1)]
    dec = router.route(RouteRequest(chain, 170), pv, dv, 0.0)
    assert dec.decode.instance == 1  # the load term: D1 has the smaller batch
    assert dec.reason == "disaggregated" and dec.prefill is not None and dec.prefill.instance == 1
    assert dec.decode_cached_tokens == 0 and dec.to_dict()["prefill"]["instance"] == 1
    # P1 already tried (it died): the next best P
    dec = router.route(RouteRequest(chain, 170), pv, dv, 0.0, exclude_prefill=frozenset({1}))
    assert dec.prefill is not None and dec.prefill.instance == 0
    assert (
        router.route(RouteRequest(chain, 170), pv[:1], dv, 0.0, frozenset({0})).reason
        == "no_prefill_instance"
    )


def test_run_spec_pd_and_ratio_parsing():
    base = RunSpec(policy="lmetric", instances=4, workload="chatbot", duration=20.0, kv_tokens=200_000)
    colocated = run_spec(base)
    pd = run_spec(_with(base, pd=(1, 3)))
    assert pd["requests"] == colocated["requests"] > 0 and pd["unfinished"] == 0
    assert pd["pd"]["prefill"] == 1 and pd["pd"]["decode"] == 3 and pd["instances"] == 4
    assert parse_ratio("2:6") == (2, 6)
    for bad in ("3", "0:2", "a:b"):
        with pytest.raises(UserError):
            parse_ratio(bad)
    with pytest.raises(UserError, match="--pd"):
        run_spec(_with(base, pd=(1, 1), kv_view="approx"))


def _with(spec: RunSpec, **kw: object) -> RunSpec:
    from dataclasses import replace

    return replace(spec, **kw)  # type: ignore[arg-type]


def test_compare_pd_cli(tmp_path, capsys):
    import json

    from kvroute.cli import main

    argv = ["compare", "--workload", "chatbot", "--duration", "8", "--kv-tokens", "200000", "--jobs", "1"]
    out = tmp_path / "o"
    assert main([*argv, "--pd", "1:1", "--out", str(out), "--no-progress", "--rate-scales", "1"]) == 0
    table = (out / "pd.md").read_text()
    assert "| colocated 2 | 2 | ×1 |" in table and "| 1:1 | 2 | ×1 |" in table and "Capacity at" in table
    res = json.loads((out / "pd.json").read_text())
    assert [r["fleet"] for r in res["runs"]] == ["colocated 2", "1:1"]
    assert res["runs"][0]["requests"] == res["runs"][1]["requests"] > 0
    assert set(res["capacity"]["fleets"]) == {"colocated 2", "1:1"}
    for bad, msg in ((["--pd", "1:0"], "at least one"), (["--pd", "1:1", "--policies", "a,b"], "one policy")):
        assert main([*argv, *bad, "--out", str(out), "--no-progress"]) == 2
        assert msg in capsys.readouterr().err
