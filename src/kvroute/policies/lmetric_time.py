"""LMetric-time: LMetric's P-token × (BS + 1) with every prefill token priced in engine time, and KV demand (kvroute's policy).

LMetric scores an instance by the prefill work a request would wait behind, P-token (tokens), times
the requests sharing the instance, BS + 1. A token is a poor unit on long contexts: one engine step
(one chunk of at most ``B`` prefill tokens plus one token of every running sequence) costs the dense
and MoE layers for those tokens **plus attention over every running sequence's context**, and a
prefill chunk's attention grows with the prompt's history before it. On the default profile a decode
step of 32 sequences takes 38 ms at 100 tokens of context each and 245 ms at 100 k; a 4,096-token
chunk takes 100 ms with no history and 1.3 s after 100 k tokens. And a request sent to an instance
whose KV pool its running and queued requests already fill waits for blocks, or makes the engine
preempt (recompute) a running sequence. So each prefill token is priced at what a token of a full
chunk costs on that instance now, and the score is scaled by the pool's projected fill:

    score(i) = (T_wait(i) + T_own(i)) × (BS(i) + 1) × K(i)        (seconds × requests; lowest wins)
    T_wait(i) = Q(i) × step(chunk(i), 0) / chunk(i)
    T_own(i)  = p(i) × step(chunk(i), h̄(i)) / chunk(i)

- Q(i) = ``queued_prefill_tokens`` (tokens queued there, routed or waiting); p(i) = prompt − cached[i]
  (the request's own uncached prefill, at least 1: the engine always computes one token). With Q and
  p in tokens this is LMetric's P-token, each token priced in seconds.
- chunk(i) = max(B − running(i), 1): prefill tokens one step computes (vLLM schedules the running
  sequences' decode tokens first out of the budget B = ``max_batched_tokens``; 4,096 when unknown).
- step(n, h) = the cost model's time of one step with an ``n``-token prefill chunk after ``h`` tokens
  of history, beside ``running(i)`` decoding sequences holding ctx(i) = ``decode_blocks`` × block size
  tokens of context: what each step's decode attention reads. So the price of a token rises with the
  instance's decode batch and with its context, not with its request count alone.
- h̄(i) = cached[i] + p(i)/2, the mean history of the request's own chunks (a chunk's attention is
  linear in its history, so the mean gives the sum); the queued requests' histories are not known
  and count as none.
- Prices, not latencies: a short prompt that fits in one step still pays its share of a full chunk,
  so a cache hit is worth the tokens it saves (as in LMetric) rather than being lost in the fixed cost
  of a step that runs anyway.
- (BS + 1), BS = running + waiting: as in LMetric, the requests sharing the instance while the queue
  and the request's prefill run (every step they wait for is theirs as well).
- K(i) = C / (C − U) with C = ``kv_capacity_blocks`` and U = ``decode_blocks`` + Q / block size, the
  blocks held plus those the queued prefill will take (projected KV demand). Behind the router-side
  queue (:func:`~kvroute.views.held_back`: the queue sends the instance only what its next step can
  start, and holds the rest back) U = ``decode_blocks``: the queue already keeps an instance from taking more prefill
  than it can start, which is what counting the queue in U guards against without it, and counting
  the one step's work it lets through (a whole long prompt, at times) turns a conversation's next
  turn away from the instance that holds its history (measured in
  ``docs/results/policy-findings.md``, "Behind the router-side queue"). K = 1 on an empty pool,
  2 at half, and grows without bound as demand nears capacity; past it (U > C − 1), K = C × (2 + U −
  C) keeps growing linearly, so an overcommitted instance stays worse than a merely full one. C
  unknown (0): K = 1.
- Ties: lower BS, then lower ``InstanceView.index``.

Units: seconds from the cost model (any constant factor cancels: only the order matters), requests,
blocks. No hyperparameter: B, the block size and C are the engine's config and live state; the step
times come from ``cost``, which the registry (``lmetric-time``) takes from the default profile
whatever engine runs behind (only the relative prices matter). The ``kv`` argument is for ablations
(``held``: U = ``decode_blocks`` only, the ``lmetric-kv`` factor; ``off``: K = 1; ``own``: U also
counts the blocks the request itself would add there, its uncached prompt; ``heldown``: held blocks
plus the request's own, without the queue; ``queued``: the queue's blocks counted behind the
router-side queue as well).

The ``load`` argument is an ablation of the multiplier (``lmetric-time:step``): BS + 1 replaced by
D(i) = step(0, running(i) + 1, ctx(i) + prompt), the cost model's time of one decode step of the batch
the request joins (its prompt becomes context there). LMetric reads BS as the request's coming TPOT;
D is that TPOT in engine seconds, as T prices P-token: it grows with the sequences and with their
context, and it does not grow tenfold from 16 to 142 short sequences, as BS does. On ``api``, BS + 1
sends a long prompt to the instance with the fewest requests, which is the one already holding the
other long prompts and their queue (docs/results/policy-findings.md, "Why the default's api tail
trails dynamo-lmetric"); D sends it to its earliest first token. ``lmetric-time:stepq`` adds to D's
step one chunk of the prefill queued there (at most ``chunk(i)`` tokens, no history): the step the
request would share if the instance kept its present mix of prefill and decode.

``lmetric-time:blocks`` replaces BS + 1 by Dynamo's decode term, load counted in KV blocks rather than
requests: M(i) = ``decode_blocks(i)`` + ⌈prompt / block size⌉ + 1 (as ``dynamo-lmetric``). Two
ablations apply it to some requests only and keep BS + 1 for the rest: ``blocks-cold`` where no
instance caches any of the prompt, ``blocks-flat`` where every instance caches the same prefix (the
placement cannot change the request's hit). They test whether counting load in blocks is what
``api`` needs and whether it can be confined to the requests it helps
(docs/results/policy-findings.md, "Load in KV blocks: what repairs api, and where it does not
transfer").

``itl=True`` (``lmetric-time:itl``): the request's own time also counts one decode step there,

    T_own(i) += T_itl(i) = step(∅, running(i) + 1, ctx(i) + prompt)

the instance's inter-token time once the request decodes beside its running sequences (its context
the whole prompt, cached or not): the score prices the time to the request's *second* token, not its
first. Without it a request that finds most of its prompt cached costs almost nothing anywhere (p ≈
0), however many sequences decode there, so cache-sharing requests pile onto one instance whose
decode steps, and every sequence's TPOT, grow with the pile (``docs/results/policy-findings.md``,
"What sets the default's TPOT tail at the capacity limit").
"""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.engine.types import ChunkStepTimes, CostModel
from kvroute.policies.base import check_inputs
from kvroute.views import Choice, InstanceView, RequestView, held_back

__all__ = ["DEFAULT_CHUNK", "KV_MODES", "VECTOR_MIN_INSTANCES", "LMetricTime", "kv_demand_factor"]

DEFAULT_CHUNK = 4096
"""The chunk budget B (tokens) assumed when an instance does not report ``max_batched_tokens``."""

VECTOR_MIN_INSTANCES = 8
"""From this many instances on, a decision prices its steps in one vectorised cost-model call (when
the cost model has ``chunk_step_times``); below, numpy's fixed cost per call outweighs the scalar
``step_time`` calls it saves (measured on ``benchmarks/bench_decide.py``'s inputs, where the two cross
between 6 and 8 instances). Both paths give the same scores bit for bit."""

LOAD_MODES = ("bs", "step", "stepq", "blocks", "blocks-cold", "blocks-flat")
"""What multiplies (T_wait + T_own): BS + 1 (the policy), or D, one step's time of the batch the request
joins, without (``lmetric-time:step``) or with (``lmetric-time:stepq``) a chunk of the queued prefill;
or the load in KV blocks, for every request (``blocks``), for those no instance caches any of
(``blocks-cold``) or for those every instance caches alike (``blocks-flat``) (module docstring)."""

KV_MODES = ("demand", "held", "off", "own", "heldown", "queued")
"""How K counts KV use: held plus queued blocks, held only behind the router-side queue (the policy);
held blocks only; not at all; held plus queued plus the request's own new blocks; held plus the
request's own new blocks; held plus queued blocks behind the router-side queue too (the policy before
it told the two apart)."""


def kv_demand_factor(capacity: int, demand: float) -> float:
    """K for a pool of ``capacity`` blocks with ``demand`` blocks projected (module docstring): 1 when
    the capacity is unknown (0); C / (C − U) while at least one block stays free; C × (2 + U − C) past
    that (equal to C at U = C − 1, then growing by C per block of overcommitment)."""
    if capacity <= 0:
        return 1.0
    free = capacity - demand
    return capacity / free if free >= 1 else capacity * (2.0 - free)


class LMetricTime:
    """score = (T_wait + T_own) × (BS + 1) × K in cost-model seconds, lowest wins (module docstring).
    ``cost``: the engine's cost model (pure; only its ``step_time`` is called, or, when it has one,
    its ``chunk_step_times``, which prices every instance's two steps of a decision in one vectorised
    call with the same results bit for bit)."""

    __slots__ = ("_cost", "_many", "itl", "kv", "load", "name")

    def __init__(
        self,
        cost: CostModel,
        name: str = "lmetric-time",
        kv: str = "demand",
        load: str = "bs",
        itl: bool = False,
    ) -> None:
        if kv not in KV_MODES:
            raise ValueError(f"kv must be one of {KV_MODES}, got {kv!r}")
        if load not in LOAD_MODES:
            raise ValueError(f"load must be one of {LOAD_MODES}, got {load!r}")
        self.load = load
        self._cost = cost
        self._many = cost.chunk_step_times if isinstance(cost, ChunkStepTimes) else None
        self.name = name
        self.kv = kv
        self.itl = itl

    @staticmethod
    def _terms(request: RequestView, view: InstanceView, cached: int) -> tuple[int, int, int, int, int]:
        """(chunk, running, ctx, Q, p) of the module docstring: tokens, sequences, tokens, tokens, tokens."""
        nd = view.running
        chunk = max((view.max_batched_tokens or DEFAULT_CHUNK) - nd, 1)
        return (
            chunk,
            nd,
            view.decode_blocks * request.block_size,
            view.queued_prefill_tokens,
            max(request.prompt_tokens - cached, 1),
        )

    def times(self, request: RequestView, view: InstanceView, cached: int) -> tuple[float, float]:
        """(T_wait, T_own) of ``request`` on ``view`` with ``cached`` prompt tokens cached there, seconds."""
        step = self._cost.step_time
        chunk, nd, ctx, q, p = self._terms(request, view, cached)
        t_wait = q / chunk * step(((chunk, 0),), nd, ctx) if q else 0.0
        return t_wait, p / chunk * step(((chunk, cached + p // 2),), nd, ctx)

    def _joined_step(self, request: RequestView, view: InstanceView, queued_chunk: bool) -> float:
        """Seconds of one step of the batch ``request`` joins on ``view``: ``running + 1`` decoding
        sequences reading their context plus the whole prompt; with ``queued_chunk``, also one chunk (at
        most ``chunk`` tokens, no history) of the prefill queued there. T_itl and D of the module
        docstring."""
        q = 0
        if queued_chunk:
            q = min(
                view.queued_prefill_tokens, max((view.max_batched_tokens or DEFAULT_CHUNK) - view.running, 1)
            )
        ctx = view.decode_blocks * request.block_size + request.prompt_tokens
        return self._cost.step_time(((q, 0),) if q else (), view.running + 1, ctx)

    def itl_time(self, request: RequestView, view: InstanceView) -> float:
        """T_itl of the module docstring, seconds: one decode step of ``view``'s running sequences and
        the request (``running + 1`` sequences reading their context plus the whole prompt)."""
        return self._joined_step(request, view, queued_chunk=False)

    def _all_times(
        self, request: RequestView, instances: Sequence[InstanceView]
    ) -> list[tuple[float, float]]:
        """:meth:`times` on every instance, equal bit for bit; one vectorised cost-model call when the
        cost model has ``chunk_step_times`` (the queue's step is priced even where Q = 0, then unused)."""
        cached = request.cached_tokens
        if self._many is None or len(instances) < VECTOR_MIN_INSTANCES:
            return [self.times(request, v, c) for c, v in zip(cached, instances, strict=True)]
        terms = [self._terms(request, v, c) for c, v in zip(cached, instances, strict=True)]
        chunks, nds, ctxs, qs, ps = zip(*terms, strict=True)
        own = [c + p // 2 for c, p in zip(cached, ps, strict=True)]
        n = len(terms)
        steps = self._many(chunks * 2, [0] * n + own, nds * 2, ctxs * 2)
        return [
            (q / chunk * steps[i] if q else 0.0, p / chunk * steps[n + i])
            for i, (chunk, q, p) in enumerate(zip(chunks, qs, ps, strict=True))
        ]

    def factor(self, request: RequestView, view: InstanceView, cached: int = 0) -> float:
        """K of ``view`` (module docstring; 1 with ``kv="off"``)."""
        if self.kv == "off":
            return 1.0
        bsz = max(request.block_size, 1)
        demand = float(view.decode_blocks)
        if (self.kv in ("demand", "own") and not held_back(request, view)) or self.kv == "queued":
            demand += view.queued_prefill_tokens / bsz
        if self.kv in ("own", "heldown"):
            demand += max(request.prompt_tokens - cached, 0) / bsz
        return kv_demand_factor(view.kv_capacity_blocks, demand)

    def parts(
        self, request: RequestView, instances: Sequence[InstanceView]
    ) -> tuple[list[tuple[float, float]], list[int], list[float]]:
        """Per instance: (T_wait, T_own) in seconds (with ``itl``, T_own + T_itl), BS in requests, K; the score is
        (T_wait + T_own) × (BS + 1) × K. The feature wrapper (:mod:`kvroute.routing.guarded`) reweights
        BS from these for request classes and load-adaptive weighting."""
        check_inputs(request, instances)
        times = self._all_times(request, instances)
        if self.itl:
            times = [(w, o + self.itl_time(request, v)) for (w, o), v in zip(times, instances, strict=True)]
        ks = [self.factor(request, v, c) for c, v in zip(request.cached_tokens, instances, strict=True)]
        return times, [v.running + v.waiting for v in instances], ks

    def decode_steps(self, request: RequestView, instances: Sequence[InstanceView]) -> list[float]:
        """Per instance, D: the seconds of one step of the batch the request would join there, the cost
        model's step with ``running`` + 1 decoding sequences and ctx + the request's prompt tokens of
        context; with ``load="stepq"`` also one chunk (at most ``chunk`` tokens, no history) of the
        prefill queued there. ``load="step"``'s and ``"stepq"``'s factor in place of BS + 1 (module
        docstring)."""
        queued_chunk = self.load == "stepq"
        return [self._joined_step(request, v, queued_chunk) for v in instances]

    def _in_blocks(self, request: RequestView) -> bool:
        """Whether ``request``'s multiplier is the load in KV blocks (``load="blocks"`` and its two
        partial ablations; module docstring)."""
        load = self.load
        if load == "blocks":
            return True
        cached = request.cached_tokens
        if load == "blocks-cold":
            return not any(cached)
        return load == "blocks-flat" and min(cached) == max(cached)

    def choose(self, request: RequestView, instances: Sequence[InstanceView]) -> Choice:
        """Pick the instance with the lowest (T_wait + T_own) × (BS + 1) × K (with ``load="step"``, × D
        in place of BS + 1: :meth:`decode_steps`; with the ``blocks`` loads, × the load in KV blocks
        for the requests :meth:`_in_blocks` names)."""
        times, bs, ks = self.parts(request, instances)
        step = self.load in ("step", "stepq")
        mult: Sequence[float] = self.decode_steps(request, instances) if step else [b + 1 for b in bs]
        if self._in_blocks(request):
            own = -(-request.prompt_tokens // max(request.block_size, 1))
            mult = [v.decode_blocks + own + 1.0 for v in instances]
        scores = [(w + o) * m * k for (w, o), m, k in zip(times, mult, ks, strict=True)]
        best_s = min(scores)
        best = min(
            (i for i in range(len(scores)) if scores[i] == best_s), key=lambda i: (bs[i], instances[i].index)
        )
        detail = {
            "t_wait_s": tuple(t[0] for t in times),
            "t_own_s": tuple(t[1] for t in times),
            "bs": tuple(map(float, bs)),
            "kv_factor": tuple(ks),
        }
        if step:
            detail["decode_step_s"] = tuple(mult)
        elif self.load != "bs":
            detail["multiplier"] = tuple(mult)
        return Choice(choice=best, scores=tuple(scores), policy=self.name, detail=detail)
