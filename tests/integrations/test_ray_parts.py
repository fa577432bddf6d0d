"""The Ray adapter's parts that need no Ray: shared state, in-flight accounting, prompts."""

from __future__ import annotations

from kvroute.blocks import hash_blocks
from kvroute.integrations.inflight import InFlight, instance_view
from kvroute.integrations.prompts import PromptChains, body_of
from kvroute.integrations.ray_state import SharedRoutingState
from kvroute.policies.lmetric import LMetric
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.tokenizer import load_tokenizer
from kvroute.views import InstanceView, RequestView


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_shared_state_exchanges_history_and_load_between_routers() -> None:
    clock = Clock()
    st = SharedRoutingState(history_limit=3, load_ttl_s=10.0, clock=clock)
    cur_a, news, others = st.sync("a", 0, [("r1", (1, 2), 1.0)], {"r1": [(1.0, 50)]})
    assert news == [] and others == {}
    cur_b, news, others = st.sync("b", 0, [], {"r2": [(2.0, 7)]})
    assert news == [("r1", (1, 2), 1.0)] and others == {"r1": [(1.0, 50)]}
    _, news, others = st.sync("a", cur_a, [], {})
    assert news == [] and others == {"r2": [(2.0, 7)]}  # its own entries never come back
    st.sync("a", cur_a, [("r1", (3,), 3.0), ("r2", (4,), 4.0), ("r1", (5,), 5.0)], {})
    _, news, _ = st.sync("b", cur_b, [], {})
    assert [e[1] for e in news] == [(3,), (4,), (5,)]  # bounded journal: the oldest was dropped
    clock.t += 11  # router "b" stops reporting: its load no longer counts
    st.sync("a", 0, [], {})
    _, _, others = st.sync("a", 0, [], {})
    assert others == {}
    st.forget_replica("r1")
    assert all(e[2][0] != "r1" for e in st._log)


def test_inflight_reserve_move_release_and_expire() -> None:
    f = InFlight(ttl_s=5.0)
    f.reserve("q1", "A", 100, now=1.0)
    f.reserve("q2", "A", 40, now=1.0)
    assert f.load() == {"A": [(1.0, 100), (1.0, 40)]}
    f.move("q1", "B", 90, now=2.0)  # Ray fell back to the decision's second choice
    assert f.count("A") == 1 and f.count("B") == 1
    assert f.load()["B"] == [(1.0, 90)]
    f.release("q1", now=3.0)
    assert f.completed_rows() == {"B": [(1.0, 3.0, 90, "q1")]}
    assert f.expire(now=7.0) == 1  # q2 was never dispatched: dropped after the TTL
    assert len(f) == 0 and f.load() == {}
    f.reserve("q3", "C", 1, now=8.0)
    f.move("q3", "C", 1, now=8.0)
    f.drop_replica("C")
    assert len(f) == 0


def test_instance_view_adds_late_requests_and_removes_finished_ones() -> None:
    stats = {"running": 2, "waiting": 1, "queued_prefill_tokens": 500, "kv_usage": 0.5, "time": 10.0}
    v = instance_view(3, stats, [(9.0, 100), (11.0, 300)], [(8.0, 12.0, 200), (11.0, 12.0, 50)])
    # (11.0, 300) is after the snapshot: +1 waiting, +300 queued; (8.0→12.0, 200) is in the
    # snapshot but done: −1 waiting, −200 queued; (11.0→12.0) was never in the snapshot.
    assert (v.index, v.running, v.waiting, v.queued_prefill_tokens, v.kv_usage) == (3, 2, 1, 600, 0.5)
    v = instance_view(0, {"running": 1, "waiting": 0, "time": 10.0}, [], [(9.0, 11.0, 10), (9.5, 11.0, 5)])
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (0, 0, 0)  # clamped at 0
    v = instance_view(1, {}, [(1.0, 10), (2.0, 20)])  # no stats: every in-flight request waits
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (0, 2, 30)


def test_instance_view_decode_blocks_are_the_snapshots_blocks_in_use_only() -> None:
    """``decode_blocks`` (views.py): the blocks the replica's engine holds for the requests it has
    started, ``kv_usage`` × pool at the snapshot, as the simulator copies them; a request routed
    since the snapshot adds its queued prefill, never blocks. Regression: it was 0 (K and the step's
    context saw an empty pool)."""
    stats = {"running": 1, "waiting": 1, "queued_prefill_tokens": 64, "time": 10.0}
    full = {**stats, "kv_usage": 0.25, "kv_capacity_blocks": 400}
    v = instance_view(0, full, [(11.0, 320)], [])
    assert (v.waiting, v.queued_prefill_tokens, v.decode_blocks) == (2, 384, 100)
    assert instance_view(0, full, [], []).decode_blocks == 100
    assert instance_view(0, {**stats, "kv_usage": 0.25}, [], []).decode_blocks == 0  # pool unknown
    assert instance_view(0, {**full, "kv_usage": float("nan")}, [], []).decode_blocks == 0
    assert instance_view(0, {}, [(1.0, 10)]).decode_blocks == 0  # no snapshot


def test_instance_view_ends_prefill_at_the_replicas_ttft_estimate() -> None:
    """With ``ttft_p50_s`` a request's prefill ends at reserved + ttft: after that it is running
    with no prefill left (it decodes), not waiting with its whole prompt queued until it completes."""
    stats = {"running": 1, "waiting": 1, "queued_prefill_tokens": 500, "time": 10.0, "ttft_p50_s": 0.05}
    late = [(10.1, 300), (10.28, 200)]  # routed after the snapshot: 10.15 <= now, 10.33 > now
    v = instance_view(0, stats, late, [], now=10.3)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (2, 2, 700)
    # Without the estimate (or without now) both count as prefilling, as before.
    v = instance_view(0, {k: x for k, x in stats.items() if k != "ttft_p50_s"}, late, [], now=10.3)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 3, 1000)
    v = instance_view(0, stats, late, [])
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 3, 1000)
    # Completed since the snapshot: one whose prefill ended by then (9.0 + 0.05 <= 10) was running
    # in it and comes off the running count only; one reserved at 9.99 was still prefilling in it.
    v = instance_view(0, stats, [], [(9.0, 10.2, 400)], now=10.3)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (0, 1, 500)
    v = instance_view(0, stats, [], [(9.99, 10.2, 100)], now=10.3)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 0, 400)
    # A prompt of several chunks under the replica's budget takes one TTFT per chunk: 300 tokens
    # at 128 per step are 3 chunks, so (10.1, 300) ends at 10.25 <= 10.3 but (10.2, 300) at 10.35.
    budget = {**stats, "max_num_batched_tokens": 128}
    v = instance_view(0, budget, [(10.1, 300), (10.2, 300)], [], now=10.3)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (2, 2, 800)
    for bad in (-1.0, float("nan"), float("inf"), "0.05", True):  # a bad estimate is ignored
        v = instance_view(0, {**stats, "ttft_p50_s": bad}, late, [], now=10.3)
        assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 3, 1000)


class Pydantic:
    def __init__(self, **kw: object) -> None:
        self.kw = kw

    def model_dump(self) -> dict[str, object]:
        return dict(self.kw)


def test_prompt_chains_from_chat_completion_and_models() -> None:
    tok = load_tokenizer()
    pc = PromptChains(RequestTokenizer(tok), 16)
    msgs = [{"role": "system", "content": "be brief " * 30}, {"role": "user", "content": "hello " * 20}]
    req = pc.route_request(body_of([{"messages": msgs, "max_tokens": 7, "user": "u"}], {}))
    ids = tok.encode_chat(msgs)
    assert req.prompt_tokens == len(ids) and req.chain == tuple(hash_blocks(ids, 16))
    assert req.max_tokens == 7 and req.user == "u"
    same = pc.route_request(body_of([Pydantic(messages=msgs, max_tokens=7)], {}))
    assert same.chain == req.chain
    comp = pc.route_request(body_of([], {"body": {"prompt": "one two three " * 40}}))
    assert comp.prompt_tokens == len(tok.encode("one two three " * 40)) and comp.chain
    ids_req = pc.route_request({"prompt": list(range(40))})
    assert ids_req.prompt_tokens == 40 and len(ids_req.chain) == 2
    for bad in (None, {"messages": "x"}, {"prompt": 3}, {"messages": [{"content": "no role"}]}):
        r = pc.route_request(bad)
        assert r.chain == () and r.prompt_tokens == 1  # routed by load; the deployment answers the error
    assert body_of([object()], {}) is None


def test_instance_view_matches_its_requests_to_the_snapshot_by_id_not_by_time() -> None:
    """The flaky Ray test's two ways of losing a request in flight, with hand-built snapshots.
    Replica A served a warm-up ("w", reserved 9.8, completion seen at 10.1), then got "a" (309
    new prefill tokens, reserved 10.15); at 10.5 the router decides where "b" goes."""
    policy = LMetric()
    req = RequestView(prompt_tokens=309, cached_tokens=(0, 0))
    idle = InstanceView(index=1)
    base = {"running": 0, "waiting": 0, "queued_prefill_tokens": 0, "ttft_p50_s": 0.03}
    inflight = [(10.15, 309, "a")]
    done = [(9.8, 10.1, 10, "w")]
    # 1. Stamped 10.2, after "a" was reserved, but taken while "a" was still in transit to the
    #    replica: the snapshot does not count it. By time, "a" is neither routed since nor in it.
    transit = {**base, "time": 10.2}
    lost = instance_view(0, transit, [r[:2] for r in inflight], [d[:3] for d in done], now=10.5)
    assert lost.running + lost.waiting == 0  # the old rule: A looks idle, "b" would tie onto it
    v = instance_view(0, {**transit, "requests": []}, inflight, done, now=10.5)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 0, 0)  # past its prefill: decoding
    assert policy.choose(req, [v, idle]).choice == 1
    # 2. Stamped 10.05, before the warm-up's completion reached the router, but the engine had
    #    finished it: by time the warm-up comes off a snapshot that no longer counts it, and "a"
    #    (rightly added as routed since) cancels out.
    early = {**base, "time": 10.05}
    lost = instance_view(0, early, [r[:2] for r in inflight], [d[:3] for d in done], now=10.5)
    assert lost.running + lost.waiting == 0
    v = instance_view(0, {**early, "requests": []}, inflight, done, now=10.5)
    assert (v.running, v.waiting) == (1, 0)
    assert policy.choose(req, [v, idle]).choice == 1
    # 3. A completed request the snapshot counts comes off as it counted it: "w" with 100 prefill
    #    tokens left (waiting), "x" decoding (running); "a" is in the snapshot, so it is not added.
    stats = {
        **base,
        "running": 2,
        "waiting": 1,
        "queued_prefill_tokens": 400,
        "time": 10.0,
        "requests": [["w", 100], ["x", 0], ["a", 300]],
    }
    v = instance_view(0, stats, [(9.95, 309, "a")], [(9.8, 10.1, 10, "w"), (9.0, 10.2, 50, "x")], now=10.5)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (1, 0, 300)
    # Other routers' requests come without ids: the time rule still decides for them.
    v = instance_view(0, stats, [(10.3, 40)], [], now=10.31)
    assert (v.running, v.waiting, v.queued_prefill_tokens) == (2, 2, 440)


def test_engine_model_in_flight_lists_what_its_load_counts() -> None:
    from kvroute.engine import cost
    from kvroute.engine.model import EngineModel
    from kvroute.engine.types import EngineConfig, EngineRequest

    m = EngineModel(
        EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=64), cost.get_profile().cost
    )
    m.add_request(EngineRequest("r1", 100, 4, ()), 0.0)
    m.add_request(EngineRequest("r2", 30, 4, ()), 0.0)
    live = dict(m.in_flight())
    load = m.load()
    assert set(live) == {"r1", "r2"} and len(live) == load.running + load.waiting
    assert sum(live.values()) == load.queued_prefill_tokens
