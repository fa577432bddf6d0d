"""The router's per-request work in one process, stage by stage: no HTTP, no other process competing.

The proxy benchmark (``bench_proxy``) measures the same stages inside a running router, on a 2-core
machine shared with 4 engines and the load generator, where each stage takes several times longer.
This one gives their intrinsic cost, to tell the two apart.

Setup: a :class:`~kvroute.server.state.router.RouterState` with 4 backends whose KV view is exact (fed by KV
events), the ``lmetric`` policy and the bundled tokenizer; ``REQUESTS`` prompts of the proxy benchmark's
workload (``chatbot`` prompts as synthetic text, capped at 2,048 tokens), as ``/v1/completions`` bodies.
For each request, in order, timed with ``time.perf_counter``:

- ``parse``: JSON body → checked request;
- ``split``: the prompt's segments looked up in the token cache;
- ``tokenize``: the new segments tokenized;
- ``hash``: block hashes (memoised along cached segments);
- ``plan``: KV match on every backend + instance views + policy;
- ``observe``: the decision record and its outcome (:class:`~kvroute.server.observe.observer.Observer`:
  ``planned``, ``attempt``, ``response_headers``, ``finish``: the ring buffer, the request id and the
  latency histograms), as the proxy does around forwarding;
- ``routed``: the routing history recorded for the chosen backend (with an exact KV view the proxy
  does this after sending the request, off the request's path);
- ``events``: the KV event batch the chosen engine would publish for the request's new blocks
  (msgpack-encoded beforehand, as vLLM sends it), decoded and applied (block hashes rebuilt from
  ``token_ids``). Not on the request's own path, but on the router's event loop.

Run twice: as configured by default, and with everything that costs on the request path turned on
(``explain``, three shadow policies ``vllm,llm-d,round-robin``: their cost shows in ``plan``).
The first ``WARMUP`` requests are not counted. Reports the mean and p50 per stage (µs) and the sum of
the means of the stages on the request's path (``path_us``: all but ``routed`` and ``events``). Writes
``benchmarks/results/stages.json``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import orjson

from benchmarks.bench_proxy import MAX_PROMPT_TOKENS, _requests
from benchmarks.common import table, write
from kvroute.engine.types import BlockStored
from kvroute.kvevents import decode_batch, encode_batch
from kvroute.loadgen import BlockText
from kvroute.policies.registry import make_policy
from kvroute.prepare.tokenize import RequestTokenizer
from kvroute.server.config import BackendSpec, RouterConfig
from kvroute.server.observe.observer import Observer
from kvroute.server.stages.decide import decide
from kvroute.server.stages.prepare import Prepared, extra_key, hashed, split
from kvroute.server.state.router import RouterState
from kvroute.server.wire.validate import parse_request
from kvroute.tokenizer import load_tokenizer

REQUESTS = 1200
WARMUP = 200
BACKENDS = 4
PATH_STAGES = ("parse", "split", "tokenize", "hash", "plan", "observe")
STAGES = (*PATH_STAGES, "routed", "events")


OBSERVED: dict[str, Any] = {"explain": True, "shadow": ("vllm", "llm-d", "round-robin")}
"""The second run's config: explanation headers and three shadow policies."""


def measure(requests: int = REQUESTS, warmup: int = WARMUP, **config_extra: Any) -> dict[str, Any]:
    """Per-stage samples (µs) over ``requests - warmup`` requests; see the module docstring."""
    tok = load_tokenizer()
    text = BlockText(tok)
    reqs = _requests(requests, 20.0, seed=7)
    bodies = [
        orjson.dumps(
            {
                "model": "m",
                "prompt": text.prompt(r.block_ids, r.block_size, r.prompt_len, r.req_id),
                "max_tokens": 4,
                "stream": True,
            }
        )
        for r in reqs
    ]
    config = RouterConfig(
        backends=tuple(
            BackendSpec(url=f"http://127.0.0.1:{9000 + i}", kv_events=f"tcp://127.0.0.1:{9100 + i}")
            for i in range(BACKENDS)
        ),
        **config_extra,
    )
    core = RouterState(config, RequestTokenizer(tok, config.tokenizer_cache_entries), make_policy("lmetric"))
    from prometheus_client import CollectorRegistry

    obs = Observer(core, CollectorRegistry())
    bs = config.block_size
    stored: list[set[int]] = [set() for _ in range(BACKENDS)]  # what each "engine" has cached
    samples: dict[str, list[float]] = {s: [] for s in STAGES}
    clock = time.perf_counter
    for n, raw in enumerate(bodies):
        t0 = clock()
        parsed = parse_request(raw, False)
        t1 = clock()
        key = extra_key(core, parsed)
        pending = split(core, parsed)
        t2 = clock()
        pieces = core.tokenizer.finish_pieces(pending)
        t3 = clock()
        ids, chain = hashed(core, pieces, pending.suffix, key)
        t4 = clock()
        plan = decide(core, parsed, Prepared(key, ids, chain), {})
        t5 = clock()
        idx = plan.order[0]
        rec = obs.planned(f"{n:032x}", plan.decision, plan.shadow, "/v1/completions", {}, t0, t5 - t0)
        obs.attempt(rec, idx, core.backends[idx].url, False, {})
        rec.first_byte = clock()
        obs.response_headers(rec)
        rec.status, rec.complete, rec.cached_real = 200, True, plan.cached_blocks[idx] * bs
        obs.finish(rec)
        t5b = clock()
        core.kv.on_routed(idx, plan.chain, core.clock())
        t6 = clock()
        # The engine's BlockStored for the blocks it did not have (engine hash = ours here).
        have = stored[idx]
        first = next((i for i, h in enumerate(plan.chain) if h not in have), len(plan.chain))
        new = plan.chain[first:]
        have.update(new)
        payload = encode_batch(
            0.0,
            [
                BlockStored(
                    block_hashes=new,
                    parent_block_hash=plan.chain[first - 1] if first else None,
                    token_ids=tuple(ids[first * bs : (first + len(new)) * bs]),
                    block_size=bs,
                )
            ]
            if new
            else [],
        )
        t7 = clock()
        _ts, events, _rank = decode_batch(payload)
        core.kv.apply_events(idx, events)
        t8 = clock()
        if n < warmup:
            continue
        for stage, a, b in zip(
            STAGES, (t0, t1, t2, t3, t4, t5, t5b, t7), (t1, t2, t3, t4, t5, t5b, t6, t8), strict=True
        ):
            samples[stage].append((b - a) * 1e6)
    means = {s: statistics.fmean(v) for s, v in samples.items()}
    return {
        "requests": requests - warmup,
        "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "mean_us": means,
        "p50_us": {s: statistics.median(v) for s, v in samples.items()},
        "path_us": sum(means[s] for s in PATH_STAGES),
    }


def main() -> int:
    out = measure()
    observed = measure(**OBSERVED)
    rows = [
        (s, f"{out['mean_us'][s]:.1f}", f"{out['p50_us'][s]:.1f}", f"{observed['mean_us'][s]:.1f}")
        for s in STAGES
    ]
    rows.append(
        (
            "request path (sum of means, all but routed and events)",
            f"{out['path_us']:.0f}",
            "",
            f"{observed['path_us']:.0f}",
        )
    )
    table(rows, headers=("stage", "mean µs", "p50 µs", "mean µs, explain + 3 shadows"))
    write(
        "stages.json",
        out
        | {
            "observed": observed
            | {"config": {k: list(v) if isinstance(v, tuple) else v for k, v in OBSERVED.items()}}
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
