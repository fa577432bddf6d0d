"""The tiktoken encoder built by kvroute.fastbpe gives exactly HF tokenizers' ids (bundled Qwen3)."""

from __future__ import annotations

import copy
import random
import unicodedata
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.fastbpe import build_fast_encoder, byte_decoder
from kvroute.tokenizer import Tokenizer, default_tokenizer_path, load_tokenizer


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(default_tokenizer_path().read_bytes())
    return data


@pytest.fixture(scope="module")
def fast() -> Tokenizer:
    tok = load_tokenizer()
    assert tok.fast, "the bundled Qwen3 tokenizer should get the exact fast encoder"
    return tok


@pytest.fixture(scope="module")
def slow() -> Tokenizer:
    tok = load_tokenizer(fast_encoder=False)
    assert not tok.fast
    return tok


def test_every_vocabulary_entry_encodes_the_same(
    spec: dict[str, Any], fast: Tokenizer, slow: Tokenizer
) -> None:
    table = str.maketrans({ch: chr(b) for ch, b in byte_decoder().items()})
    texts = []
    for tok in spec["model"]["vocab"]:
        try:
            texts.append(tok.translate(table).encode("latin-1").decode("utf-8"))
        except UnicodeDecodeError:
            continue  # a partial UTF-8 sequence: not a text on its own
    assert len(texts) > 150_000
    assert fast.encode_many(texts) == slow.encode_many(texts)


def test_every_assigned_code_point_encodes_the_same(fast: Tokenizer, slow: Tokenizer) -> None:
    """Each assigned code point, between random separators, in chunks (the regex's classes and
    byte-level splitting agree everywhere)."""
    rng = random.Random(7)
    seps = ["", " ", "  ", "\n", "\r\n", "\t", "a", "1", "'", "'s", " \n ", ".", "\u00a0", "\u3000"]
    cps = [
        c
        for c in range(0x110000)
        if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) not in ("Cn", "Co")
    ]
    texts = ["".join(chr(c) + rng.choice(seps) for c in cps[i : i + 2048]) for i in range(0, len(cps), 2048)]
    for text in texts:
        assert fast.encode(text) == slow.encode(text)


ALPHABET = [
    "the",
    " cat",
    "  ",
    "\n",
    "\n\n",
    "\r\n",
    "\t",
    "é",
    "e\u0301",
    "\u0338",
    ">",
    "'s",
    "'LL",
    "12",
    "3.5",
    "--",
    " ",
    "Über",
    "x.",
    "日本",
    "語",
    " a",
    "!",
    "don't",
    "🚀",
    "\u200b",
    "\u00a0",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "ﬁ",
    "Å",
    "Å",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=80))
def test_random_texts_encode_the_same(fast: Tokenizer, slow: Tokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert fast.encode(text) == slow.encode(text)


def test_added_token_then_combining_mark_matches_hf(fast: Tokenizer, slow: Tokenizer) -> None:
    # ">" + U+0338 composes to "≯" under NFC; HF matches the added token first. Not NFC text
    # therefore goes through HF, so both agree.
    text = "<|im_end|>\u0338 and e\u0301"
    assert not unicodedata.is_normalized("NFC", text)
    assert fast.encode(text) == slow.encode(text)
    assert fast.encode(text)[0] == fast.token_to_id("<|im_end|>")


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.update(normalizer={"type": "Lowercase"}),
        lambda s: s["model"].update(byte_fallback=True),
        lambda s: s["model"].update(type="WordPiece"),
        lambda s: s["model"]["merges"].reverse(),  # merges no longer in the order of their results
        lambda s: s["added_tokens"][0].update(lstrip=True),
        lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
    ],
)
def test_incompatible_tokenizers_get_no_fast_encoder(
    spec: dict[str, Any], slow: Tokenizer, mutate: Any
) -> None:
    changed = copy.deepcopy(spec)
    mutate(changed)
    assert build_fast_encoder(changed, slow._hf) is None


def test_without_hf_a_merging_tokenizer_is_refused(spec: dict[str, Any], slow: Tokenizer) -> None:
    assert build_fast_encoder(spec, None) is None  # the vocabulary self-check needs HF
    assert build_fast_encoder(spec, slow._hf) is not None
