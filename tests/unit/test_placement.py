"""place(): narrated scenarios with exact choices (no store, no network). The rule (placement.py):
cost = overlap_weight * (new - pending) + load_weight * (active + new), lowest wins, among the
nodes within the balance bound first."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest

from pagedkv.coordinator.placement import NodeCandidate, Placement, PlacementWeights, place
from pagedkv.protos.errors import CapacityExceeded, InvalidArgument, Unavailable

BLOCK = 16
LW1 = PlacementWeights(load_weight=1.0, balance_slack=0.1, balance_margin=1.0)  # round numbers, a tight bound


def node(
    node_id: str, cached: int, free: int, total: int = 100, evictable: int = 0, pending: int = 0
) -> NodeCandidate:
    return NodeCandidate(node_id, cached, free, total, evictable, pending)


def test_a_conversation_follows_its_history_unless_that_node_is_much_busier() -> None:
    # n1 holds 40 of the 50 prompt blocks and runs 30 blocks more than n2.
    result = place([node("n1", cached=40, free=60), node("n2", cached=0, free=90)], 50, BLOCK, LW1)
    assert (result.node_id, result.cached_blocks, result.cached_tokens, result.new_blocks) == (
        "n1",
        40,
        640,
        10,
    )
    assert result.scores == {"n1": -(10 + 50), "n2": -(50 + 60)}
    # Busier by more than the history saves (195 blocks vs 40): the history is recomputed elsewhere.
    assert (
        place([node("n1", 40, free=0, total=200), node("n2", 0, free=195, total=200)], 50, BLOCK, LW1).node_id
        == "n2"
    )


def test_a_shared_system_prompt_does_not_herd_every_request_onto_its_node() -> None:
    # Only n1 holds the 4-block system prompt; once it runs 8 blocks more than n2, n2 gets the
    # request (and computes the prompt: from then on both hold it).
    system_only = [node("n1", cached=4, free=60), node("n2", cached=0, free=68)]
    assert place(system_only, 10, BLOCK, LW1).node_id == "n2"
    assert place([node("n1", 4, free=60), node("n2", 0, free=62)], 10, BLOCK, LW1).node_id == "n1"


def test_the_balance_bound_moves_small_gains_off_a_node_far_above_its_fair_share_of_opens() -> None:
    # n1 holds 4 of the 10 blocks and by cost wins (10 * 6 + 16 vs 10 * 10 + 10), but it took 9
    # of the last 10 opens: its fair share of 11 is 5.5, the bound 1.1 * 5.5 + 1 = 7.05 < 10.
    heavy = PlacementWeights(overlap_weight=10.0, load_weight=1.0, balance_slack=0.1, balance_margin=1.0)
    nodes = [
        NodeCandidate("n1", 4, 90, 100, recent_opens=9.0),
        NodeCandidate("n2", 0, 100, 100, recent_opens=1.0),
    ]
    result = place(nodes, 10, BLOCK, heavy)
    assert (result.node_id, result.scores) == ("n2", {"n1": -76.0, "n2": -110.0})
    assert place(nodes, 10, BLOCK, PlacementWeights(10.0, 1.0, math.inf)).node_id == "n1"  # no bound
    # Within the bound (6 of 10: 7 <= 7.05) the cost decides.
    within = [replace(nodes[0], recent_opens=6.0), replace(nodes[1], recent_opens=4.0)]
    assert place(within, 10, BLOCK, heavy).node_id == "n1"
    # Between the bound and twice its slack (6.5 of 10: 7.05 < 7.5 <= 7.6) a prompt the node
    # holds half of (a conversation's next turn) may still go there; one it holds less of may not.
    near = [replace(nodes[0], recent_opens=6.5), replace(nodes[1], recent_opens=3.5)]
    assert place(near, 10, BLOCK, heavy).node_id == "n2"
    history = [replace(near[0], cached_blocks=5), near[1]]
    assert place(history, 10, BLOCK, heavy).node_id == "n1"
    assert (
        place(
            history,
            10,
            BLOCK,
            PlacementWeights(10.0, 1.0, affinity_share=0.6, balance_slack=0.1, balance_margin=1.0),
        ).node_id
        == "n2"
    )
    # Beyond twice the slack (9 of 10) not even a conversation's history keeps it there.
    assert place([replace(nodes[0], cached_blocks=5), nodes[1]], 10, BLOCK, heavy).node_id == "n2"
    # Fair shares follow node size: with 5 opens each, the small node (a third of the blocks) is
    # over its share (6 > 1.1 * 11 / 3 + 1) and the big one within it, though only the small one caches.
    sized = [
        NodeCandidate("big", 0, 200, 200, recent_opens=5.0),
        NodeCandidate("small", 1, 100, 100, recent_opens=5.0),
    ]
    assert place(sized, 4, BLOCK, LW1).node_id == "big"
    equal = [replace(sized[0], total_blocks=100, free_blocks=100), sized[1]]
    assert place(equal, 4, BLOCK, LW1).node_id == "small"


def test_evictable_cache_is_room_but_not_load() -> None:
    # n1 is full of cache nobody holds (idle); n2 has free blocks but runs 90 blocks.
    nodes = [node("n1", 0, free=0, evictable=90), node("n2", 0, free=10)]
    result = place(nodes, 5, BLOCK, LW1)
    assert result.node_id == "n1" and result.scores == {"n1": -(5 + 15), "n2": -(5 + 95)}
    assert node("n1", 0, free=0, evictable=90).load_blocks == 10


def test_an_open_in_flight_steers_a_second_open_of_the_same_prefix_to_its_node() -> None:
    # Neither node holds the prompt yet; an open placed on n2 a moment ago is computing 8 of it.
    nodes = [node("n1", 0, free=100), node("n2", 0, free=92, pending=8)]
    result = place(nodes, 10, BLOCK, LW1)
    assert (result.node_id, result.cached_blocks, result.pending_blocks) == ("n2", 0, 8)


def test_a_node_without_room_for_its_uncached_remainder_is_never_chosen() -> None:
    # n1 caches 2 of 12 blocks but has only 5 of room (needs 10); n2 has room.
    result = place([node("n1", 2, free=3, evictable=2), node("n2", 0, free=12)], 12, BLOCK, LW1)
    assert result.node_id == "n2"
    assert result.rejected == ("n1",)
    assert set(result.scores) == {"n2"}


def test_a_full_cached_prefix_needs_no_room_and_caps_at_the_need() -> None:
    result = place(
        [node("n1", 5, free=0, total=10), node("n2", 0, free=50)], 5, BLOCK, PlacementWeights(2.0, 1.0)
    )
    assert (result.node_id, result.new_blocks, result.cached_tokens) == ("n1", 0, 80)
    assert place([node("n1", 9, free=0)], 3, BLOCK, LW1).new_blocks == 0


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
        place([node("n1", 2, free=3), node("n2", 0, free=4, evictable=3)], 10, BLOCK, LW1)
    assert (info.value.requested, info.value.available) == (8, 7)
    assert "10-block sequence" in str(info.value)


def test_no_candidates_is_unavailable() -> None:
    with pytest.raises(Unavailable, match="no live cache node"):
        place([], 1, BLOCK, LW1)


def test_bad_input_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="free_blocks"):
        NodeCandidate("n1", 0, free_blocks=6, total_blocks=10, evictable_blocks=5)
    with pytest.raises(InvalidArgument, match="pending_blocks"):
        NodeCandidate("n1", 0, 1, 10, pending_blocks=-1)
    with pytest.raises(InvalidArgument, match="distinct"):
        place([node("n1", 0, 5), node("n1", 0, 5)], 1, BLOCK, LW1)
    with pytest.raises(InvalidArgument, match="num_blocks_needed"):
        place([node("n1", 0, 5)], -1, BLOCK, LW1)
    with pytest.raises(InvalidArgument, match="load_weight"):
        PlacementWeights(load_weight=float("nan"))
    with pytest.raises(InvalidArgument, match="balance_slack"):
        PlacementWeights(balance_slack=-0.5)


def test_placement_is_a_plain_value() -> None:
    result = place([node("n1", 0, 5)], 0, BLOCK, LW1)
    assert result == Placement("n1", 0, 0, 0, {"n1": -95.0}, ())


def test_load_is_the_coordinators_count_of_running_blocks_when_given() -> None:
    # n1's last report says it is idle (all room), but the coordinator has 60 blocks of its own
    # sequences open there since: n2 (20 open) wins a cold prompt, though its report says busier.
    n1 = NodeCandidate("n1", 0, free_blocks=100, total_blocks=100, active_blocks=60)
    n2 = NodeCandidate("n2", 0, free_blocks=50, total_blocks=100, active_blocks=20)
    result = place([n1, n2], 5, BLOCK, LW1)
    assert (result.node_id, result.scores) == ("n2", {"n1": -(5 + 65), "n2": -(5 + 25)})
    assert n1.load_blocks == 60 and replace(n1, active_blocks=None).load_blocks == 0
    with pytest.raises(InvalidArgument, match="active_blocks"):
        NodeCandidate("n1", 0, 1, 10, active_blocks=-1)


def test_a_host_tier_hit_is_priced_between_a_device_hit_and_a_recompute() -> None:
    # 10 blocks: n1 holds 8 on its device, n2 holds 8 with the last 6 on its host tier, n3 none.
    w = PlacementWeights(load_weight=0.0, host_weight=0.25, balance_slack=math.inf)
    n1 = NodeCandidate("n1", 8, 100, 100)
    n2 = NodeCandidate("n2", 8, 100, 100, host_blocks=6)
    n3 = NodeCandidate("n3", 0, 100, 100)
    result = place([n1, n2, n3], 10, BLOCK, w)
    assert (result.node_id, result.host_blocks) == ("n1", 0)
    assert result.scores == {"n1": -2.0, "n2": -(2 + 0.25 * 6), "n3": -10.0}
    result = place([n2, n3], 10, BLOCK, w)
    assert (result.node_id, result.cached_blocks, result.host_blocks, result.new_blocks) == ("n2", 8, 6, 2)
    # A copy back takes a device block like a new one: 2 new + 6 copied do not fit in 7 of room.
    assert place([replace(n2, free_blocks=7), n3], 10, BLOCK, w).rejected == ("n2",)
    # Cut at the need: 5 blocks wanted, the first 2 on n2's device, so 3 of its host blocks count.
    assert place([n2], 5, BLOCK, w).host_blocks == 3
    with pytest.raises(InvalidArgument, match="host_blocks"):
        NodeCandidate("n1", 2, 10, 10, host_blocks=3)


def test_scans_go_to_one_node_in_a_fixed_order_until_it_is_over_its_share() -> None:
    # Three idle nodes; a 40-block prompt none of them holds (size class 6: 32-63 blocks).
    nodes = [NodeCandidate(f"n{i}", 0, 100, 100, recent_opens=4.0) for i in range(3)]
    order = sorted(("n0", "n1", "n2"), key=lambda n: hashlib.sha1(b"pagedkv:scan" + n.encode()).hexdigest())
    scans = 1 << 6
    for key in (b"", bytes(16), b"\x07" * 16):  # whatever its first key, the same node
        result = place(nodes, 40, BLOCK, LW1, tie_key=key, scan_classes=scans)
        assert (result.node_id, result.is_scan) == (order[0], True)
    assert not place(nodes, 40, BLOCK, LW1, scan_classes=1 << 5).is_scan  # another class
    # The first scan node over its share of recent opens: the next one in the order.
    busy = [replace(n, recent_opens=9.0) if n.node_id == order[0] else n for n in nodes]
    assert place(busy, 40, BLOCK, LW1, scan_classes=scans).node_id == order[1]
    # The class is that of the fewest uncached blocks on any node: 36 of 40 cached on n2 leaves
    # 4 (class 3), not a scan, and the prompt goes where it is cached.
    cached = [replace(n, cached_blocks=36) if n.node_id == "n2" else n for n in nodes]
    result = place(cached, 40, BLOCK, LW1, scan_classes=scans)
    assert (result.node_id, result.is_scan) == ("n2", False)
    with pytest.raises(InvalidArgument, match="scan_classes"):
        place(nodes, 4, BLOCK, scan_classes=-1)


def test_a_node_that_comes_back_empty_takes_opens_until_its_share_is_fair() -> None:
    # n1 and n2 hold every prompt (a conversation's history: 30 of 32 blocks) and took the
    # recent opens; n3 restarted empty. While n1 and n2 are over twice the slack, n3 gets the
    # opens (and recomputes); the others keep their conversations once back within it.
    w = PlacementWeights(balance_slack=0.05, balance_margin=1.0)
    old = [NodeCandidate(n, 30, 50, 100, recent_opens=30.0) for n in ("n1", "n2")]
    back = NodeCandidate("n3", 0, 100, 100, recent_opens=0.0)
    assert place([*old, back], 32, BLOCK, w).node_id == "n3"
    even = [replace(c, recent_opens=20.0) for c in old] + [replace(back, recent_opens=20.0)]
    assert place(even, 32, BLOCK, w).node_id in ("n1", "n2")


def test_the_node_holding_more_is_named_when_another_is_chosen() -> None:
    # n2 and n3 hold 5 of 40 blocks but have no room for the other 35; n1 (holding 2) gets it,
    # and the placement names the first of the two (by id) as holding more (a miss's reason).
    nodes = [node("n3", 5, free=10), node("n1", 2, free=90), node("n2", 5, free=0)]
    result = place(nodes, 40, BLOCK, LW1)
    assert (result.node_id, result.rejected) == ("n1", ("n2", "n3"))
    assert (result.cached_elsewhere_blocks, result.cached_elsewhere_node_id) == (5, "n2")
