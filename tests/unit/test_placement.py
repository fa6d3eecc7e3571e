"""place(): narrated scenarios with exact choices (no store, no network)."""

from __future__ import annotations

import hashlib

import pytest

from pagedkv.coordinator.placement import NodeCandidate, Placement, PlacementWeights, place
from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, Unavailable

BLOCK = 16


def node(node_id: str, cached: int, free: int, total: int = 100) -> NodeCandidate:
    return NodeCandidate(node_id, cached_blocks=cached, free_blocks=free, total_blocks=total)


def test_the_longest_cached_prefix_wins_over_load() -> None:
    # n1 is busy (90% used) but holds 8 of the 10 prompt blocks; n2 is idle and holds none.
    result = place([node("n1", cached=8, free=10), node("n2", cached=0, free=100)], 10, BLOCK)
    assert result.node_id == "n1"
    assert (result.cached_blocks, result.cached_tokens, result.new_blocks) == (8, 128, 2)
    assert result.scores == {"n1": pytest.approx(8 - 92 / 100), "n2": pytest.approx(-10 / 100)}


def test_load_breaks_ties_between_equal_prefixes() -> None:
    # Both cache 4 blocks; n2 has more room, so it ends up less loaded.
    result = place([node("n1", 4, free=20), node("n2", 4, free=60), node("n3", 3, free=100)], 6, BLOCK)
    assert result.node_id == "n2"
    assert result.new_blocks == 2


def test_a_heavier_load_weight_trades_cache_hits_for_balance() -> None:
    busy, idle = node("busy", cached=2, free=10), node("idle", cached=0, free=100)
    assert place([busy, idle], 4, BLOCK).node_id == "busy"
    # load_weight 8: the busy node's 2 cached blocks (score 2 - 8*0.92) lose to the idle one (-8*0.04).
    assert place([busy, idle], 4, BLOCK, PlacementWeights(load_weight=8.0)).node_id == "idle"


def test_a_node_without_room_for_its_uncached_remainder_is_never_chosen() -> None:
    # n1 caches 2 of 12 blocks but has only 5 free (needs 10); n2 has room.
    result = place([node("n1", 2, free=5), node("n2", 0, free=12)], 12, BLOCK)
    assert result.node_id == "n2"
    assert result.rejected == ("n1",)
    assert set(result.scores) == {"n2"}


def test_a_full_cached_prefix_needs_no_free_blocks() -> None:
    result = place([node("n1", 5, free=0), node("n2", 0, free=50)], 5, BLOCK)
    assert (result.node_id, result.new_blocks, result.cached_tokens) == ("n1", 0, 80)


def test_cached_blocks_beyond_the_need_are_capped() -> None:
    result = place([node("n1", 9, free=0)], 3, BLOCK)
    assert (result.cached_blocks, result.new_blocks) == (3, 0)


def test_exact_ties_go_by_rendezvous_hash_of_the_first_key_whatever_the_order() -> None:
    nodes = [node("n3", 1, 50), node("n1", 1, 50), node("n2", 1, 50)]
    for key in (b"", bytes(16), b"\x01" * 16):
        want = min(("n1", "n2", "n3"), key=lambda n: hashlib.sha1(key + n.encode()).hexdigest())
        assert place(nodes, 2, BLOCK, tie_key=key).node_id == want
        assert place(list(reversed(nodes)), 2, BLOCK, tie_key=key).node_id == want


def test_new_prompts_spread_over_idle_nodes() -> None:
    """Equally loaded nodes caching nothing: distinct first keys go to different nodes
    (not all to the smallest id), and the same key always to the same one."""
    nodes = [node(f"node-{i}", 0, 100) for i in range(4)]
    chosen = [place(nodes, 4, BLOCK, tie_key=i.to_bytes(16, "big")).node_id for i in range(64)]
    assert len(set(chosen)) == 4 and max(chosen.count(n) for n in set(chosen)) < 32
    assert chosen == [place(nodes[::-1], 4, BLOCK, tie_key=i.to_bytes(16, "big")).node_id for i in range(64)]


def test_nothing_fits_raises_capacity_exceeded_naming_the_need() -> None:
    with pytest.raises(CapacityExceeded) as info:
        place([node("n1", 2, free=3), node("n2", 0, free=7)], 10, BLOCK)
    assert (info.value.requested, info.value.available) == (8, 7)
    assert "10-block sequence" in str(info.value)


def test_no_candidates_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no live cache node"):
        place([], 1, BLOCK)


def test_bad_input_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="free_blocks"):
        NodeCandidate("n1", 0, free_blocks=11, total_blocks=10)
    with pytest.raises(InvalidArgument, match="distinct"):
        place([node("n1", 0, 5), node("n1", 0, 5)], 1, BLOCK)
    with pytest.raises(InvalidArgument, match="num_blocks_needed"):
        place([node("n1", 0, 5)], -1, BLOCK)
    with pytest.raises(InvalidArgument, match="load_weight"):
        PlacementWeights(load_weight=float("nan"))


def test_placement_is_a_plain_value() -> None:
    result = place([node("n1", 0, 5)], 0, BLOCK)
    assert result == Placement("n1", 0, 0, 0, {"n1": pytest.approx(-0.95)}, ())
