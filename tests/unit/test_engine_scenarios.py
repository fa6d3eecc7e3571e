"""Narrated scenarios on a tiny engine (block_size 4), asserting exact block ids,
byte-exact KV and integrity after every step."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import Q_HEADS, SPEC, dense_attention, fill, kv_for, make_engine

from pagedkv.protos.errors import FailedPrecondition

PROMPT = list(range(100, 110))  # 10 tokens: blocks [0..3], [4..7], partial [8, 9]


def test_prefix_hit_reuses_full_blocks_only():
    e = make_engine()
    assert fill(e, "a", PROMPT, seed=1) == 0
    assert e.block_table("a") == [0, 1, 2]
    e.check_integrity()
    # Same 10 tokens + 2: the two full blocks are reused, the partial one is not.
    assert e.lookup(PROMPT + [7, 7]) == 8
    assert fill(e, "b", PROMPT + [7, 7], seed=1) == 8
    assert e.block_table("b") == [0, 1, 3]
    e.check_integrity()
    ka, va = e.read_kv("a", 0, 8)
    kb, vb = e.read_kv("b", 0, 8)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    # Another salt (tenant) never hits.
    assert e.lookup(PROMPT, salt=b"other-tenant") == 0
    stats = e.stats()
    assert (stats["prefix_query_tokens"], stats["prefix_hit_tokens"]) == (22, 8)
    # The prompt's last token is always computed: a 8-token prompt reuses 1 block, not 2.
    assert e.open("c", PROMPT[:8]).num_cached_tokens == 4
    e.check_integrity()


def test_fork_copies_shared_partial_block_on_first_write():
    e = make_engine()
    fill(e, "a", PROMPT[:6], seed=2)  # blocks [0, 1]; block 1 holds 2 tokens
    e.fork("a", "b")
    assert e.block_table("b") == [0, 1]
    e.check_integrity()
    before = e.read_kv("a")
    k1, v1 = kv_for(1, 9)
    e.append("b", [55], k1, v1)
    assert e.block_table("b") == [0, 2]  # partial block copied to 2, then written
    assert e.block_table("a") == [0, 1]
    assert e.stats()["cow_copies"] == 1
    after = e.read_kv("a")
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    kb, vb = e.read_kv("b")
    assert torch.equal(kb[:, :6], before[0]) and torch.equal(kb[:, 6:], k1)
    # "a" now owns block 1 alone: its next write goes in place.
    e.append("a", [66], *kv_for(1, 10))
    assert e.block_table("a") == [0, 1]
    assert e.stats()["cow_copies"] == 1
    e.check_integrity()


def _cached_after(e, prompts):
    return [e.lookup(p + [99]) // 4 for p in prompts]


@pytest.mark.parametrize(
    "policy, expected_survivors",
    [
        ("lru", [0, 1, 1]),  # x was released longest ago -> evicted first
        ("lfu", [1, 0, 1]),  # x was used 3 times; y and z once; y is the older of those
        ("score", [1, 1, 0]),  # z received no attention mass
    ],
)
def test_eviction_order_by_policy(policy, expected_survivors):
    """Pool of 4 blocks. Prompts x, y, z of one full block (+ a partial token)
    end up cached in blocks 0, 1, 2; then a 2-block sequence forces one eviction."""
    e = make_engine(num_blocks=4, num_host_blocks=0, policy=policy)
    x, y, z = [1] * 4, [2] * 4, [3] * 4
    for j in range(3):  # x: admitted once, then hit twice
        assert fill(e, "x", x + [99], seed=0) == (4 if j else 0)
        if policy == "score" and j == 0:
            e.attend_decode(["x"], 0, torch.randn(1, Q_HEADS, SPEC.head_dim))
        e.free("x")
        e.check_integrity()
    for name, p in (("y", y), ("z", z)):
        fill(e, name, p + [99], seed=1)
        if policy == "score" and name == "y":
            e.attend_decode(["y"], 0, torch.randn(1, Q_HEADS, SPEC.head_dim))
        e.free(name)
        e.check_integrity()
    assert e.stats()["cached_blocks"] == 3
    assert sorted(e.manager.device.policy.victims_in_order()) == [0, 1, 2]
    fill(e, "big", [7] * 8, seed=7)  # 2 blocks: the free one + one eviction
    e.check_integrity()
    assert _cached_after(e, [x, y, z]) == expected_survivors
    assert e.stats()["device_evictions"] == 1


def test_pinned_prefix_is_never_evicted():
    e = make_engine(num_blocks=4, num_host_blocks=0)
    fill(e, "a", [1] * 8 + [2], seed=1)  # blocks 0, 1 full, 2 partial
    e.free("a")
    assert e.pin([1] * 8) == 8
    e.check_integrity()
    fill(e, "big", [5] * 8, seed=5)  # 2 blocks: all that is not pinned
    with pytest.raises(Exception, match="requested 1 blocks, only 0 available"):
        e.append("big", [6] * 4, *kv_for(4, 6))
    assert e.lookup([1] * 8 + [2]) == 8
    e.free("big")
    assert e.unpin([1] * 8) == 8
    fill(e, "big2", [5] * 13, seed=5)  # 4 blocks: now the unpinned prefix goes
    assert e.lookup([1] * 8 + [2]) == 0
    e.check_integrity()


def test_host_tier_round_trip_is_byte_exact():
    e = make_engine(num_blocks=4, num_host_blocks=4)
    fill(e, "a", PROMPT[:8] + [1], seed=3)  # blocks 0, 1 keyed, 2 partial
    want = e.read_kv("a", 0, 8)
    e.free("a")
    fill(e, "b", [9] * 13, seed=4)  # 4 blocks: evicts a's two cached blocks to host
    s = e.stats()
    assert (s["evicted_to_host"], s["host_cached_blocks"]) == (2, 2)
    assert e.lookup(PROMPT[:8] + [1]) == 8  # still a hit, on the host
    e.free("b")
    r = e.open("c", PROMPT[:8] + [1])
    assert (r.num_cached_tokens, r.num_host_hit_tokens) == (8, 8)
    got = e.read_kv("c", 0, 8)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # Moved back, not duplicated: the host now holds only the block of "b" evicted to make room.
    assert (e.stats()["host_cached_blocks"], e.stats()["evicted_to_host"]) == (1, 3)
    e.check_integrity()


def test_swap_round_trip_is_byte_exact_and_revives_cached_blocks():
    e = make_engine(num_blocks=8, num_host_blocks=4)
    fill(e, "a", PROMPT, seed=5)
    want = e.read_kv("a")
    assert e.swap_out("a") == 3
    s = e.stats()
    assert (s["used_blocks"], s["host_used_blocks"], s["cached_blocks"]) == (0, 3, 2)
    with pytest.raises(FailedPrecondition, match="swapped out"):
        e.attend_decode(["a"], 0, torch.randn(1, Q_HEADS, SPEC.head_dim))
    # Its two full blocks are still cached on the device: only the partial one is copied.
    assert e.swap_in("a") == 1
    got = e.read_kv("a")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert e.stats()["host_used_blocks"] == 0
    e.check_integrity()


def test_swap_in_without_room_fails_and_loses_nothing():
    e = make_engine(num_blocks=3, num_host_blocks=3)
    fill(e, "a", [1, 2, 3], seed=6)  # 1 partial block, no key
    want = e.read_kv("a")
    e.swap_out("a")
    fill(e, "b", [4] * 12, seed=7)  # takes all 3 device blocks
    with pytest.raises(Exception, match="swap in sequence 'a': requested 1 blocks, only 0 available"):
        e.swap_in("a")
    e.check_integrity()
    e.free("b")
    e.swap_in("a")
    got = e.read_kv("a")
    assert torch.equal(got[0], want[0])
    e.check_integrity()


def test_token_budget_drops_lowest_score_middle_blocks():
    e = make_engine(num_blocks=16)
    fill(e, "a", list(range(20)), seed=8)  # 5 full blocks: 0..4
    e.fork("a", "shared")  # another reference: dropped blocks' bytes must survive
    shared_before = e.read_kv("shared")
    seq = e.manager.seqs["a"]
    seq.scores[:] = [5.0, 1.0, 0.5, 3.0, 4.0]  # block 2 is least attended, then 1
    e.set_budget("a", max_tokens=16, sink_blocks=1, recent_blocks=2)
    assert e.block_table("a") == [0, 1, 3, 4]  # dropped logical block 2 only
    assert e.sequence_length("a") == 20
    assert e.stats()["budget_dropped_blocks"] == 1
    # Appending 4 more tokens must first make room: block 1 (next lowest middle) goes.
    e.append("a", [1, 2, 3, 4], *kv_for(4, 9))
    assert e.block_table("a")[:3] == [0, 3, 4]
    shared_after = e.read_kv("shared")
    assert torch.equal(shared_before[0], shared_after[0])
    e.check_integrity()


def test_attention_through_the_engine_matches_dense_reference():
    e = make_engine(num_blocks=32)
    fill(e, "a", list(range(13)), seed=11)
    fill(e, "b", list(range(13)) + [50, 51, 52], seed=11)  # shares 3 blocks with a
    g = torch.Generator().manual_seed(0)
    for layer in range(SPEC.num_layers):
        q = torch.randn(2, Q_HEADS, SPEC.head_dim, generator=g)
        kn = torch.randn(2, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
        vn = torch.randn(2, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
        out = e.attend_decode(["a", "b"], layer, q, kn, vn, [1, 2] if layer == 0 else None)
        for i, sid in enumerate(["a", "b"]):
            k, v = e.read_kv(sid)
            ref, lse = dense_attention(q[i : i + 1], k[layer], v[layer], k.shape[1] - 1)
            torch.testing.assert_close(out.out[i].double(), ref[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(out.lse[i].double(), lse[0], rtol=1e-5, atol=1e-6)
            assert torch.equal(k[layer, -1], kn[i])
    e.check_integrity()
    # Prefill of 5 new tokens on "a" (append-and-attend), layer by layer.
    for layer in range(SPEC.num_layers):
        q = torch.randn(5, Q_HEADS, SPEC.head_dim, generator=g)
        kn = torch.randn(5, SPEC.num_kv_heads, SPEC.head_dim, generator=g)
        out = e.attend_prefill("a", layer, q, kn, kn, list(range(5)) if layer == 0 else None)
        k, v = e.read_kv("a")
        ref, lse = dense_attention(q, k[layer], v[layer], k.shape[1] - 5)
        torch.testing.assert_close(out.out.double(), ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.lse.double(), lse, rtol=1e-5, atol=1e-6)
    assert e.sequence_length("a") == 19
    e.check_integrity()
