"""The engine model's P/D roles: a prefill request that keeps its blocks, a decode request that reads
the prompt it lacks instead of computing it; and the transfer model."""

from __future__ import annotations

import pytest

from kvroute.engine.cost import LinearCostModel
from kvroute.engine.model import EngineModel
from kvroute.engine.transfer import TransferModel, prefill_locally, prefill_seconds
from kvroute.engine.types import EngineConfig, EngineRequest, OutputKind

COST = LinearCostModel("t", decode_s_per_seq=0.01, prefill_s_per_token=1e-4)
BS = 16


def model(blocks: int = 64, report: bool = True) -> EngineModel:
    return EngineModel(EngineConfig(num_kv_blocks=blocks, block_size=BS, report_tokens=report), COST)


def run(m: EngineModel) -> list:
    outs = []
    while (t := m.next_time()) is not None:
        outs += m.advance(t)
        m.check()
    return outs


def req(rid: str, prompt: int, out: int, **kw) -> EngineRequest:
    hashes = tuple(range(1000, 1000 + prompt // BS))
    return EngineRequest(rid, prompt, out, hashes, **kw)


@pytest.mark.parametrize("report", [True, False])
def test_hold_blocks_until_release(report):
    m = model(report=report)
    m.add_request(req("p", 100, 1, hold_blocks=True), 0.0)
    outs = run(m)
    assert [o.kind for o in outs] == [OutputKind.FIRST_TOKEN, OutputKind.FINISHED]
    blocks = -(-101 // BS)  # the prompt and the sampled token
    assert m.held("p") == blocks and m.stats().used_blocks == blocks
    assert m.stats().held_requests == 1 and m.stats().held_blocks == blocks
    with pytest.raises(ValueError):
        m.add_request(req("p", 10, 1), 1.0)  # its id is still in use
    assert m.release("p", 1.0) and not m.release("p", 1.0)
    s = m.stats()
    assert (s.used_blocks, s.held_requests, s.held_blocks) == (0, 0, 0)
    assert s.cached_blocks == 100 // BS  # the prompt's full blocks stay cached (evictable)
    m.check()


def test_held_blocks_free_for_waiting_request_when_released():
    m = model(blocks=8)
    m.add_request(req("p", 100, 1, hold_blocks=True), 0.0)  # 7 blocks
    run(m)
    m.add_request(EngineRequest("q", 40, 2), 1.0)  # 3 blocks needs what p holds
    assert m.advance(1.5) == [] and m.stats().waiting == 1
    m.release("p", 2.0)
    kinds = [o.kind for o in run(m)]
    assert kinds[-1] is OutputKind.FINISHED and m.stats().used_blocks == 0


@pytest.mark.parametrize("report", [True, False])
def test_remote_prefill_reads_what_it_lacks(report):
    m = model(report=report)
    m.add_request(req("warm", 48, 1), 0.0)  # caches its 3 full blocks (48 tokens) of the same prefix
    run(m)
    t0 = 10.0
    m.add_request(req("d", 100, 3, remote_prefill=True), t0)
    outs = run(m)
    first = next(o for o in outs if o.kind is OutputKind.FIRST_TOKEN)
    assert first.num_external_tokens == 100 - 48  # all it lacked came from P (vLLM counts it so)
    assert first.num_cached_tokens == 48  # the local hit only, as vLLM 0.32's D reports
    # only the last prompt token is computed (again): one step of 1 prefill token
    assert first.time - t0 == pytest.approx(COST.step_time([(1, 99)], 0, 0))
    s = m.stats()
    assert (s.external_query_tokens, s.external_hit_tokens) == (100, 52)
    assert s.prefix_hit_tokens == 48 and s.cached_blocks == 100 // BS  # D caches the read blocks


def test_abort_frees_unfinished_hold_request():
    m = model()
    m.add_request(req("p", 100, 1, hold_blocks=True), 0.0)
    assert m.abort("p", 0.0)
    assert m.stats().used_blocks == 0 and m.held("p") == 0


def test_transfer_model_and_skip_test():
    link = TransferModel.from_gbps(kv_bytes_per_token=100_000, gbps=1.0, latency_s=0.001)
    assert link.seconds(0) == 0.0
    assert link.seconds(1000) == pytest.approx(0.001 + 1000 * 1e5 / 1e9)
    with pytest.raises(ValueError):
        TransferModel(1.0, 0.0)
    assert prefill_seconds(COST, 300, 0, 128) == pytest.approx(
        COST.step_time([(128, 0)], 0, 0) * 2 + COST.step_time([(44, 256)], 0, 0)
    )
    # prefill costs 1e-4 s/token (+ 0 per step); the link moves a token in 1e-4 s + 1 ms per transfer
    slow_link = TransferModel.from_gbps(100_000, 1.0, 0.001)
    skip, local, moved = prefill_locally(5, 1000, COST, slow_link, 4096)
    assert skip and local < moved  # 5 tokens: computing beats the transfer's fixed cost
    fast_link = TransferModel.from_gbps(100_000, 100.0)
    skip, local, moved = prefill_locally(5000, 0, COST, fast_link, 4096)
    assert not skip and moved < local
