"""Prefix index: exact and approximate updates against naive references; one-walk matching."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.index import ApproxPrefixIndex, PrefixIndex, match_chain

BLOCKS = st.integers(0, 11)  # a small universe so that chains overlap a lot
INSTANCES = st.integers(0, 6)
chain_st = st.lists(BLOCKS, max_size=10)
unique_chain_st = st.lists(BLOCKS, max_size=10, unique=True)  # chained hashes never repeat in a chain


def naive_match(held: dict[int, set[int]], chain: Sequence[int], n: int) -> list[int]:
    """Per instance, count leading chain blocks it holds."""
    out = []
    for i in range(n):
        k = 0
        while k < len(chain) and chain[k] in held.get(i, set()):
            k += 1
        out.append(k)
    return out


# ---------------------------------------------------------------- exact index

exact_op = st.one_of(
    st.tuples(st.just("store"), INSTANCES, chain_st),
    st.tuples(st.just("remove"), INSTANCES, chain_st),
    st.tuples(st.just("clear"), INSTANCES, st.just([])),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(exact_op, max_size=30), st.lists(chain_st, min_size=1, max_size=5), st.integers(0, 9))
def test_exact_index_equals_naive_reference(ops, chains, n) -> None:
    index = PrefixIndex()
    ref: dict[int, set[int]] = {}
    for op, inst, blocks in ops:
        if op == "store":
            index.store(inst, blocks)
            ref.setdefault(inst, set()).update(blocks)
        elif op == "remove":
            index.remove(inst, blocks)
            ref.setdefault(inst, set()).difference_update(blocks)
        else:
            index.clear(inst)
            ref.pop(inst, None)
    for chain in chains:
        assert index.match(chain, n) == naive_match(ref, chain, n)
    for i in range(8):
        assert index.num_blocks(i) == len(ref.get(i, set()))
    assert len(index) == len(set().union(*ref.values()))
    for b in range(12):
        assert index.holders(b) == sum(1 << i for i, s in ref.items() if b in s)


def test_match_prefix_semantics_and_early_stop() -> None:
    index = PrefixIndex()
    index.store(0, [1, 2, 3, 4])
    index.store(1, [1, 3, 4])  # hole at block 2: only block 1 counts
    index.store(2, [2, 3])  # no root: nothing counts
    index.store(3, [1, 2])
    assert index.match([1, 2, 3, 4, 5], 5) == [4, 1, 0, 2, 0]
    assert index.match([1, 2, 3, 4, 5], 2) == [4, 1]  # instances beyond num_instances are ignored
    assert index.match([9, 1, 2], 4) == [0, 0, 0, 0]
    assert index.match([], 3) == [0, 0, 0]
    assert index.match([1], 0) == []


def test_instances_may_grow_at_run_time() -> None:
    index = PrefixIndex()
    index.store(0, [1, 2])
    index.store(130, [1, 2, 3])
    lengths = index.match([1, 2, 3], 131)
    assert lengths[0] == 2 and lengths[130] == 3 and sum(lengths) == 5
    index.clear(130)
    assert index.match([1, 2, 3], 131)[130] == 0 and len(index) == 2


def test_exact_updates_are_idempotent_and_tolerant() -> None:
    index = PrefixIndex()
    index.store(0, [1, 1, 2])
    index.store(0, [2])
    assert index.num_blocks(0) == 2 and len(index) == 2
    index.remove(0, [7])  # unknown block
    index.remove(5, [1])  # unknown instance
    index.clear(9)
    assert index.match([1, 2], 1) == [2]
    index.remove(0, [1])
    assert index.match([1, 2], 1) == [0] and len(index) == 1
    with pytest.raises(ValueError):
        index.store(-1, [1])


def test_match_chain_on_a_raw_mask_dict() -> None:
    masks = {10: 0b111, 11: 0b101, 12: 0b001}
    assert match_chain(masks, [10, 11, 12, 13], 3) == [3, 1, 2]


# ---------------------------------------------------------------- approximate index


class NaiveApprox:
    """Per instance a list of (block, time), least recently used first."""

    def __init__(self, cap: int, ttl: float | None) -> None:
        self.cap, self.ttl = cap, ttl
        self.lru: dict[int, list[tuple[int, float]]] = {}

    def assign(self, inst: int, chain: Sequence[int], now: float) -> None:
        lst = self.lru.setdefault(inst, [])
        for b in reversed(list(chain)):  # leaf first, root last (most recent)
            lst[:] = [(x, t) for x, t in lst if x != b]
            lst.append((b, now))
        while len(lst) > self.cap:
            lst.pop(0)

    def expire(self, now: float) -> None:
        if self.ttl is not None:
            for inst, lst in self.lru.items():
                self.lru[inst] = [(b, t) for b, t in lst if t > now - self.ttl]

    def held(self) -> dict[int, set[int]]:
        return {i: {b for b, _ in lst} for i, lst in self.lru.items()}


approx_op = st.one_of(
    st.tuples(st.just("assign"), INSTANCES, unique_chain_st, st.floats(0, 3)),
    st.tuples(st.just("expire"), st.just(0), st.just([]), st.floats(0, 3)),
)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(0, 8),
    st.sampled_from([None, 0.5, 2.0]),
    st.lists(approx_op, max_size=30),
    st.lists(chain_st, min_size=1, max_size=4),
)
def test_approx_index_equals_naive_reference(cap, ttl, ops, chains) -> None:
    index = ApproxPrefixIndex(cap, ttl_s=ttl)
    ref = NaiveApprox(cap, ttl)
    now = 0.0
    for op, inst, chain, dt in ops:
        now += dt
        if op == "assign":
            index.assign(inst, chain, now)
            ref.assign(inst, chain, now)
        else:
            index.expire(now)
            ref.expire(now)
        for i in range(7):
            assert index.num_blocks(i) <= cap
            assert index.blocks(i) == [b for b, _ in ref.lru.get(i, [])]  # LRU order
    held = ref.held()
    for chain in chains:
        assert index.match(chain, 7) == naive_match(held, chain, 7)
    assert len(index) == len(set().union(*held.values()))


def test_approx_evicts_leaf_most_first_and_keeps_a_prefix() -> None:
    index = ApproxPrefixIndex(capacity_blocks=4)
    index.assign(0, [1, 2, 3], now=0.0)
    index.assign(0, [7, 8, 9], now=1.0)  # needs 2 more slots: evicts 3 then 2 (leaf-most, oldest)
    assert index.match([1, 2, 3], 1) == [1]
    assert index.match([7, 8, 9], 1) == [3]
    index.assign(0, list(range(100, 110)), now=2.0)  # longer than capacity: its root-most 4 stay
    assert index.blocks(0) == [103, 102, 101, 100]
    assert index.match(list(range(100, 110)), 1) == [4]


def test_approx_reassign_refreshes_recency() -> None:
    index = ApproxPrefixIndex(capacity_blocks=3)
    index.assign(0, [1], now=0.0)
    index.assign(0, [2], now=1.0)
    index.assign(0, [1], now=2.0)  # 1 is most recent again
    index.assign(0, [3, 4], now=3.0)  # evicts 2
    assert index.blocks(0) == [1, 4, 3]
    assert index.holders(2) == 0 and index.holders(1) == 1


def test_approx_ttl_expiry_is_inclusive_and_time_is_monotone() -> None:
    index = ApproxPrefixIndex(capacity_blocks=10, ttl_s=5.0)
    index.assign(0, [1, 2], now=0.0)
    index.assign(1, [1], now=3.0)
    assert index.expire(4.9) == 0
    assert index.expire(5.0) == 2  # last assigned at or before now - ttl
    assert index.holders(1) == 0b10 and index.num_blocks(0) == 0
    assert index.expire(8.0) == 1 and len(index) == 0
    with pytest.raises(ValueError):
        index.assign(0, [1], now=7.0)


def test_approx_capacity_override_clear_and_remove() -> None:
    index = ApproxPrefixIndex(capacity_blocks=5)
    index.assign(2, [1, 2, 3, 4], now=0.0)
    index.set_capacity(2, 2)
    assert index.capacity(2) == 2 and index.blocks(2) == [2, 1]
    index.assign(3, [1, 9], now=1.0)
    index.remove(3, [9, 42])
    assert index.blocks(3) == [1] and index.holders(1) == 0b1100
    index.clear(2)
    assert index.holders(1) == 0b1000 and index.num_blocks(2) == 0 and len(index) == 1
    assert index.expire(100.0) == 0  # no TTL configured
    with pytest.raises(ValueError):
        ApproxPrefixIndex(capacity_blocks=-1)
    with pytest.raises(ValueError):
        ApproxPrefixIndex(capacity_blocks=1, ttl_s=0)
