"""Synthetic workloads: determinism, ordering, block invariants, prefix sharing, rough statistics."""

from __future__ import annotations

import itertools
import math
import tracemalloc
from collections import defaultdict
from collections.abc import Iterator

import pytest

from kvroute.errors import UserError
from kvroute.workloads.request import Request
from kvroute.workloads.synthetic import (
    WORKLOADS,
    ApiConfig,
    ChatbotConfig,
    CoderConfig,
    _weibull_shape_for_cv,
    make_workload,
)

NAMES = sorted(WORKLOADS)


def take(name: str, n: int, **kwargs: object) -> list[Request]:
    return list(itertools.islice(make_workload(name, duration=math.inf, **kwargs), n))  # type: ignore[arg-type]


def test_registry_names() -> None:
    assert {"chatbot", "coder", "api", "agent"} <= set(WORKLOADS)  # the design's four scenarios, at least


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_per_seed(name: str) -> None:
    assert take(name, 300, seed=3) == take(name, 300, seed=3)
    assert take(name, 300, seed=3) != take(name, 300, seed=4)


@pytest.mark.parametrize("name", NAMES)
def test_stream_invariants(name: str) -> None:
    reqs = take(name, 2000, seed=1)
    assert all(a.arrival <= b.arrival for a, b in itertools.pairwise(reqs))
    assert reqs[0].arrival >= 0.0
    assert [r.req_id for r in reqs] == list(range(len(reqs)))
    for r in reqs:
        assert r.block_size == WORKLOADS[name].block_size
        assert len(r.block_ids) == r.prompt_len // r.block_size
        assert r.prompt_len >= 1 and r.output_len >= 1


@pytest.mark.parametrize("name", NAMES)
def test_rate_scale_divides_arrivals_and_duration_cuts(name: str) -> None:
    base = list(make_workload(name, seed=2, duration=60.0))
    fast = list(make_workload(name, seed=2, rate_scale=2.0, duration=30.0))
    assert len(base) == len(fast) > 10
    assert all(math.isclose(f.arrival, b.arrival / 2.0) for b, f in zip(base, fast, strict=True))
    assert all(r.arrival < 30.0 for r in fast)
    longer = list(make_workload(name, seed=2, duration=120.0))
    assert longer[: len(base)] == base and longer[len(base)].arrival >= 60.0


def test_default_durations() -> None:
    reqs = list(make_workload("chatbot"))
    assert reqs[-1].arrival < 300.0
    assert 1000 < len(reqs) < 5000  # a quick-start run: thousands of requests, not hundreds of thousands


def test_invalid_arguments() -> None:
    with pytest.raises(UserError, match="chatbot, multiturn, coder, api, agent"):
        make_workload("nope")
    with pytest.raises(UserError):
        make_workload("chatbot", rate_scale=0.0)
    with pytest.raises(UserError):
        make_workload("chatbot", duration=-1.0)
    with pytest.raises(UserError, match="unknown parameter"):
        make_workload("coder", users=3)
    with pytest.raises(UserError):
        make_workload("api", rate=0.0)


def test_overrides_apply() -> None:
    reqs = take("coder", 500, projects=1, files_per_project=1)
    prefix = reqs[0].block_ids[:-9]
    assert all(r.block_ids[: len(prefix)] == prefix for r in reqs)
    assert {r.user for r in reqs} == {"project-0"}


def test_chatbot_turns_extend_previous_turn() -> None:
    cfg = ChatbotConfig()
    by_session: dict[int, list[Request]] = defaultdict(list)
    for r in take("chatbot", 3000, seed=5):
        by_session[r.session].append(r)
    multi = [turns for turns in by_session.values() if len(turns) >= 3]
    assert len(multi) > 50
    for turns in multi:
        for prev, nxt in itertools.pairwise(turns):
            assert nxt.block_ids[: len(prev.block_ids)] == prev.block_ids
            assert nxt.prompt_len > prev.prompt_len + prev.output_len  # + answer + new message
            gap = nxt.arrival - prev.arrival
            assert gap >= cfg.ttft_est_s + prev.output_len * cfg.tpot_est_s  # open-loop response estimate
    assert len({turns[0].block_ids[0] for turns in by_session.values()}) <= cfg.system_prompts


def test_chatbot_concurrency_near_users() -> None:
    cfg = ChatbotConfig()
    reqs = list(make_workload("chatbot", seed=0, duration=900.0))
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for r in reqs:
        first.setdefault(r.session, r.arrival)
        last[r.session] = r.arrival
    for t in (100.0, 400.0, 700.0):
        # live at t: started, and its last turn (+ up to a mean think time) not before t
        live = sum(1 for s in first if first[s] <= t <= last[s] + cfg.think_time_mean_s)
        assert 0.7 * cfg.users < live < 1.3 * cfg.users


def test_coder_shares_project_prefix_and_new_tokens_mean() -> None:
    cfg = CoderConfig()
    reqs = take("coder", 6000, seed=0)
    by_project: dict[str | None, list[Request]] = defaultdict(list)
    for r in reqs:
        by_project[r.user].append(r)
    assert 2 <= len(by_project) <= cfg.projects
    for group in by_project.values():
        shortest = min(len(r.block_ids) for r in group)
        common = 0
        while common < shortest and len({r.block_ids[common] for r in group}) == 1:
            common += 1
        assert common * 16 >= cfg.repo_tokens_min  # the repository context is one shared block chain
    # new tokens = prompt − shared (repo + file) prefix; shared blocks are the ones seen in >= 2 requests
    uses: dict[int, int] = defaultdict(int)
    for r in reqs:
        for b in r.block_ids:
            uses[b] += 1
    news = []
    for r in reqs:
        k = 0
        while k < len(r.block_ids) and uses[r.block_ids[k]] >= 2:
            k += 1
        news.append(r.prompt_len - k * 16)
    assert abs(sum(news) / len(news) - cfg.new_tokens_mean) < 0.1 * cfg.new_tokens_mean
    mean_out = sum(r.output_len for r in reqs) / len(reqs)
    assert 20 < mean_out < 36  # Azure code 2023: 28


def test_api_unique_blocks_bursty_and_rate() -> None:
    reqs = list(make_workload("api", seed=0, duration=300.0))
    rate = len(reqs) / 300.0
    assert 30.0 < rate < 50.0  # 40 req/s base
    ids = [b for r in reqs for b in r.block_ids]
    assert len(ids) == len(set(ids))  # no prefix sharing at all
    assert {r.user for r in reqs} == {c.name for c in ApiConfig().clients}
    # per-second counts are overdispersed (bursty): variance well above the Poisson variance (= mean)
    counts = [0] * 300
    for r in reqs:
        counts[int(r.arrival)] += 1
    mean = sum(counts) / 300
    var = sum((c - mean) ** 2 for c in counts) / 300
    assert var > 2.0 * mean


def test_weibull_shape_for_cv() -> None:
    k = _weibull_shape_for_cv(1.0)
    assert math.isclose(k, 1.0, rel_tol=1e-6)  # exponential
    assert _weibull_shape_for_cv(9.0) < 0.3 < _weibull_shape_for_cv(2.0)


def test_agent_steps_extend_shared_tool_prefix() -> None:
    reqs = take("agent", 3000, seed=0)
    by_task: dict[int, list[Request]] = defaultdict(list)
    for r in reqs:
        by_task[r.session].append(r)
    assert sum(1 for steps in by_task.values() if len(steps) >= 3) > 50
    for steps in by_task.values():
        for prev, nxt in itertools.pairwise(steps):
            assert nxt.block_ids[: len(prev.block_ids)] == prev.block_ids
    firsts = {steps[0].block_ids[:256] for steps in by_task.values()}
    assert len(firsts) <= 6  # all tasks start on one of the few tool prefixes (>= 4096 tokens)
    assert 5000 < sum(r.prompt_len for r in reqs) / len(reqs) < 12000  # Mooncake tool-agent: 8,596


def _peak_bytes(stream: Iterator[Request], n: int) -> int:
    tracemalloc.start()
    try:
        for _ in itertools.islice(stream, n):
            pass
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("name", NAMES)
def test_memory_bounded_by_live_sessions(name: str) -> None:
    small = _peak_bytes(make_workload(name, duration=math.inf), 1000)
    large = _peak_bytes(make_workload(name, duration=math.inf), 10000)
    assert large < 3 * small + 1_000_000  # 10x the requests, not 10x the memory


def test_multiturn_prompts_are_mostly_their_conversations_history() -> None:
    """The main job's workload: past the first turn, most of a prompt is the conversation's own
    earlier turns, not the shared system prompt; answers are short."""
    by_session: dict[int, list[Request]] = defaultdict(list)
    reqs = take("multiturn", 2000, seed=3)
    for r in reqs:
        by_session[r.session].append(r)
    later = [t for turns in by_session.values() for t in turns[1:]]
    assert len(later) > 500
    # the first turn's prompt bounds the system prompt + first message: later turns are far longer
    firsts = {s: turns[0].prompt_len for s, turns in by_session.items()}
    shares = [1 - firsts[r.session] / r.prompt_len for r in later]
    assert sum(shares) / len(shares) > 0.5
    assert sorted(r.output_len for r in reqs)[len(reqs) // 2] < 64


def test_hotspot_trace_shape() -> None:
    """The issue-16 reproduction: 512-token blocks, ~1,000 requests in 150 s, 40 % share one 12-block
    prefix, median output ~28 tokens, arrivals in 3-second bursts."""
    from kvroute.workloads.synthetic import HotTraceConfig

    cfg = HotTraceConfig()
    reqs = [r for s in range(3) for r in make_workload("hotspot-trace", seed=s)]
    per_seed = len(reqs) / 3
    assert 900 < per_seed < 1100 and all(r.arrival < 150.0 for r in reqs)
    assert all(r.block_size == 512 and r.arrival % cfg.tick_s == 0 for r in reqs)
    by_head = defaultdict(list)
    for r in reqs:
        by_head[r.block_ids[:12] if len(r.block_ids) >= 12 else ()].append(r)
    hot_head, hot = max(((k, v) for k, v in by_head.items() if k), key=lambda kv: len(kv[1]))
    assert len(hot) / len(reqs) == pytest.approx(0.40, abs=0.03)
    assert all(r.req_class == "hot" for r in hot) and len(set(hot_head)) == 12
    assert sum(r.req_class == "hot" for r in reqs) == len(hot)  # no other request starts with those 12
    outputs = sorted(r.output_len for r in reqs)
    assert 20 <= outputs[len(outputs) // 2] <= 40
    hot_new = sorted(r.prompt_len - 12 * 512 for r in hot)
    assert 100 < hot_new[len(hot_new) // 2] < 600  # a hit costs a few hundred tokens, a miss 6k more


def test_longchat_opens_with_a_long_document_then_short_turns() -> None:
    """Long-context conversations: the first turn carries a pasted document (mean ~12 k tokens, some
    past 30 k), later turns add a few hundred tokens to that history, and no prompt exceeds 128 k."""
    by_session: dict[int, list[Request]] = defaultdict(list)
    reqs = take("longchat", 3000, seed=5)
    for r in reqs:
        by_session[r.session].append(r)
    firsts = [turns[0].prompt_len for turns in by_session.values()]
    assert 8_000 < sum(firsts) / len(firsts) < 18_000
    assert any(p > 30_000 for p in firsts) and max(r.prompt_len for r in reqs) < 131_072
    steps = [
        b.prompt_len - a.prompt_len for turns in by_session.values() for a, b in itertools.pairwise(turns)
    ]
    assert len(steps) > 1000
    assert 100 < sorted(steps)[len(steps) // 2] < 1000  # a question plus the previous answer
    # each later turn extends its conversation's blocks: the whole history is a reusable prefix
    assert all(
        b.block_ids[: len(a.block_ids)] == a.block_ids
        for turns in by_session.values()
        for a, b in itertools.pairwise(turns)
    )


def test_first_message_default_leaves_chatbot_unchanged() -> None:
    """``first_msg_mean`` = 0 draws nothing more: the chatbot stream is the one it always was."""
    a = list(itertools.islice(ChatbotConfig().requests(7), 500))
    b = list(itertools.islice(ChatbotConfig(first_msg_mean=0.0).requests(7), 500))
    assert a == b
    longer = list(itertools.islice(ChatbotConfig(first_msg_mean=5000.0).requests(7), 500))
    assert sum(r.prompt_len for r in longer) > 2 * sum(r.prompt_len for r in a)
    with pytest.raises(UserError, match="first_msg_mean"):
        ChatbotConfig(first_msg_mean=-1.0).requests(0)
