"""Types at the engine model's boundary (shared by simulator, emulator and cost models).

Time is always a float in **seconds** on the driver's clock; the engine model never reads a clock.
Lengths are in **tokens** unless a name says blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple, Protocol, runtime_checkable

ReqId = int | str


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine instance (vLLM's names).

    - ``num_kv_blocks``: KV block pool capacity, in blocks of ``block_size`` tokens.
    - ``report_tokens``: emit a TOKEN output for every decode step (the emulator needs it to stream);
      the simulator leaves it off so that pure-decode stretches are computed in one jump.
    - ``max_model_len``: longest prompt + output accepted, in tokens.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    num_kv_blocks: int = 16384
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_model_len: int = 262144
    report_tokens: bool = False


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as the engine sees it.

    - ``output_len``: tokens to generate (>= 1), as with ``ignore_eos``.
    - ``block_hashes``: chained hashes of the prompt's *full* blocks at the engine's block size
      (``len == prompt_len // block_size``); equal hashes mean equal prefixes.
    - ``token_ids``: the prompt's token ids when known, carried into ``BlockStored`` events.
    - ``remote_prefill`` (a P/D decode instance): the prompt tokens the engine does not hold are read
      from the prefill instance, not computed: at first admission they count as external, all but the
      last as computed, and the engine computes the last one again itself (vLLM's NIXL consumer). The
      driver models the transfer's duration before it adds the request.
    - ``hold_blocks`` (a P/D prefill instance): when the request finishes, its blocks stay referenced
      until ``EngineModel.release`` (the decode instance read them, or the lease expired).
    """

    req_id: ReqId
    prompt_len: int
    output_len: int
    block_hashes: tuple[int, ...] = ()
    token_ids: tuple[int, ...] | None = None
    remote_prefill: bool = False
    hold_blocks: bool = False


class OutputKind(Enum):
    FIRST_TOKEN = "first_token"  # prefill done, first output token produced
    TOKEN = "token"  # one more output token (only with report_tokens)
    FINISHED = "finished"  # last output token produced; the request's blocks are released
    PREEMPTED = "preempted"  # evicted by recompute; it goes back to the front of the waiting queue
    ABORTED = "aborted"  # removed by abort()


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """Something that happened to a request at ``time`` (end of the step that produced it).

    ``num_cached_tokens`` is the prompt's local prefix-cache hit at its (last) admission, in tokens;
    ``num_external_tokens`` the prompt tokens read from a remote prefill instance instead (vLLM 0.32
    reports only the local part as ``cached_tokens``); ``num_output_tokens`` counts output tokens
    produced so far.
    """

    kind: OutputKind
    req_id: ReqId
    time: float
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    num_external_tokens: int = 0


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks newly cached (vLLM's ``BlockStored``); ``token_ids`` covers all of them (may be
    empty when the engine does not know the tokens). ``lora_name``: the LoRA adapter whose request
    cached them (vLLM puts it in the block hash's extra keys; None: the base model); ``lora_id``:
    the engine's integer id of that adapter (older vLLM sends only this one). ``extra_keys``: one
    entry per block, the extra keys vLLM hashed into it (``lora name + multimodal hashes +
    cache_salt`` (first block of a prompt only) ``+ prompt-embedding hashes``; None for a block
    without any), or None when the engine sends none (older vLLM, SGLang). ``group_idx``: the KV cache
    group (vLLM hybrid models; None: not sent); ``kv_cache_spec_kind``: that group's kind, as sent."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[object, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks evicted (vLLM's ``BlockRemoved``)."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset (vLLM's ``AllBlocksCleared``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's state.

    - ``running``/``waiting``: requests in the running batch / waiting queue.
    - ``used_blocks``: blocks referenced by requests; ``cached_blocks``: blocks in the pool holding a
      hashed full block (referenced or not). ``kv_usage = used_blocks / num_kv_blocks``.
    - ``queued_prefill_tokens``: prompt tokens still to compute over waiting and running requests
      (cache hits excluded once the request is admitted).
    - ``prefix_query_tokens``/``prefix_hit_tokens``: cumulative prompt tokens looked up / found in
      the prefix cache at admission (vLLM's prefix-cache queries and hits).
    - ``preemptions``: cumulative preemptions.
    - ``external_query_tokens``/``external_hit_tokens``: cumulative prompt tokens of remote-prefill
      requests at first admission / of those, read from the remote instance (vLLM's
      ``external_prefix_cache_queries``/``_hits``).
    - ``held_requests``/``held_blocks``: finished requests whose blocks a remote decode instance has
      not released yet (counted in ``used_blocks``).
    """

    running: int
    waiting: int
    num_kv_blocks: int
    used_blocks: int
    cached_blocks: int
    kv_usage: float
    queued_prefill_tokens: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    decode_kv_tokens: int = 0
    external_query_tokens: int = 0
    external_hit_tokens: int = 0
    held_requests: int = 0
    held_blocks: int = 0


class CostModel(Protocol):
    """Turns one engine step into a duration in seconds.

    ``prefill`` lists the step's prefill chunks as ``(chunk_tokens, context_tokens_before_chunk)``;
    ``num_decode`` sequences each decode one token, with ``decode_kv_tokens`` the sum of their
    context lengths (tokens already in their KV cache). Must be pure and deterministic, > 0 for a
    non-empty step.
    """

    name: str

    def step_time(
        self, prefill: Sequence[tuple[int, int]], num_decode: int, decode_kv_tokens: int
    ) -> float: ...


@runtime_checkable
class ChunkStepTimes(Protocol):
    """A cost model that prices many one-chunk steps at once (seconds): element i equals
    ``step_time(((chunks[i], histories[i]),), num_decode[i], decode_kv_tokens[i])`` exactly. What a
    router prices per instance at every decision (:class:`~kvroute.policies.lmetric_time.LMetricTime`)."""

    def chunk_step_times(
        self,
        chunks: Sequence[int],
        histories: Sequence[int],
        num_decode: Sequence[int],
        decode_kv_tokens: Sequence[int],
    ) -> list[float]: ...


class LoadSnapshot(NamedTuple):
    """What a router copies of an engine's state, cheaply (``EngineModel.load()``), in the names of
    ``kvroute.views.InstanceView``: requests ``running``/``waiting``, ``queued_prefill_tokens``
    (tokens), ``kv_usage`` (fraction of the pool in use), ``kv_capacity_blocks`` (pool size, blocks),
    ``decode_blocks`` (blocks referenced by requests). A named tuple: cheap to build, and it still
    unpacks by position."""

    running: int
    waiting: int
    queued_prefill_tokens: int
    kv_usage: float
    kv_capacity_blocks: int
    decode_blocks: int
