"""ChainMemo: memoised chains always equal hashing the whole prompt."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.blocks import hash_blocks
from kvroute.prepare.chainmemo import ChainMemo, Piece

# a small universe of pieces so that prompts share prefixes and reuse pieces in other positions
PIECES: dict[tuple[str, str], tuple[int, ...]] = {
    ("", f"p{i}"): tuple(range(100 * i, 100 * i + n))
    for i, n in enumerate([0, 1, 3, 7, 15, 16, 17, 31, 40, 64])
}
KEYS = sorted(PIECES)


def _pieces(keys: list[tuple[str, str]], uncached: list[int]) -> list[Piece]:
    out: list[Piece] = [(k, PIECES[k]) for k in keys]
    if uncached:
        out.append((None, uncached))  # e.g. a client's token ids: never memoised
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.sampled_from(KEYS), max_size=8),
            st.lists(st.integers(0, 2**32 - 1), max_size=20),
            st.lists(st.integers(0, 1000), max_size=5),
            st.sampled_from([None, "salt-a"]),
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([1, 4, 16]),
    st.sampled_from([0, 3, 1000]),
)
def test_memoised_chain_equals_hashing_everything(
    prompts: list[tuple[list[tuple[str, str]], list[int], list[int], str | None]],
    block_size: int,
    entries: int,
) -> None:
    memo = ChainMemo(block_size, entries)
    for _ in range(2):  # the second pass walks the memo
        for keys, uncached, suffix, salt in prompts:
            pieces = _pieces(keys, uncached)
            tokens = [t for _, part in pieces for t in part] + suffix
            assert memo.chain(pieces, suffix, salt) == hash_blocks(tokens, block_size, salt)


def test_repeated_prefix_is_served_from_the_memo() -> None:
    memo = ChainMemo(16)
    conv = [KEYS[3], KEYS[8], KEYS[9]]
    memo.chain(_pieces(conv, []))
    assert memo.hits == 0 and memo.misses == 3
    longer = _pieces([*conv, KEYS[7]], [])
    tokens = [t for _, part in longer for t in part]
    assert memo.chain(longer) == hash_blocks(tokens, 16)
    assert memo.hits == 3 and memo.misses == 4


def test_router_routes_with_memoised_chain(tokenizer: object) -> None:
    """The router's chain for a chat whose earlier turns were seen equals hashing its full ids."""
    from kvroute.policies.registry import make_policy
    from kvroute.prepare.tokenize import RequestTokenizer
    from kvroute.server.config import BackendSpec, RouterConfig
    from kvroute.server.stages.prepare import hashed, split
    from kvroute.server.state.router import RouterState
    from kvroute.server.wire.validate import parse_request

    core = RouterState(
        RouterConfig(backends=(BackendSpec("http://a:1"),)),
        RequestTokenizer(tokenizer),  # type: ignore[arg-type]
        make_policy("lmetric"),
    )
    history = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "hi " * 50}]
    for turn in (
        history,
        [*history, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
    ):
        body = b'{"model": "m", "messages": %s}' % __import__("orjson").dumps(turn)
        req = parse_request(body, chat=True)
        pending = split(core, req)
        ids, chain = hashed(core, core.tokenizer.finish_pieces(pending), pending.suffix, None)
        assert ids == core.tokenizer.tokenizer.encode_chat(turn)
        assert chain == tuple(hash_blocks(ids, 16))
    assert core.chains.hits >= 2


def test_memo_is_bounded_by_the_tokens_it_covers() -> None:
    """A few huge pieces cannot grow the memo past its token bound (regression: only entries were
    bounded), and what it keeps still gives the right hashes."""
    memo = ChainMemo(16, entries=1000, tokens=5000)
    for n in range(40):
        part = list(range(n * 1000, n * 1000 + 1000))
        chain = memo.chain([(("user", f"m{n}"), part)])
        assert chain == hash_blocks(part, 16)
        assert memo.tokens <= 5000
    assert memo.tokens == 5000
