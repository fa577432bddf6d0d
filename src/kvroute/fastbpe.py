"""An exact, faster encoder for byte-level BPE ``tokenizer.json`` files, built on ``tiktoken``.

Why: encoding is the largest CPU cost of a routed request with new text (the router must hash the
prompt's token blocks exactly as the engine will). On the proxy benchmark's chatbot prompts tiktoken
needs about a tenth of HF ``tokenizers``' CPU time for the same ids (``make bench ONLY=tokenize``).

:func:`build_fast_encoder` returns None unless tiktoken reproduces the file's tokenizer exactly:

- model: BPE without dropout, byte fallback, unknown token or subword prefix/suffix;
- normalizer: none or NFC (the caller sends text that is not already NFC to HF: HF normalizes the
  text *between* added tokens, which differs from normalizing the whole text when an added token is
  followed by a combining mark);
- pre-tokenizer: one regex ``Split`` (``Isolated``) then ``ByteLevel`` without its own regex;
- merges in the order of their results' ids: tiktoken merges the pair whose result has the lowest
  id, HF the pair listed first, which is the same pair exactly when the list is in id order;
- added tokens matched verbatim (no ``lstrip``/``rstrip``/``single_word``/``normalized``);
- a sample of vocabulary entries encodes to itself (HF without ``ignore_merges`` runs merges even on
  a piece that is a vocabulary entry; tiktoken takes the entry). The bundled Qwen3 tokenizer passes on
  all 150,195 entries, every Unicode code point and random texts (tests/test_tokenizer.py).
"""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Mapping
from typing import Any

__all__ = ["build_fast_encoder", "byte_decoder"]

_SAMPLE = 2000  # vocabulary entries checked against HF when ignore_merges is off


def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character → byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _regex(pre: Mapping[str, Any] | None) -> str | None:
    """The split regex of a ``Sequence[Split(Isolated), ByteLevel(use_regex=False)]`` pre-tokenizer."""
    if not pre or pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if (
        byte_level.get("type") != "ByteLevel"
        or byte_level.get("use_regex")
        or byte_level.get("add_prefix_space")
    ):
        return None
    pattern = split.get("pattern") or {}
    regex = pattern.get("Regex")
    return regex if isinstance(regex, str) else None


def build_fast_encoder(spec: Mapping[str, Any], hf: Any = None) -> tuple[Any, bool] | None:
    """``(tiktoken.Encoding, nfc)`` equivalent to the tokenizer described by ``spec`` (a parsed
    ``tokenizer.json``), or None when it cannot be made exact (see the module docstring). ``nfc``
    says the tokenizer normalizes to NFC. ``hf`` (the loaded HF tokenizer) is used for the vocabulary
    self-check; without it a tokenizer that does not ignore merges is refused."""
    try:
        import tiktoken
    except ImportError:
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") or model.get("byte_fallback"):
        return None
    if model.get("unk_token") or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    norm = spec.get("normalizer")
    if norm is not None and norm.get("type") != "NFC":
        return None
    regex = _regex(spec.get("pre_tokenizer"))
    if regex is None:
        return None
    vocab: Mapping[str, int] = model.get("vocab") or {}
    table = str.maketrans({ch: chr(b) for ch, b in byte_decoder().items()})
    try:  # stand-in characters -> the bytes they stand for (one C-level pass per entry)
        ranks = {tok.translate(table).encode("latin-1"): i for tok, i in vocab.items()}
    except UnicodeEncodeError:  # a vocabulary entry outside the byte-level alphabet
        return None
    last = -1
    for merge in model.get("merges") or []:
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        rid = vocab.get(a + b)
        if rid is None or rid < last:
            return None
        last = rid
    special: dict[str, int] = {}
    for tok in spec.get("added_tokens") or []:
        if tok.get("lstrip") or tok.get("rstrip") or tok.get("single_word") or tok.get("normalized"):
            return None
        special[tok["content"]] = tok["id"]
        ranks.pop(tok["content"].encode("utf-8"), None)  # matched as an added token, never by BPE
    try:
        enc = tiktoken.Encoding("kvroute-bpe", pat_str=regex, mergeable_ranks=ranks, special_tokens=special)
    except Exception:  # tiktoken rejects the regex or a duplicate rank
        return None
    nfc = norm is not None
    if not model.get("ignore_merges") and (hf is None or not _vocab_self_check(enc, hf, vocab, nfc)):
        return None
    return enc, nfc


def _vocab_self_check(enc: Any, hf: Any, vocab: Mapping[str, int], nfc: bool) -> bool:
    """A seeded sample of vocabulary entries (as text) encodes the same with both."""
    table = str.maketrans({ch: chr(b) for ch, b in byte_decoder().items()})
    texts = []
    for tok in random.Random(0).sample(list(vocab), min(_SAMPLE, len(vocab))):
        try:
            text = tok.translate(table).encode("latin-1").decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not nfc or unicodedata.is_normalized("NFC", text):
            texts.append(text)
    want = [e.ids for e in hf.encode_batch_fast(texts, add_special_tokens=False)]
    return all(enc.encode(t, allowed_special="all") == w for t, w in zip(texts, want, strict=True))
