"""BlockPool pinned to exact outcomes: free() orders the free list and the LRU as one-by-one
releases would, with or without pins; take() evicts oldest first and reports the keys in
order; a random mix of frees and takes leaves two pools (one with an unrelated pinned block)
in the same state, with integrity after every step."""

from __future__ import annotations

import random

import pytest

from pagedkv.cache_node.block_pool import BlockPool
from pagedkv.protos.errors import IntegrityError


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def state(pool: BlockPool) -> tuple:
    return (
        list(pool.free_blocks),
        pool.policy.victims_in_order(),
        dict(pool.block_of_key),
        list(pool.refcount),
        list(pool.key_of),
    )


def check(pool: BlockPool, tables: list[list[int]]) -> None:
    refs: dict[int, int] = {}
    for t in tables:
        for b in t:
            refs[b] = refs.get(b, 0) + 1
    pool.check_integrity(refs)


def test_free_of_private_blocks_orders_free_list_and_lru_as_one_by_one() -> None:
    # Pool b has one pinned block, unrelated to the frees: it must change nothing else.
    a, b = BlockPool(16), BlockPool(16)
    for pool in (a, b):
        blocks, _ = pool.allocate(16)
        assert blocks == list(range(16))
        for i in (1, 2, 5, 6, 9, 15):  # keyed (full, published) blocks
            assert pool.publish(i, key(i))
    b.pin(15)
    for pool in (a, b):
        pool.free([7, 6, 5, 4, 3])  # mixed: keyed ones go to the LRU, the rest to the free list
        pool.free([9, 8])
        pool.free([2, 1, 0])
        pool.free([10, 11])  # unkeyed only
    assert state(a) == state(b)
    assert a.free_blocks[-7:] == [7, 4, 3, 8, 0, 10, 11]
    assert a.policy.victims_in_order() == [6, 5, 9, 2, 1]
    check(a, [[12], [13], [14], [15]])


def test_free_of_shared_blocks_and_a_double_free() -> None:
    pool = BlockPool(4)
    blocks, _ = pool.allocate(3)
    pool.incref(blocks[0])  # shared: refcount 2
    pool.publish(blocks[1], key(1))
    pool.free(blocks)
    assert pool.refcount == [1, 0, 0, 0] and pool.policy.victims_in_order() == [1]
    check(pool, [[0]])
    pool.free([0])
    with pytest.raises(IntegrityError, match="freed more often"):
        pool.free([0])


def test_take_evicts_oldest_first_and_reports_keys_in_order() -> None:
    pool = BlockPool(6)
    blocks, _ = pool.allocate(6)
    for b in blocks:
        pool.publish(b, key(b))
    pool.free([3, 1, 4, 0, 5])  # LRU order 3, 1, 4, 0, 5; block 2 stays used
    evicted: list[bytes] = []
    got = pool.take(4, evicted)
    assert got == [3, 1, 4, 0] and evicted == [key(3), key(1), key(4), key(0)]
    assert pool.policy.victims_in_order() == [5] and set(pool.block_of_key) == {key(2), key(5)}
    assert [pool.refcount[b] for b in got] == [1, 1, 1, 1] and all(pool.key_of[b] is None for b in got)
    assert pool.num_evictions == 4
    check(pool, [[2], got])


def test_random_frees_and_takes_with_and_without_pins_agree() -> None:
    rng = random.Random(5)
    a, b = BlockPool(64), BlockPool(65)  # b's extra block 64 is pinned and never freed
    for pool in (a, b):
        pool.allocate(64 if pool is a else 65)
        if pool is b:
            b.publish(64, key(10_000))
            b.pin(64)
    tables: list[list[int]] = []
    for pool in (a, b):
        pool.free(list(range(64)))
    next_key = 0
    for step in range(300):
        if tables and rng.random() < 0.5:  # release a table, publishing some of its blocks first
            t = tables.pop(rng.randrange(len(tables)))
            for blk in t:
                if rng.random() < 0.5:
                    next_key += 1
                    assert a.publish(blk, key(next_key)) == b.publish(blk, key(next_key))
            a.free(t[::-1])
            b.free(t[::-1])
        else:
            n = rng.randint(1, 6)
            if n > a.num_available:
                continue
            ea: list[bytes] = []
            eb: list[bytes] = []
            ta, tb = a.take(n, ea), b.take(n, eb)
            assert (ta, ea) == (tb, eb), step
            tables.append(ta)
        assert a.free_blocks == b.free_blocks and a.policy.victims_in_order() == b.policy.victims_in_order()
        assert a.refcount == b.refcount[:64] and a.key_of == b.key_of[:64]
        assert a.block_of_key == {k: v for k, v in b.block_of_key.items() if v != 64}
        check(a, tables)
