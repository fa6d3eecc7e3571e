"""The SLRU policy pinned to exact outcomes (a scan passes through probation, hit blocks are
protected up to their share, a returning evicted key is protected at once), on a BlockPool with
integrity after every step; and the hit-rate harness (bench.hitrate): its offline optimum never
loses to LRU and reaches the unbounded ideal when the pool holds everything."""

from __future__ import annotations

import pytest

from bench.hitrate import Workload, replay
from bench.workloads import ChatShape, Request, chat_requests
from pagedkv.cache_node.block_pool import BlockPool
from pagedkv.cache_node.eviction import SLRUPolicy, make_policy
from pagedkv.protos.errors import InvalidArgument


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def published(pool: BlockPool, n: int, first_key: int) -> list[int]:
    blocks, _ = pool.allocate(n)
    for i, b in enumerate(blocks):
        assert pool.publish(b, key(first_key + i))
    return blocks


def check(pool: BlockPool, held: list[int]) -> None:
    pool.check_integrity({b: held.count(b) for b in set(held)})


@pytest.mark.parametrize("native", [True, False])
def test_a_scan_evicts_itself_not_the_prefix_that_was_hit(native: bool) -> None:
    pool = BlockPool(8, SLRUPolicy(8, native=native), native=native)
    prefix = published(pool, 2, 0)  # a shared prefix: used, released, hit, released again
    pool.free(prefix)
    for b in prefix:
        pool.incref(b)
        pool.policy.touch(b)
    pool.free(prefix)
    check(pool, [])
    scan = published(pool, 6, 100)  # a long unique prompt fills the rest of the pool
    pool.free(scan)
    assert pool.policy.victims_in_order() == [*scan, *prefix]
    # A second scan of 5: the protected prefix (2 of 8 evictable, under its 0.5 share) survives.
    blocks, evicted = pool.allocate(5)
    assert [e.block for e in evicted] == scan[:5]
    assert all(pool.lookup(key(i)) is not None for i in (0, 1))
    check(pool, blocks)
    # Under LRU the same steps evict the prefix first (it was released before the scan).
    lru = BlockPool(8, make_policy("lru", 8, native=native), native=native)
    p = published(lru, 2, 0)
    lru.free(p)
    for b in p:
        lru.incref(b)
    lru.free(p)
    lru.free(published(lru, 6, 100))
    _, evicted = lru.allocate(5)
    assert {e.key for e in evicted} >= {key(0), key(1)}


@pytest.mark.parametrize("native", [True, False])
def test_protected_is_held_to_its_share_and_demoted_blocks_go_first_after_probation(native: bool) -> None:
    pool = BlockPool(6, SLRUPolicy(6, protected_share=0.5, native=native), native=native)
    hot = published(pool, 4, 0)
    pool.free(hot)
    for b in hot:
        pool.incref(b)
        pool.policy.touch(b)
    pool.free(hot)  # 4 protected, hot[0] the oldest
    cold = published(pool, 2, 10)
    pool.free(cold)
    assert pool.policy.victims_in_order() == [*cold, *hot]
    # 6 evictable, share 3: one protected block (the oldest, hot[0]) is demoted behind probation.
    block, evicted = pool.allocate_one()
    assert evicted is not None and evicted.key == key(10) and block == cold[0]
    assert pool.policy.victims_in_order() == [cold[1], *hot]
    assert pool.policy.segment_of(pool.policy.victims_in_order()[1]) == "probation"
    check(pool, [block])


@pytest.mark.parametrize("native", [True, False])
def test_an_evicted_key_that_returns_is_protected_at_once(native: bool) -> None:
    pool = BlockPool(2, SLRUPolicy(2, native=native), native=native)
    a = published(pool, 1, 0)
    pool.free(a)
    b = published(pool, 1, 1)
    pool.free(b)
    blocks, evicted = pool.allocate(1)  # key 0 is evicted: it enters the ghost list
    assert [e.key for e in evicted] == [key(0)]
    pool.publish(blocks[0], key(0))  # recomputed and published again
    pool.free(blocks)
    assert pool.policy.victims_in_order() == [b[0], blocks[0]]  # key 1 in probation, key 0 protected
    check(pool, [])


def test_bad_share_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="protected_share"):
        SLRUPolicy(4, protected_share=1.5)


def _tiny_chat() -> list[Request]:
    shape = ChatShape(
        num_conversations=16,
        system_tokens=64,
        turns=(2, 5),
        user_tokens=(16, 64),
        answer_tokens=(16, 96),
        active=6,
        document_every=3,
        document_tokens=(128, 256),
    )
    return chat_requests(shape)


def test_belady_bounds_lru_and_slru_and_an_unbounded_pool_reaches_the_ideal() -> None:
    reqs = _tiny_chat()
    w = Workload("tiny", reqs, 16, 4, [])
    unbounded = sum(-(-len(r.tokens) // 16) for r in reqs)
    ideal = replay(w, unbounded, "lru")
    assert replay(w, unbounded, "belady") == pytest.approx(ideal)
    for pool in (64, 128):
        opt = replay(w, pool, "belady")
        lru, slru = replay(w, pool, "lru"), replay(w, pool, "slru")
        assert 0 < lru <= opt + 1e-12 and 0 < slru <= opt + 1e-12 and opt <= ideal + 1e-12
        assert lru < ideal  # the pool is small enough to make the policies differ from the ideal


def test_replay_is_deterministic() -> None:
    w = Workload("tiny", _tiny_chat(), 16, 4, [])
    assert replay(w, 128, "slru") == replay(w, 128, "slru")
