"""Tokenizing prompts: HF ``tokenizers`` vs the exact tiktoken encoder of :mod:`kvroute.fastbpe`.

Prompts: the ``chatbot`` workload's first ``PROMPTS`` requests as text (block ids → stable synthetic
text, capped at 2,048 tokens), the same prompts the proxy benchmark sends. Each encoder encodes
every prompt ``ROUNDS`` times (alternating encoders per round, so drift in machine load hits both);
reported: process CPU time per prompt (ms, all threads) and tokens per CPU second, plus a check that
both gave the same ids. Writes ``benchmarks/results/tokenize.json``.
"""

from __future__ import annotations

import time

from benchmarks.common import table, write
from kvroute.loadgen import BlockText
from kvroute.tokenizer import Tokenizer, load_tokenizer
from kvroute.workloads import make_workload

PROMPTS = 200
ROUNDS = 3
MAX_PROMPT_TOKENS = 2048


def _prompts(tok: Tokenizer) -> list[str]:
    text = BlockText(tok)
    out: list[str] = []
    for r in make_workload("chatbot", seed=7, rate_scale=8.0, duration=3600.0):
        if len(out) >= PROMPTS:
            break
        blocks = r.block_ids[: MAX_PROMPT_TOKENS // r.block_size]
        out.append(text.prompt(blocks, r.block_size, min(r.prompt_len, MAX_PROMPT_TOKENS), r.req_id))
    return out


def main() -> int:
    fast = load_tokenizer()
    slow = load_tokenizer(fast_encoder=False)
    if not fast.fast:
        print("the bundled tokenizer has no fast encoder: nothing to compare")
        return 1
    prompts = _prompts(slow)
    same = all(fast.encode(p) == slow.encode(p) for p in prompts)
    tokens = sum(len(slow.encode(p)) for p in prompts)
    cpu = {"hf": 0.0, "tiktoken": 0.0}
    for _ in range(ROUNDS):
        for name, tok in (("hf", slow), ("tiktoken", fast)):
            c0 = time.process_time()
            for p in prompts:
                tok.encode(p)
            cpu[name] += time.process_time() - c0
    n = PROMPTS * ROUNDS
    res = {
        name: {
            "cpu_ms_per_prompt": 1000.0 * c / n,
            "tokens_per_cpu_s": tokens * ROUNDS / c if c else float("inf"),
        }
        for name, c in cpu.items()
    }
    out = {
        "prompts": PROMPTS,
        "rounds": ROUNDS,
        "mean_prompt_tokens": tokens / PROMPTS,
        "same_ids": same,
        "encoders": res,
        "speedup": cpu["hf"] / cpu["tiktoken"] if cpu["tiktoken"] else float("inf"),
    }
    table(
        [
            (name, f"{r['cpu_ms_per_prompt']:.3f} ms/prompt", f"{r['tokens_per_cpu_s'] / 1e6:.2f} M tokens/s")
            for name, r in res.items()
        ],
        ("encoder", "CPU per prompt", "throughput"),
    )
    print(f"mean prompt {tokens / PROMPTS:.0f} tokens; same ids: {same}; speedup {out['speedup']:.1f}x")
    write("tokenize.json", out)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
