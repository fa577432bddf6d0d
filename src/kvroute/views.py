"""Frozen views at the policy boundary.

Policies see only these: a :class:`RequestView` (what is being routed, including how much of its
prefix each instance already caches) and one :class:`InstanceView` per candidate instance (its load).
They return a :class:`Choice`. Units: tokens are tokens, blocks are KV blocks of ``block_size``
tokens, ``kv_usage`` is a fraction in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class InstanceView:
    """Load of one instance as the router believes it now.

    Invariants: all counts are >= 0; ``kv_usage`` in [0, 1].

    - ``index``: the instance's id (stable position in the cluster, used for tie-breaks).
    - ``running``: sequences in the engine's running batch.
    - ``waiting``: requests queued (engine waiting queue plus routed-but-not-started ones).
    - ``queued_prefill_tokens``: prefill tokens routed to this instance and not yet computed.
    - ``kv_usage``: fraction of the KV block pool in use.
    - ``kv_capacity_blocks``: size of the KV block pool, in blocks (0 if unknown).
    - ``decode_blocks``: KV blocks, the engine's blocks in use at the router's last copy of its load
      (Dynamo's active decode blocks: those of the requests it has started; a request queued there
      holds none) *plus* the prompt blocks of the requests routed since that copy, until their first
      token or the next copy (Dynamo's incoming blocks: the router cannot know yet whether they run
      or queue, and a burst routed between two copies must not all look free of them). The two
      parts count disjoint requests, hence a sum. The simulator copies every ``scrape_interval``
      (:meth:`kvroute.sim.cluster.ClusterSim._view`); the live router scrapes every
      ``scrape_interval_s`` (the same 50 ms by default) and counts the requests routed since the
      last completed scrape *began* (:mod:`kvroute.server.state.backends`, which states what is
      approximate); with no fresh scrape it counts the blocks of all its requests in flight.
    - ``tags``: free-form labels such as ``"spot"``; ``warming`` marks a cold-starting instance.
    - ``max_batched_tokens``: the engine's chunk budget, tokens one step computes at most (vLLM's
      ``max_num_batched_tokens``); ``max_num_seqs``: its batch limit, sequences. 0: unknown. The
      router-side queue reads them (:func:`kvroute.routing.queue.saturated`).
    """

    index: int
    running: int = 0
    waiting: int = 0
    queued_prefill_tokens: int = 0
    kv_usage: float = 0.0
    kv_capacity_blocks: int = 0
    decode_blocks: int = 0
    tags: frozenset[str] = frozenset()
    warming: bool = False
    max_batched_tokens: int = 0
    max_num_seqs: int = 0


@dataclass(frozen=True, slots=True)
class RequestView:
    """The request being routed.

    - ``prompt_tokens``: prompt length in tokens.
    - ``cached_tokens``: per instance (same order as the instance list given to the policy), the
      number of prompt tokens that instance already caches as a prefix (a multiple of the block
      size, at most ``prompt_tokens``).
    - ``num_blocks``: full KV blocks in the prompt (prompt_tokens // block_size).
    - ``block_size``: tokens per KV block.
    - ``max_tokens``: expected output tokens (0 if unknown).
    - ``user``, ``req_class``: who sent it and its latency class (``"ttft"``, ``"tpot"``, or
      ``"default"``).
    - ``prefix_key``: id of the request's leading prefix class (0 if none), for hot-spot detection.
    - ``now``: when it is routed, seconds on the router's clock (time-dependent features read it;
      plain policies ignore it).
    - ``chain``: the prompt's block hashes (full blocks; the KV view's hashes), for policies that keep
      a prefix table of their own (the peers' routing-history tables); ``()`` when not given.
    - ``gated``: routed behind the router-side queue (:mod:`kvroute.routing.queue`), which gates what
      reaches every instance whose view carries a chunk budget (``InstanceView.max_batched_tokens``
      > 0, :func:`held_back`): a request goes out only when that instance's next step can start it, so
      the engine's own queue holds no more than the work its next steps start and the requests
      beyond wait at the router. False without the queue. One flag per decision, not per view: the
      queue marks nothing on the views themselves.
    """

    prompt_tokens: int
    cached_tokens: tuple[int, ...]
    num_blocks: int = 0
    block_size: int = 16
    max_tokens: int = 0
    user: str | None = None
    req_class: str = "default"
    prefix_key: int = 0
    now: float = 0.0
    chain: tuple[int, ...] = field(default=(), compare=False, repr=False)
    gated: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's choice and its reasons.

    ``choice`` is a *position* in the instance list given to the policy (not ``InstanceView.index``).
    ``scores`` holds one number per instance in that list, in the policy's own units and direction
    (``lower_is_better`` says which); ``detail`` names the terms behind the score for logs.
    ``reason``: why the choice won (:data:`kvroute.routing.core.REASONS`); plain policies say
    ``"policy"``, the feature wrapper names the feature that overrode or narrowed the choice.
    """

    choice: int
    scores: tuple[float, ...]
    policy: str
    lower_is_better: bool = True
    detail: dict[str, tuple[float, ...]] = field(default_factory=dict, compare=False)
    reason: str = "policy"


def held_back(request: RequestView, view: InstanceView) -> bool:
    """Whether the router-side queue gates what reaches ``view``'s instance for ``request``: routed
    behind the queue (``request.gated``) and the instance's chunk budget known (the queue holds back
    only what a known budget says its next step cannot start)."""
    return request.gated and view.max_batched_tokens > 0


class Hold(Protocol):
    """A policy's own bookkeeping for one dispatched request (see
    :class:`~kvroute.policies.base.Tracking`): the driver calls :meth:`first_token` when the request's
    first token (first response byte) comes back and :meth:`finished` when it ends, any way (done,
    aborted, cancelled, a failed attempt). Both take the driver's time in seconds and are idempotent;
    ``finished`` without ``first_token`` is allowed."""

    def first_token(self, now: float) -> None: ...

    def finished(self, now: float) -> None: ...
