"""The batched decode step (reserve_tokens / append_tokens) against one-token appends.

A decode step for a batch must leave the manager exactly as appending one token
to each sequence in batch order would: the same block ids, keys, events and
counters. The manager keeps the last step's batch (its decode group) so a
repeated batch skips the per-sequence checks; these tests pin that it drops the
group whenever a member changes in another way.
"""

from __future__ import annotations

import random

import pytest

from pagedkv.cache_node.kv_manager import KVCacheManager
from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, SequenceNotFound

BS = 4


def _state(m: KVCacheManager) -> tuple:
    seqs = {sid: (list(s.table), list(s.keys), list(s.tokens)) for sid, s in m.seqs.items()}
    return seqs, m.stats(), list(m.events), dict(m.device.block_of_key)


@pytest.mark.parametrize("policy", ["lru", "lfu", "score"])
@pytest.mark.parametrize("num_host_blocks", [0, 6])
def test_decode_steps_equal_one_token_appends(policy: str, num_host_blocks: int) -> None:
    rng = random.Random(7)
    batched, single = (
        KVCacheManager(24, BS, num_host_blocks=num_host_blocks, policy=policy, record_events=True)
        for _ in range(2)
    )
    ids = [f"s{i}" for i in range(5)]
    for m in (batched, single):
        for i, sid in enumerate(ids):
            prompt = [i] * (3 + i)  # lengths 3..7: the members cross block boundaries at different steps
            m.open(sid, prompt)
            m.append(sid, prompt)
    for step in range(40):
        if step % 9 == 8:  # a member leaves and a new one joins: a new group forms
            gone = ids.pop(rng.randrange(len(ids)))
            ids.append(f"n{step}")
            for m in (batched, single):
                m.free(gone)
                m.open(ids[-1], [step] * 5)
                m.append(ids[-1], [step] * 5)
        tokens = [rng.randrange(3) for _ in ids]  # few distinct tokens: keys repeat, the cache hits
        try:
            slots = batched.append_tokens(ids, tokens)
        except CapacityExceeded:
            break
        for j, (sid, t) in enumerate(zip(ids, tokens, strict=True)):
            assert single.append(sid, [t]) == ([slots.blocks[j]], [slots.offsets[j]])
        batched.check_integrity()
        assert _state(batched) == _state(single), f"step {step}"
    assert batched.stats()["device_evictions"] > 0, "the pool never came under pressure"


def test_repeated_batch_after_fork_copies_the_shared_tail() -> None:
    m = KVCacheManager(16, BS)
    m.open("a", [1, 2, 3, 4, 5])
    m.append("a", [1, 2, 3, 4, 5])
    m.append_tokens(["a"], [6])
    m.append_tokens(["a"], [7])  # the group serves this step
    m.fork("a", "b")  # shares a's partial last block
    shared = m.get("a").table[-1]
    slots = m.append_tokens(["a"], [8])  # same batch as before: must not write into the shared block
    assert slots.blocks[0] != shared and m.counters.cow_copies == 1
    assert m.get("b").table[-1] == shared and m.get("b").tokens == [1, 2, 3, 4, 5, 6, 7]
    m.check_integrity()


def test_reserve_of_a_member_between_steps_keeps_the_schedule() -> None:
    m = KVCacheManager(16, BS)
    for sid in ("a", "b"):
        m.open(sid, [1, 2, 3])
        m.append(sid, [1, 2, 3])
    m.reserve_tokens(["a", "b"], [4, 4])
    m.reserve("a", [5, 6])  # a prefill-style append to a member: a's length is off the group's schedule
    m.reserve_tokens(["a", "b"], [7, 5])
    m.check_integrity()
    a, b = m.get("a"), m.get("b")
    assert a.tokens == [1, 2, 3, 4, 5, 6, 7] and len(a.table) == 2
    assert b.tokens == [1, 2, 3, 4, 5] and len(b.table) == 2
    assert a.keys[0] == b.keys[0] == m.block_keys([1, 2, 3, 4])[0]


@pytest.mark.parametrize(
    ("ids", "tokens", "error", "named"),
    [
        (["a", "zz", "b"], [1, 2, 3], SequenceNotFound, "zz"),
        (["a", "b", "a"], [1, 2, 3], InvalidArgument, "more than once"),
        (["a", "b"], [1], InvalidArgument, "2 sequences got 1 tokens"),
        (["a", "b", "c"], [1, 2, 3], CapacityExceeded, "decode step"),
    ],
)
def test_a_batch_with_one_bad_entry_changes_nothing(ids: list, tokens: list, error: type, named: str) -> None:
    m = KVCacheManager(8, BS, record_events=True)
    for sid in ("a", "b", "c"):
        m.open(sid, [9, 9, 9, 9, 9, 9, 9, 9])  # 2 full blocks each: 6 of 8 blocks used
        m.append(sid, [9, 9, 9, 9, 9, 9, 9, 9])
    m.append_tokens(["a", "b"], [1, 1])  # a and b take their third block: the pool is full
    m.append_tokens(["a", "b"], [1, 1])  # the group's step
    before = _state(m)
    with pytest.raises(error, match=named):
        m.reserve_tokens(ids, tokens)
    assert _state(m) == before
    m.check_integrity()
    m.reserve_tokens(["a", "b"], [2, 2])  # the batch still works afterwards
    assert m.get("a").tokens[-3:] == [1, 1, 2]
