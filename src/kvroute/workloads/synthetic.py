"""Seeded synthetic workloads for the four scenarios of the design (seed doc §实验: ChatBot with 200
concurrent users, Coder completions averaging 128 new tokens, bursty short API requests, multi-hop
AgentTool tasks).

Every generator is a lazy stream of :class:`Request` in non-decreasing arrival order whose memory is
bounded by the number of *live* sessions/tasks, never by the number of requests. Randomness comes only
from one ``random.Random(seed)`` per stream, so a (config, seed) pair always yields the same requests.
Block ids come from a per-stream counter: a shared prefix (system prompt, repository, tool manifest) has
its ids drawn once and reused, and a conversation's next turn reuses all ids of the previous turn's full
blocks and appends fresh ones, exactly as chained block hashes would behave. Shared prefixes are whole
blocks (lengths are multiples of ``block_size``) so they are fully shareable.

Time: all generators work in "base" seconds; :func:`make_workload` divides arrivals by ``rate_scale``
(so ``rate_scale=2`` doubles every rate, think times included) and cuts the stream at ``duration``
seconds of scaled time. Multi-turn workloads are open loop: the next turn's arrival is the previous
arrival + an *estimate* of the previous response time (``ttft_est_s + output_len * tpot_est_s``) + a
think/tool time; it does not wait for the simulated engine's real response.

Base rates (rate_scale = 1), measured over 1200 s with seed 0 (see the tests and the report):
chatbot ≈ 8 req/s, coder 16 req/s, api 40 req/s, agent ≈ 7.7 req/s.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from kvroute.errors import UserError
from kvroute.workloads.request import Request

__all__ = [
    "WORKLOADS",
    "AgentConfig",
    "ApiClient",
    "ApiConfig",
    "ChatbotConfig",
    "CoderConfig",
    "HotPrefixConfig",
    "HotTraceConfig",
    "LongChatConfig",
    "MixedConfig",
    "WorkloadConfig",
    "make_workload",
    "scale_stream",
]

# The Qwen3-30B-A3B vLLM benchmark run in ../shared/profiles/llmservingsim (RTX PRO 6000, 300 ShareGPT
# requests at ~10 req/s) decodes at 25-50 ms per output token (e.g. bench-0: 532 tokens in 24.8 s);
# multi-turn generators use 40 ms/token and 0.5 s TTFT to estimate when an answer is complete.
_TPOT_EST_S = 0.04
_TTFT_EST_S = 0.5


# --------------------------------------------------------------------------------------------- helpers


class _Blocks:
    """Per-stream block id allocator: fresh ids 0, 1, 2, … (never reused within a stream)."""

    def __init__(self) -> None:
        self._next = 0

    def take(self, n: int) -> list[int]:
        """``n`` fresh ids."""
        start = self._next
        self._next += n
        return list(range(start, start + n))


class _Context:
    """A growing prompt: ``tokens`` tokens whose ``tokens // block_size`` full blocks have ``blocks`` ids.

    Appending tokens keeps the existing full blocks' ids (same prefix) and gives fresh ids to blocks that
    become full, including the previously partial last block (its content changed)."""

    __slots__ = ("block_size", "blocks", "tokens")

    def __init__(self, block_size: int, prefix_blocks: list[int], prefix_tokens: int) -> None:
        self.block_size = block_size
        self.blocks = list(prefix_blocks)
        self.tokens = prefix_tokens

    def extend(self, n: int, alloc: _Blocks) -> None:
        """Append ``n`` tokens (mutates ``tokens`` and ``blocks``)."""
        self.tokens += n
        missing = self.tokens // self.block_size - len(self.blocks)
        if missing > 0:
            self.blocks.extend(alloc.take(missing))


def _zipf_cum_weights(n: int, s: float) -> list[float]:
    """Cumulative weights of a Zipf(s) law over ranks 1..n (for ``random.choices``)."""
    return list(itertools.accumulate(1.0 / (k**s) for k in range(1, n + 1)))


def _pick(rng: random.Random, cum_weights: list[float]) -> int:
    """Index drawn with the given cumulative weights."""
    return bisect.bisect_right(cum_weights, rng.random() * cum_weights[-1])


def _lognormal_int(rng: random.Random, mean: float, sigma: float, lo: int, hi: int) -> int:
    """A lognormal integer with the given *mean* (before clamping) and log-space ``sigma``, in [lo, hi]."""
    mu = math.log(mean) - sigma * sigma / 2.0
    return max(lo, min(hi, round(rng.lognormvariate(mu, sigma))))


def _aligned_log_uniform(rng: random.Random, lo: int, hi: int, block_size: int) -> int:
    """A log-uniform length in [lo, hi] tokens rounded down to whole blocks (at least one block)."""
    n = math.exp(rng.uniform(math.log(lo), math.log(hi)))
    return max(block_size, int(n) // block_size * block_size)


def _weibull_shape_for_cv(cv: float) -> float:
    """The Weibull shape k whose coefficient of variation is ``cv`` (bisection on log k)."""

    def cv_of(k: float) -> float:
        g1 = math.lgamma(1.0 + 1.0 / k)
        g2 = math.lgamma(1.0 + 2.0 / k)
        return math.sqrt(max(0.0, math.exp(g2 - 2.0 * g1) - 1.0))

    lo, hi = 0.05, 50.0  # cv_of is decreasing in k
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if cv_of(mid) > cv:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def _check_common(cfg: WorkloadConfig) -> None:
    if cfg.block_size < 1:
        raise UserError(f"{cfg.name}: block_size must be >= 1, got {cfg.block_size}")
    if not cfg.duration_s > 0:
        raise UserError(f"{cfg.name}: duration_s must be > 0, got {cfg.duration_s}")


# ---------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class WorkloadConfig:
    """Fields every workload has. ``duration_s``: default length of a run in (scaled) seconds."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    # vLLM's default KV block size, used by the paper's testbed (ANCHORS: "block size 16").
    block_size: int = 16
    # The paper replays each trace for 1200 s (ANCHORS, paper setup).
    duration_s: float = 1200.0

    def requests(self, seed: int) -> Iterator[Request]:
        """The unscaled, unbounded stream (base seconds). Raises UserError on an invalid config."""
        raise NotImplementedError


@dataclass(frozen=True)
class ChatbotConfig(WorkloadConfig):
    """Multi-turn chat: ~``users`` concurrent conversations, each turn's prompt = the previous prompt +
    the previous answer + a new user message, so its block ids extend the previous turn's."""

    name: ClassVar[str] = "chatbot"
    description: ClassVar[str] = (
        "200 concurrent multi-turn chat users, shared system prompts, growing context"
    )
    # The quick start replays 300 s (≈ 2,500 requests at rate_scale 1); the paper's 1200 s via duration.
    duration_s: float = 300.0
    # Seed doc: "ChatBot：模拟200并发用户的对话场景" (200 concurrent users). Kept constant: a session that
    # ends is replaced by a new one (Poisson starts at users / mean session lifetime).
    users: int = 200
    # A few shared system prompts (one per product/app); Zipf-popular like Mooncake's conversation trace,
    # where every request starts with the same block 0 (one dominant system prompt).
    system_prompts: int = 8
    system_prompt_zipf: float = 1.0
    # System prompt length range, tokens (log-uniform, whole blocks): hundreds to ~2k tokens, Mooncake's
    # shared leading block being 512 tokens.
    system_prompt_tokens_min: int = 256
    system_prompt_tokens_max: int = 2048
    # Turns per conversation: geometric with this mean, capped. Multi-turn reuse is common in Mooncake's
    # conversation trace (39% of its requests repeat >= 2 leading 512-token blocks, i.e. more than the
    # shared block 0).
    mean_turns: float = 5.0
    max_turns: int = 30
    # New user message per turn, tokens (lognormal mean / sigma); ShareGPT-like questions of ~100-200 tokens.
    user_msg_mean: float = 150.0
    user_msg_sigma: float = 1.0
    # Answer length, tokens: between Azure conv 2023 (mean 211 generated tokens) and Mooncake conversation
    # (mean 343).
    output_mean: float = 260.0
    output_sigma: float = 0.8
    output_max: int = 4096
    # Think time between an answer and the next question, seconds (exponential): "tens of seconds".
    think_time_mean_s: float = 15.0
    # Qwen3-30B-A3B's native context (32k): a conversation ends when the next prompt would exceed it.
    max_context_tokens: int = 32768
    # Open-loop estimate of a response's duration (seconds): ttft + output_len * tpot (see module doc).
    ttft_est_s: float = _TTFT_EST_S
    tpot_est_s: float = _TPOT_EST_S
    # The first user message (tokens, lognormal mean / sigma); 0: like every other turn's. A document,
    # a code file or a transcript pasted to open a conversation (``longchat``).
    first_msg_mean: float = 0.0
    first_msg_sigma: float = 1.0

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if self.users < 1 or self.system_prompts < 1 or self.mean_turns < 1 or self.max_turns < 1:
            raise UserError(f"{self.name}: users, system_prompts, mean_turns and max_turns must be >= 1")
        if self.first_msg_mean < 0:
            raise UserError(f"{self.name}: first_msg_mean must be >= 0")
        return _chatbot(self, random.Random(seed))


@dataclass(frozen=True)
class MultiTurnConfig(ChatbotConfig):
    """Conversation-dominated chat: the chatbot's users with short system prompts, long user turns, a
    short think time and short answers, so that a prompt is mostly its own conversation's history and
    where a turn lands decides how much of it must be prefilled again. The main job (``kvroute demo``)
    replays it: with 4 instances a cache-blind balancer recomputes ~2/3 of every prompt, a KV-aware
    router ~1/3, and the difference shows in TTFT near the balancer's knee."""

    name: ClassVar[str] = "multiturn"
    description: ClassVar[str] = (
        "chat whose prompts are mostly the conversation's own history (short system prompts, ~500-token "
        "user turns, 5 s think time, short answers)"
    )
    # Short system prompts (64-128 tokens): the shared part every instance caches is small.
    system_prompt_tokens_min: int = 64
    system_prompt_tokens_max: int = 128
    # Long user turns (pasted text, documents): ~500 tokens each, lognormal.
    user_msg_mean: float = 500.0
    # Quick follow-ups: 5 s think time, 8 turns on average.
    think_time_mean_s: float = 5.0
    mean_turns: float = 8.0
    # Short answers (~32 tokens): prefill, not decode, decides the load; light on HTTP streaming.
    output_mean: float = 32.0


@dataclass(frozen=True)
class LongChatConfig(ChatbotConfig):
    """Long-context conversations: each opens with a long pasted document (lognormal, mean 12 k tokens,
    up to the 128 k context), then short questions about it with short answers, so every turn re-reads
    a long, growing history. Modelled on the shape of Mooncake's conversation trace (a mean prompt of
    13–15 k tokens, up to ~120 k, 39 % of requests repeating more than the shared first block). Here a
    router must weigh where a conversation's history is cached against what the instances already
    hold: a few long decodes cost a step as much as many short ones."""

    name: ClassVar[str] = "longchat"
    description: ClassVar[str] = (
        "conversations that open with a long document (mean 12k tokens, up to 128k) and go on with short "
        "questions and answers about it"
    )
    users: int = 64
    system_prompt_tokens_min: int = 64
    system_prompt_tokens_max: int = 512
    first_msg_mean: float = 12000.0
    user_msg_mean: float = 200.0
    think_time_mean_s: float = 10.0
    mean_turns: float = 6.0
    output_mean: float = 120.0
    # Qwen3's 32 k native context extended 4× with YaRN, as Qwen documents for long inputs.
    max_context_tokens: int = 131072


@dataclass(frozen=True)
class CoderConfig(WorkloadConfig):
    """Code completion: every request = its project's repository context + one of its open files (both
    shared, whole blocks) + ~128 new tokens; short outputs; Poisson arrivals."""

    name: ClassVar[str] = "coder"
    description: ClassVar[str] = (
        "code completion: shared per-project repository + file context, ~128 new tokens"
    )
    # Requests/s at rate_scale 1 for 16 instances: ~1 req/s/instance; with ~4-5k-token prompts that is
    # ~70k prompt tokens/s cluster-wide, i.e. moderate when cached and heavy when not (cache-awareness
    # matters, as in the paper's coder results). Azure code 2023 runs 2.6 req/s on a smaller deployment.
    rate: float = 16.0
    # A few projects with skewed popularity (Zipf 1.0: the top project gets ~37% of requests of 8).
    projects: int = 8
    project_zipf: float = 1.0
    # Repository context (retrieved snippets, imports), tokens, log-uniform: "thousands of tokens"; Azure
    # code 2023 prompts average 2,048 tokens.
    repo_tokens_min: int = 2048
    repo_tokens_max: int = 6144
    # Open files per project (uniform choice) and their context, tokens (log-uniform).
    files_per_project: int = 16
    file_tokens_min: int = 256
    file_tokens_max: int = 1024
    # New tokens on top (cursor context, edit): seed doc "Coder：代码补全请求，平均长度128令牌".
    new_tokens_mean: float = 128.0
    new_tokens_sigma: float = 0.6
    # Completion length, tokens: Azure code 2023 mean GeneratedTokens = 28.
    output_mean: float = 28.0
    output_sigma: float = 0.8
    output_max: int = 512

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.rate > 0 or self.projects < 1 or self.files_per_project < 1:
            raise UserError("coder: rate must be > 0 and projects, files_per_project >= 1")
        return _coder(self, random.Random(seed))


@dataclass(frozen=True)
class ApiClient:
    """One API client's arrival process: ``share`` of the workload's rate, inter-arrival law
    (``"gamma"`` or ``"weibull"``) with coefficient of variation ``cv``."""

    name: str
    share: float
    law: str
    cv: float


# The five heaviest clients of ServeGen's language/m-small (Alibaba Bailian, arXiv:2505.09999; data
# github.com/alibaba/ServeGen data/language/m-small, commit aa74336): share = client's mean released rate
# over 14 days (350.9, 257.2, 125.9, 103.5, 66.8 req/s) / their sum; cv = the client's median per-window
# inter-arrival CV; law = the client's dominant per-window IAT pattern. Most traffic is near-Poisson
# (CV ≈ 1.1) with one very bursty client (CV ≈ 9, Weibull) — the "API burst" of the seed doc.
SERVEGEN_M_SMALL_TOP5: tuple[ApiClient, ...] = (
    ApiClient("servegen-chunk-5", 0.388, "gamma", 1.116),
    ApiClient("servegen-chunk-38", 0.284, "gamma", 1.115),
    ApiClient("servegen-chunk-17", 0.139, "gamma", 1.112),
    ApiClient("servegen-chunk-14", 0.115, "weibull", 9.124),
    ApiClient("servegen-chunk-27", 0.074, "weibull", 1.172),
)


@dataclass(frozen=True)
class ApiConfig(WorkloadConfig):
    """Short independent requests (unique blocks, no shared prefix) from several clients whose arrival
    processes are renewal processes with ServeGen's per-client burstiness."""

    name: ClassVar[str] = "api"
    description: ClassVar[str] = "short independent API requests, bursty ServeGen client arrivals"
    # Requests/s at rate_scale 1: short prompts on a small model (paper: Qwen2.5-7B for API) make 40 req/s
    # (2.5/instance) a moderate load for 16 instances.
    rate: float = 40.0
    clients: tuple[ApiClient, ...] = SERVEGEN_M_SMALL_TOP5
    # Prompt tokens, lognormal: ServeGen m-small input PMFs pooled over clients/windows have mean 669 and
    # median 228 tokens → sigma = sqrt(2 ln(669/228)) ≈ 1.47.
    prompt_mean: float = 669.0
    prompt_sigma: float = 1.47
    prompt_max: int = 16384
    # Output tokens, lognormal: ServeGen m-small output PMFs mean 70, median 22 → sigma ≈ 1.52.
    output_mean: float = 70.0
    output_sigma: float = 1.52
    output_max: int = 2048

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.rate > 0 or not self.clients:
            raise UserError("api: rate must be > 0 and at least one client given")
        for c in self.clients:
            if c.law not in ("gamma", "weibull") or not c.cv > 0 or not c.share > 0:
                raise UserError(f"api: client {c.name}: law must be gamma|weibull, cv and share > 0")
        return _api(self, random.Random(seed))


@dataclass(frozen=True)
class AgentConfig(WorkloadConfig):
    """Multi-hop tool calling: each task starts from one of a few long shared tool/instruction prefixes,
    then runs several steps; each step's prompt = previous prompt + previous output (the tool call) +
    the tool's result, so steps extend the same block chain."""

    name: ClassVar[str] = "agent"
    description: ClassVar[str] = "multi-hop tool-calling tasks on long shared tool prefixes"
    # Tasks/s at rate_scale 1 (Poisson); ≈ 3.9 steps each → ≈ 7.7 req/s of ~7k-token prompts, mostly cached.
    task_rate: float = 2.0
    # A few hot tool manifests / agent instructions (Zipf 1.2: the hottest gets ~45% of tasks of 6), the
    # skew behind the paper's §5.2 hot-prefix failure case.
    tool_prefixes: int = 6
    tool_prefix_zipf: float = 1.2
    # Tool prefix length, tokens (log-uniform, whole blocks): Mooncake's tool-agent trace averages 8,596
    # input tokens per request, most of it the shared tool/instruction prefix.
    tool_prefix_tokens_min: int = 4096
    tool_prefix_tokens_max: int = 8192
    # The task's user query, tokens (lognormal mean).
    query_mean: float = 200.0
    query_sigma: float = 0.8
    # Steps (LLM calls) per task: geometric (>= 1) with mean ``mean_steps`` (multi-hop), capped.
    mean_steps: float = 4.0
    max_steps: int = 16
    # Output per step (tool call or final answer), tokens: Mooncake tool-agent trace mean output 182.
    output_mean: float = 182.0
    output_sigma: float = 0.7
    output_max: int = 2048
    # Tool result appended per step, tokens (lognormal mean): search snippets, file reads.
    tool_result_mean: float = 400.0
    tool_result_sigma: float = 1.0
    # Tool execution latency between steps, seconds (exponential).
    tool_latency_mean_s: float = 2.0
    max_context_tokens: int = 32768
    ttft_est_s: float = _TTFT_EST_S
    tpot_est_s: float = _TPOT_EST_S

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.task_rate > 0 or self.tool_prefixes < 1 or self.mean_steps < 1 or self.max_steps < 1:
            raise UserError("agent: task_rate must be > 0; tool_prefixes, mean_steps, max_steps >= 1")
        return _agent(self, random.Random(seed))


# ------------------------------------------------------------------------------------------ generators


def _geometric(rng: random.Random, mean: float, cap: int) -> int:
    """A geometric count >= 1 with the given mean, capped at ``cap``."""
    if mean <= 1.0:
        return 1
    p = 1.0 / mean
    u = 1.0 - rng.random()  # in (0, 1]
    return min(cap, 1 + int(math.log(u) / math.log(1.0 - p)))


def _shared_prefixes(
    rng: random.Random, alloc: _Blocks, n: int, lo: int, hi: int, block_size: int
) -> list[tuple[int, list[int]]]:
    """``n`` shared prefixes as (tokens, block ids), lengths whole blocks in [lo, hi]."""
    out = []
    for _ in range(n):
        tokens = _aligned_log_uniform(rng, lo, hi, block_size)
        out.append((tokens, alloc.take(tokens // block_size)))
    return out


@dataclass(slots=True)
class _Conversation:
    """A live chat session (mutable generator state)."""

    session: int
    context: _Context
    turns_left: int
    opened: bool = False  # its first user message has been asked


def _chatbot(cfg: ChatbotConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    prompts = _shared_prefixes(
        rng, alloc, cfg.system_prompts, cfg.system_prompt_tokens_min, cfg.system_prompt_tokens_max, bs
    )
    popularity = _zipf_cum_weights(cfg.system_prompts, cfg.system_prompt_zipf)
    out_mean = min(cfg.output_mean, cfg.output_max)
    gap = cfg.think_time_mean_s + cfg.ttft_est_s + out_mean * cfg.tpot_est_s  # mean seconds between turns
    start_rate = cfg.users / (cfg.mean_turns * gap)  # new sessions/s keeping ~users alive (Little's law)
    heap: list[tuple[float, int, _Conversation]] = []
    sessions = itertools.count()
    seq = itertools.count()

    def new_session(t: float) -> None:
        tokens, blocks = prompts[_pick(rng, popularity)]
        conv = _Conversation(
            next(sessions), _Context(bs, blocks, tokens), _geometric(rng, cfg.mean_turns, cfg.max_turns)
        )
        heapq.heappush(heap, (t, next(seq), conv))

    for _ in range(cfg.users):  # warm start: the first turns of `users` sessions spread over one gap
        new_session(rng.uniform(0.0, gap))
    next_start = rng.expovariate(start_rate)
    req_ids = itertools.count()
    while True:
        if next_start <= heap[0][0]:
            new_session(next_start)
            next_start += rng.expovariate(start_rate)
            continue
        t, _, conv = heapq.heappop(heap)
        ctx = conv.context
        first = cfg.first_msg_mean > 0 and not conv.opened
        conv.opened = True
        mean, sigma = (
            (cfg.first_msg_mean, cfg.first_msg_sigma) if first else (cfg.user_msg_mean, cfg.user_msg_sigma)
        )
        ctx.extend(_lognormal_int(rng, mean, sigma, 1, cfg.max_context_tokens), alloc)
        if ctx.tokens >= cfg.max_context_tokens:
            continue  # the conversation no longer fits: it ends (a new one replaces it over time)
        out = _lognormal_int(rng, cfg.output_mean, cfg.output_sigma, 1, cfg.output_max)
        yield Request(next(req_ids), t, ctx.tokens, out, tuple(ctx.blocks), bs, conv.session, None, "chat")
        conv.turns_left -= 1
        if conv.turns_left > 0:
            ctx.extend(out, alloc)  # the answer joins the context of the next turn
            respond = cfg.ttft_est_s + out * cfg.tpot_est_s
            heapq.heappush(
                heap, (t + respond + rng.expovariate(1.0 / cfg.think_time_mean_s), next(seq), conv)
            )


def _coder(cfg: CoderConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    repos = _shared_prefixes(rng, alloc, cfg.projects, cfg.repo_tokens_min, cfg.repo_tokens_max, bs)
    files: list[list[tuple[int, list[int]]]] = []
    for repo_tokens, repo_blocks in repos:
        files.append(
            [
                (repo_tokens + tokens, repo_blocks + blocks)
                for tokens, blocks in _shared_prefixes(
                    rng, alloc, cfg.files_per_project, cfg.file_tokens_min, cfg.file_tokens_max, bs
                )
            ]
        )
    popularity = _zipf_cum_weights(cfg.projects, cfg.project_zipf)
    t = 0.0
    for req_id in itertools.count():
        t += rng.expovariate(cfg.rate)
        project = _pick(rng, popularity)
        prefix_tokens, prefix_blocks = files[project][rng.randrange(cfg.files_per_project)]
        ctx = _Context(bs, prefix_blocks, prefix_tokens)
        ctx.extend(_lognormal_int(rng, cfg.new_tokens_mean, cfg.new_tokens_sigma, 1, 8192), alloc)
        out = _lognormal_int(rng, cfg.output_mean, cfg.output_sigma, 1, cfg.output_max)
        yield Request(req_id, t, ctx.tokens, out, tuple(ctx.blocks), bs, -1, f"project-{project}", "coder")
    raise AssertionError("unreachable")  # pragma: no cover


def _iat_sampler(client: ApiClient, rate: float) -> tuple[str, float, float]:
    """(law, shape, scale) of a renewal process with mean inter-arrival 1/rate seconds and CV ``cv``."""
    mean = 1.0 / rate
    if client.law == "gamma":
        shape = 1.0 / (client.cv * client.cv)
        return "gamma", shape, mean / shape
    k = _weibull_shape_for_cv(client.cv)
    return "weibull", k, mean / math.exp(math.lgamma(1.0 + 1.0 / k))


def _draw_iat(rng: random.Random, law: str, shape: float, scale: float) -> float:
    if law == "gamma":
        return rng.gammavariate(shape, scale)
    return rng.weibullvariate(scale, shape)


def _api(cfg: ApiConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    total = sum(c.share for c in cfg.clients)
    laws = [_iat_sampler(c, cfg.rate * c.share / total) for c in cfg.clients]
    # One renewal process per client, merged by time. A stationary start would need the equilibrium
    # residual law; we start each client with one full inter-arrival instead.
    heap = [(_draw_iat(rng, *laws[i]), i) for i in range(len(cfg.clients))]
    heapq.heapify(heap)
    for req_id in itertools.count():
        t, i = heap[0]
        heapq.heapreplace(heap, (t + _draw_iat(rng, *laws[i]), i))
        prompt = _lognormal_int(rng, cfg.prompt_mean, cfg.prompt_sigma, 1, cfg.prompt_max)
        out = _lognormal_int(rng, cfg.output_mean, cfg.output_sigma, 1, cfg.output_max)
        yield Request(
            req_id, t, prompt, out, tuple(alloc.take(prompt // bs)), bs, -1, cfg.clients[i].name, "api"
        )
    raise AssertionError("unreachable")  # pragma: no cover


def _agent(cfg: AgentConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    prefixes = _shared_prefixes(
        rng, alloc, cfg.tool_prefixes, cfg.tool_prefix_tokens_min, cfg.tool_prefix_tokens_max, bs
    )
    popularity = _zipf_cum_weights(cfg.tool_prefixes, cfg.tool_prefix_zipf)
    heap: list[tuple[float, int, _Conversation]] = []
    tasks = itertools.count()
    seq = itertools.count()
    next_task = rng.expovariate(cfg.task_rate)
    req_ids = itertools.count()
    while True:
        if not heap or next_task <= heap[0][0]:
            tokens, blocks = prefixes[_pick(rng, popularity)]
            ctx = _Context(bs, blocks, tokens)
            ctx.extend(_lognormal_int(rng, cfg.query_mean, cfg.query_sigma, 1, 8192), alloc)
            task = _Conversation(next(tasks), ctx, _geometric(rng, cfg.mean_steps, cfg.max_steps))
            heapq.heappush(heap, (next_task, next(seq), task))
            next_task += rng.expovariate(cfg.task_rate)
            continue
        t, _, task = heapq.heappop(heap)
        ctx = task.context
        if ctx.tokens >= cfg.max_context_tokens:
            continue  # the task ran out of context: it ends
        out = _lognormal_int(rng, cfg.output_mean, cfg.output_sigma, 1, cfg.output_max)
        yield Request(next(req_ids), t, ctx.tokens, out, tuple(ctx.blocks), bs, task.session, None, "agent")
        task.turns_left -= 1
        if task.turns_left > 0:
            ctx.extend(out, alloc)  # the tool call
            ctx.extend(_lognormal_int(rng, cfg.tool_result_mean, cfg.tool_result_sigma, 1, 16384), alloc)
            respond = cfg.ttft_est_s + out * cfg.tpot_est_s
            heapq.heappush(
                heap, (t + respond + rng.expovariate(1.0 / cfg.tool_latency_mean_s), next(seq), task)
            )


@dataclass(frozen=True)
class HotPrefixConfig(WorkloadConfig):
    """One hot shared prefix among cold requests, built to meet the LMetric paper's hot-spot condition
    (§5.2): a share ``hot_share`` of the requests (x = 0.5 by default) starts with the same long prefix
    (a shared document or tool manifest of ``hot_prefix_tokens``), the rest are unique prompts. Under
    P-token × BS the few instances caching the prefix keep winning its requests (their P-token is ~40×
    smaller) while they hold far less than x of the cluster: x/(1−x) = 1 > |M|/(N−|M|) for |M| < N/2."""

    name: ClassVar[str] = "hotspot"
    description: ClassVar[str] = "half the requests share one long hot prefix (the paper's KV hot-spot case)"
    duration_s: float = 300.0
    # Requests/s at rate_scale 1 (Poisson): ~1.5/s per instance of 16, a moderate load when the hot
    # prefix is cached and a heavy one on the instances that take all of the hot class.
    rate: float = 24.0
    hot_share: float = 0.5
    # The hot prefix appears at this time (seconds, base time): caches are warm and the cluster busy
    # when it goes viral, as with a newly released tool or document; before it every request is cold.
    hot_start_s: float = 60.0
    # ... and its share grows linearly from 0 to ``hot_share`` over this many seconds. A gradual rise is
    # what makes it a hot spot: the first requests teach one instance the prefix, and P-token × BS then
    # keeps the class there (a sudden full-rate start spreads it while the first prefill runs).
    hot_ramp_s: float = 120.0
    # The hot prefix, tokens (whole blocks): a long shared document / tool manifest, as in Mooncake's
    # tool-agent trace (8.6k input tokens on average, mostly shared).
    hot_prefix_tokens: int = 8192
    # Per-request new tokens after the hot prefix (lognormal mean / sigma).
    suffix_mean: float = 200.0
    suffix_sigma: float = 0.8
    # Cold requests: unique prompts, tokens (lognormal), like the api workload's.
    cold_prompt_mean: float = 1500.0
    cold_prompt_sigma: float = 1.0
    prompt_max: int = 16384
    # Output tokens (lognormal), both kinds: Mooncake conversation mean output 343 (answers over a shared
    # document). Long answers make the decode batches on the hot instances what hurts.
    output_mean: float = 343.0
    output_sigma: float = 0.7
    output_max: int = 2048

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.rate > 0 or not 0 <= self.hot_share <= 1 or self.hot_prefix_tokens < self.block_size:
            raise UserError("hotspot: rate > 0, hot_share in [0, 1], hot_prefix_tokens >= one block")
        return _hotspot(self, random.Random(seed))


@dataclass(frozen=True)
class HotTraceConfig(WorkloadConfig):
    """A short Mooncake-format trace with one hot prefix from the start (issue 16's reproduction of a real
    arXiv-Mooncake-style sample): 512-token blocks, ~1,000 requests in 150 s, arrivals in bursts (Poisson
    arrivals rounded down to a ``tick_s`` grid, as the trace's millisecond timestamps come in batches every
    ~3 s). Three kinds of request:

    - **hot** (``hot_share`` = 40 %): the same ``hot_prefix_blocks`` = 12 blocks (6,144 tokens, a tool
      manifest) + a short lognormal suffix (mean ``hot_suffix_mean`` tokens); very short answers;
    - **tool** (``tool_share`` = 15 %): a second shared prefix of ``tool_prefix_blocks`` = 5 blocks + a
      short suffix, short answers;
    - **chat** (the rest): block 0 shared by all (a system prompt of one block) + a unique context
      (lognormal mean ``chat_prompt_mean`` tokens), answers of lognormal mean ``chat_output_mean``.

    Short answers are lognormal with median ``short_output_median`` (the trace's median output is ~28
    tokens). A hot request that hits the cache costs ~``hot_suffix_mean`` prefill tokens; one that misses
    costs 6k: spreading the hot class multiplies its prefill work ~20×. Run on 8 instances at
    ``--rate-scale 1`` and ``2``."""

    name: ClassVar[str] = "hotspot-trace"
    description: ClassVar[str] = (
        "Mooncake-shaped bursts: 40 % share one 12-block (6k-token) prefix, short outputs"
    )
    block_size: int = 512
    duration_s: float = 150.0
    # Requests/s at rate_scale 1: 1,000 requests in 150 s; arrivals rounded down to multiples of tick_s.
    rate: float = 1000.0 / 150.0
    tick_s: float = 3.0
    hot_share: float = 0.4
    hot_prefix_blocks: int = 12
    hot_suffix_mean: float = 400.0
    tool_share: float = 0.15
    tool_prefix_blocks: int = 5
    tool_suffix_mean: float = 400.0
    suffix_sigma: float = 1.0
    chat_prompt_mean: float = 10000.0
    chat_prompt_sigma: float = 0.9
    chat_output_mean: float = 400.0
    chat_output_sigma: float = 0.6
    short_output_median: float = 14.0
    short_output_sigma: float = 0.5
    prompt_max: int = 65536
    output_max: int = 2048

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.rate > 0 or not self.tick_s >= 0:
            raise UserError("hotspot-trace: rate > 0, tick_s >= 0")
        if not (self.hot_share >= 0 and self.tool_share >= 0 and self.hot_share + self.tool_share <= 1):
            raise UserError("hotspot-trace: hot_share, tool_share >= 0 with a sum <= 1")
        if self.hot_prefix_blocks < 1 or self.tool_prefix_blocks < 1 or not self.short_output_median >= 1:
            raise UserError("hotspot-trace: prefix blocks >= 1, short_output_median >= 1")
        return _hot_trace(self, random.Random(seed))


@dataclass(frozen=True)
class MixedConfig(WorkloadConfig):
    """Two request classes on one cluster: interactive chat (class ``ttft``: shared system prompts,
    short answers) and batch generation (class ``tpot``: a shared instruction plus a unique document,
    long outputs). Poisson arrivals for each; for evaluating per-class weighting (design §5.3)."""

    name: ClassVar[str] = "mixed"
    description: ClassVar[str] = (
        "interactive chat (class ttft) mixed with long batch generations (class tpot)"
    )
    duration_s: float = 300.0
    # Interactive requests/s and batch requests/s at rate_scale 1.
    chat_rate: float = 12.0
    batch_rate: float = 4.0
    # Chat: a few Zipf-popular system prompts (tokens, whole blocks) + a user message.
    system_prompts: int = 8
    system_prompt_zipf: float = 1.0
    system_prompt_tokens_min: int = 512
    system_prompt_tokens_max: int = 2048
    chat_msg_mean: float = 300.0
    chat_msg_sigma: float = 1.0
    chat_output_mean: float = 150.0
    chat_output_sigma: float = 0.8
    # Batch: a few shared task instructions + a unique document; long generations (summaries, reports).
    batch_instructions: int = 4
    batch_instruction_tokens: int = 1024
    batch_doc_mean: float = 2000.0
    batch_doc_sigma: float = 0.8
    batch_output_mean: float = 600.0
    batch_output_sigma: float = 0.5
    prompt_max: int = 16384
    output_max: int = 4096

    def requests(self, seed: int) -> Iterator[Request]:
        _check_common(self)
        if not self.chat_rate > 0 or not self.batch_rate > 0:
            raise UserError("mixed: chat_rate and batch_rate must be > 0")
        if self.system_prompts < 1 or self.batch_instructions < 1:
            raise UserError("mixed: system_prompts and batch_instructions must be >= 1")
        return _mixed(self, random.Random(seed))


def _hotspot(cfg: HotPrefixConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    hot_tokens = cfg.hot_prefix_tokens // bs * bs
    hot_blocks = alloc.take(hot_tokens // bs)
    t = 0.0
    for req_id in itertools.count():
        t += rng.expovariate(cfg.rate)
        out = _lognormal_int(rng, cfg.output_mean, cfg.output_sigma, 1, cfg.output_max)
        ramp = (t - cfg.hot_start_s) / cfg.hot_ramp_s if cfg.hot_ramp_s > 0 else 1.0
        if t >= cfg.hot_start_s and rng.random() < cfg.hot_share * min(1.0, ramp):
            ctx = _Context(bs, hot_blocks, hot_tokens)
            ctx.extend(_lognormal_int(rng, cfg.suffix_mean, cfg.suffix_sigma, 1, cfg.prompt_max), alloc)
            yield Request(req_id, t, ctx.tokens, out, tuple(ctx.blocks), bs, -1, None, "hot")
        else:
            prompt = _lognormal_int(rng, cfg.cold_prompt_mean, cfg.cold_prompt_sigma, 1, cfg.prompt_max)
            yield Request(req_id, t, prompt, out, tuple(alloc.take(prompt // bs)), bs, -1, None, "cold")
    raise AssertionError("unreachable")  # pragma: no cover


def _hot_trace(cfg: HotTraceConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    system = alloc.take(1)
    hot = alloc.take(cfg.hot_prefix_blocks)
    tool = alloc.take(cfg.tool_prefix_blocks)
    short_mean = cfg.short_output_median * math.exp(cfg.short_output_sigma**2 / 2.0)
    t = 0.0
    for req_id in itertools.count():
        t += rng.expovariate(cfg.rate)
        arrival = math.floor(t / cfg.tick_s) * cfg.tick_s if cfg.tick_s > 0 else t
        u = rng.random()
        if u < cfg.hot_share + cfg.tool_share:
            kind, prefix, mean = (
                ("hot", hot, cfg.hot_suffix_mean)
                if u < cfg.hot_share
                else ("tool", tool, cfg.tool_suffix_mean)
            )
            ctx = _Context(bs, prefix, len(prefix) * bs)
            ctx.extend(_lognormal_int(rng, mean, cfg.suffix_sigma, 1, cfg.prompt_max), alloc)
            out = _lognormal_int(rng, short_mean, cfg.short_output_sigma, 1, cfg.output_max)
        else:
            kind = "chat"
            ctx = _Context(bs, system, bs)
            ctx.extend(
                _lognormal_int(rng, cfg.chat_prompt_mean, cfg.chat_prompt_sigma, 1, cfg.prompt_max), alloc
            )
            out = _lognormal_int(rng, cfg.chat_output_mean, cfg.chat_output_sigma, 1, cfg.output_max)
        yield Request(req_id, arrival, ctx.tokens, out, tuple(ctx.blocks), bs, -1, None, kind)
    raise AssertionError("unreachable")  # pragma: no cover


def _mixed(cfg: MixedConfig, rng: random.Random) -> Iterator[Request]:
    bs = cfg.block_size
    alloc = _Blocks()
    prompts = _shared_prefixes(
        rng, alloc, cfg.system_prompts, cfg.system_prompt_tokens_min, cfg.system_prompt_tokens_max, bs
    )
    popularity = _zipf_cum_weights(cfg.system_prompts, cfg.system_prompt_zipf)
    tokens = max(bs, cfg.batch_instruction_tokens // bs * bs)
    instructions = [(tokens, alloc.take(tokens // bs)) for _ in range(cfg.batch_instructions)]
    next_chat = rng.expovariate(cfg.chat_rate)
    next_batch = rng.expovariate(cfg.batch_rate)
    for req_id in itertools.count():
        if next_chat <= next_batch:
            t = next_chat
            next_chat += rng.expovariate(cfg.chat_rate)
            prefix_tokens, prefix_blocks = prompts[_pick(rng, popularity)]
            ctx = _Context(bs, prefix_blocks, prefix_tokens)
            ctx.extend(_lognormal_int(rng, cfg.chat_msg_mean, cfg.chat_msg_sigma, 1, cfg.prompt_max), alloc)
            out = _lognormal_int(rng, cfg.chat_output_mean, cfg.chat_output_sigma, 1, cfg.output_max)
            yield Request(req_id, t, ctx.tokens, out, tuple(ctx.blocks), bs, -1, None, "ttft")
        else:
            t = next_batch
            next_batch += rng.expovariate(cfg.batch_rate)
            prefix_tokens, prefix_blocks = instructions[rng.randrange(cfg.batch_instructions)]
            ctx = _Context(bs, prefix_blocks, prefix_tokens)
            ctx.extend(_lognormal_int(rng, cfg.batch_doc_mean, cfg.batch_doc_sigma, 1, cfg.prompt_max), alloc)
            out = _lognormal_int(rng, cfg.batch_output_mean, cfg.batch_output_sigma, 1, cfg.output_max)
            yield Request(req_id, t, ctx.tokens, out, tuple(ctx.blocks), bs, -1, None, "tpot")
    raise AssertionError("unreachable")  # pragma: no cover


# ------------------------------------------------------------------------------------------- registry


WORKLOADS: dict[str, type[WorkloadConfig]] = {
    cls.name: cls
    for cls in (
        ChatbotConfig,
        MultiTurnConfig,
        CoderConfig,
        ApiConfig,
        AgentConfig,
        LongChatConfig,
        HotPrefixConfig,
        HotTraceConfig,
        MixedConfig,
    )
}
"""Workload name → config class (each field documented with its source; ``description`` says what it is)."""


def scale_stream(requests: Iterator[Request], rate_scale: float, duration: float | None) -> Iterator[Request]:
    """Divide arrivals by ``rate_scale`` (> 0) and stop before the first scaled arrival >= ``duration``
    seconds (None: never). Lazy; keeps req ids."""
    for r in requests:
        arrival = r.arrival / rate_scale
        if duration is not None and arrival >= duration:
            return
        yield dataclasses.replace(r, arrival=arrival) if rate_scale != 1.0 else r


def make_workload(
    name: str,
    seed: int = 0,
    rate_scale: float = 1.0,
    duration: float | None = None,
    **overrides: object,
) -> Iterator[Request]:
    """A lazy stream of the synthetic workload ``name`` (a key of ``WORKLOADS``).

    ``seed``: the stream's only source of randomness. ``rate_scale`` (> 0): multiplies every rate (arrivals
    are divided by it). ``duration``: seconds of scaled time to generate; None → the workload's
    ``duration_s``; ``math.inf`` → unbounded. ``overrides``: config fields (e.g. ``users=50``).
    Raises :class:`UserError` on an unknown name, unknown field or invalid value."""
    cls = WORKLOADS.get(name)
    if cls is None:
        raise UserError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if not rate_scale > 0 or rate_scale == math.inf:
        raise UserError(f"rate scale must be a positive finite number, got {rate_scale}")
    if duration is not None and not duration > 0:
        raise UserError(f"duration must be > 0 seconds, got {duration}")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise UserError(
            f"workload {name}: unknown parameter(s) {', '.join(unknown)}; known: {', '.join(sorted(fields))}"
        )
    try:
        cfg = cls(**overrides)  # type: ignore[arg-type]
    except TypeError as exc:
        raise UserError(f"workload {name}: {exc}") from None
    stream = cfg.requests(seed)
    limit = cfg.duration_s if duration is None else duration
    return scale_stream(stream, rate_scale, None if limit == math.inf else limit)
