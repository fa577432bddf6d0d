"""Property tests of request parsing and validation: any bytes and any JSON value raise nothing but
``ApiError`` (so the client always gets a JSON error, never a 500); nesting past the bound is a 400
however deep; valid bodies parse to what they say."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.server.wire.validate import MAX_DEPTH, ApiError, check_depth, parse_request

FAST = settings(max_examples=80, deadline=None)

KEYS = ["model", "prompt", "messages", "stream", "max_tokens", "max_completion_tokens", "user", "cache_salt"]
KEYS += ["stream_options", "role", "content", "type", "text", "tools", "documents", "chat_template_kwargs"]
KEYS += ["add_generation_prompt", "tool_choice", "name"]
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=10)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=6), inner, max_size=5)
    ),
    max_leaves=30,
)


def _parse_or_refuse(raw: bytes, chat: bool) -> None:
    try:
        parse_request(raw, chat)
    except ApiError as err:
        assert 400 <= err.status < 500 and err.message


@FAST
@given(st.binary(max_size=256), st.booleans())
def test_arbitrary_bytes_raise_only_api_errors(raw: bytes, chat: bool) -> None:
    _parse_or_refuse(raw, chat)


@FAST
@given(json_values, st.booleans())
def test_arbitrary_json_raises_only_api_errors(value: object, chat: bool) -> None:
    _parse_or_refuse(orjson.dumps(value), chat)


@FAST
@given(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8), st.booleans())
def test_request_shaped_json_raises_only_api_errors(body: dict[str, object], chat: bool) -> None:
    _parse_or_refuse(orjson.dumps(body), chat)


@FAST
@given(st.integers(MAX_DEPTH + 1, 1000), st.sampled_from(["[", "{"]), st.booleans())
def test_nesting_past_the_bound_is_a_400_at_any_depth(depth: int, opener: str, chat: bool) -> None:
    close = "]" if opener == "[" else "}"
    inner = (opener if opener == "[" else '{"a":') * depth
    inner += "1" if opener == "{" else ""
    inner += close * depth
    field = '"messages": [{"role": "user", "content": ' + inner + "}]" if chat else '"prompt": ' + inner
    with pytest.raises(ApiError) as err:
        parse_request(("{" + field + "}").encode(), chat)
    assert err.value.status == 400


def test_nesting_at_the_bound_is_accepted_by_the_depth_check() -> None:
    body = {"prompt": "x", "extra": {"a": [[[]]]}}
    check_depth(orjson.dumps(body), body)
    deep: object = 1
    for _ in range(MAX_DEPTH):
        deep = [deep]
    check_depth(orjson.dumps(deep), deep)  # 64 arrays (a scalar inside is no level): the bound
    with pytest.raises(ApiError):
        check_depth(orjson.dumps([deep]), [deep])


text = st.text(min_size=1, max_size=40)
messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
    min_size=1,
    max_size=5,
)


@FAST
@given(
    messages,
    st.booleans(),
    st.none() | st.integers(0, 4096),
    st.none() | st.text(max_size=10),
    st.none() | st.text(max_size=10),
)
def test_valid_chats_round_trip(
    msgs: list[dict[str, str]], stream: bool, max_tokens: int | None, model: str | None, user: str | None
) -> None:
    body: dict[str, object] = {"messages": msgs, "stream": stream}
    for k, v in (("max_tokens", max_tokens), ("model", model), ("user", user)):
        if v is not None:
            body[k] = v
    p = parse_request(orjson.dumps(body), chat=True)
    assert p.chat and p.stream == stream and list(p.messages or ()) == msgs
    assert (p.max_tokens, p.model, p.user) == (max_tokens or 0, model, user)


@FAST
@given(
    text
    | st.lists(st.integers(0, 200_000), min_size=1, max_size=50)
    | st.lists(text, min_size=1, max_size=3),
    st.booleans(),
    st.none() | st.integers(0, 4096),
)
def test_valid_completions_round_trip(prompt: object, stream: bool, max_tokens: int | None) -> None:
    body: dict[str, object] = {"prompt": prompt, "stream": stream}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    p = parse_request(orjson.dumps(body), chat=False)
    want = prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str) else prompt
    assert not p.chat and p.stream == stream and p.prompt == want and p.max_tokens == (max_tokens or 0)


def test_every_kind_of_bad_input_is_an_api_error() -> None:
    """A few named ones besides the generated: wrong types, deep nesting, orjson's own depth limit."""
    cases = [
        b"",
        b"null",
        b"[]",
        b'"x"',
        b"{",
        b'{"prompt": 1}',
        b'{"prompt": []}',
        b'{"prompt": [true]}',
        b'{"prompt": "x", "stream": "yes"}',
        b'{"prompt": "x", "max_tokens": -1}',
        b'{"prompt": "x", "max_tokens": 1.5}',
        b'{"messages": []}',
        b'{"messages": [1]}',
        b'{"messages": [{"role": 1}]}',
        b'{"messages": [{"role": "user", "content": 5}]}',
        b'{"prompt": ' + b"[" * 990 + b"]" * 990 + b"}",
        b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    ]
    for raw in cases:
        for chat in (False, True):
            with pytest.raises(ApiError):  # none of these is valid
                parse_request(raw, chat)
