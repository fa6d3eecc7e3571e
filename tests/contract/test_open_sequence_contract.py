"""Store.open_sequence, the whole open in one call, on every backend (one suite).

Narrated scenarios with exact outcomes: the prefix match it places by, nodes that
are not live, each error with its numbers and with nothing changed, the quota folded
into the same atomic step (never exceeded under threads), and bad input refused
before anything is touched. tests/contract/test_placement_port.py drives random
candidate sets through both backends against placement.place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from pagedkv.coordinator.placement import PlacementWeights, tie_rank
from pagedkv.coordinator.records import Extent, NewSequence, NodeRoom, SequenceExists, SequenceRecord
from pagedkv.coordinator.store import Store, open_store
from pagedkv.protos.errors import (
    CapacityExceeded,
    InvalidArgument,
    QuotaExceeded,
    SequenceNotFound,
    Unavailable,
)

pytestmark = pytest.mark.timeout(60)

SPEC = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype": "float32", "block_size": 16}
BS = 16


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def keys(n: int) -> bytes:
    return b"".join(key(i) for i in range(1, n + 1))


@pytest.fixture(params=["memory", "redis", "cluster"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    urls = {"memory": "memory://", "redis": "redis_url", "cluster": "redis_cluster_url"}
    url = urls[request.param]
    url = url if request.param == "memory" else str(request.getfixturevalue(url))
    s = open_store(url)
    yield s
    s.close()


def register(store: Store, *node_ids: str, ttl_s: float = 30.0) -> None:
    for n in node_ids:
        store.register_node(n, f"{n}.local:50051", SPEC, 100, ttl_s)


def new(seq_id: str = "s1", *, num_keys: int = 6, num_blocks: int = 8, rooms=None, **kw) -> NewSequence:  # type: ignore[no-untyped-def]
    rooms = rooms if rooms is not None else (NodeRoom("n1", 50, 100), NodeRoom("n2", 90, 100))
    kw.setdefault("pending_ttl_ms", 0)  # no in-flight markers, but where a test is about them
    kw.setdefault("weights", PlacementWeights(load_weight=1.0))  # round numbers
    return NewSequence(
        seq_id, kw.pop("tenant", "acme"), num_blocks * BS - 3, num_blocks, BS, keys(num_keys), rooms, **kw
    )


def snapshot(store: Store) -> tuple[object, ...]:
    seqs = {n: [r.seq_id for r in store.sequences_of_node(n)] for n in ("n1", "n2", "n3")}
    return seqs, store.tenant_usage("acme"), store.match_prefix([key(1)])


def test_the_longest_cached_prefix_wins_and_the_page_table_is_written(store: Store) -> None:
    register(store, "n1", "n2")
    store.apply_events("n1", [key(i) for i in (1, 2, 3, 4)], [])  # 4 leading blocks
    store.apply_events("n2", [key(1), key(3), key(4), key(5), key(6)], [])  # a gap after block 1
    # n1 runs 5 blocks more than n2 but saves 3 more blocks of prefill: cost 4 + 19 vs 7 + 17.
    placement = store.open_sequence(new(rooms=(NodeRoom("n1", 85, 100), NodeRoom("n2", 90, 100))))
    assert (placement.node_id, placement.cached_blocks, placement.cached_tokens, placement.new_blocks) == (
        "n1",
        4,
        64,
        4,
    )
    assert placement.scores == {"n1": -(4 + 15 + 4), "n2": -(7 + 10 + 7)}
    assert placement.rejected == ()
    record = store.get_sequence("s1")
    assert (record.tenant, record.extents, record.num_tokens, record.state) == (
        "acme",
        (Extent("n1", 0, 8),),
        8 * BS - 3,
        "active",
    )
    assert [r.seq_id for r in store.sequences_of_node("n1")] == ["s1"]
    assert store.tenant_usage("acme") == 0  # no quota, nothing reserved
    assert store.delete_sequence("s1", tenant="acme") == record
    assert store.sequences_of_node("n1") == []


def test_load_breaks_ties_and_exact_ties_go_by_rendezvous_rank(store: Store) -> None:
    register(store, "n1", "n2", "n3")
    # Nothing cached anywhere: the emptiest nodes win; between equal rooms, the smaller
    # sha1(first key + node id) (placement.tie_rank), whichever order the rooms come in.
    rooms = (NodeRoom("n3", 90, 100), NodeRoom("n2", 90, 100), NodeRoom("n1", 20, 100))

    def winner(first_key: bytes) -> str:
        return min(("n2", "n3"), key=lambda n: tie_rank(first_key, n))

    for first in (1, 2, 3):  # prompts whose first blocks differ
        prompt = b"".join(key(i) for i in range(first, first + 6))
        for i, order in enumerate((rooms, rooms[::-1])):
            opened = store.open_sequence(replace(new(f"t{first}.{i}", rooms=order), keys=prompt))
            assert opened.node_id == winner(key(first))
    assert store.open_sequence(new("a", rooms=rooms)).node_id == winner(key(1))
    # A cached prefix wins when the prefill it saves outweighs the extra load; a heavier load
    # weight makes the idler node win instead.
    store.apply_events("n1", [key(1), key(2)], [])
    rooms = (NodeRoom("n3", 90, 100), NodeRoom("n2", 90, 100), NodeRoom("n1", 85, 100))
    assert store.open_sequence(new("b0", num_keys=2, rooms=rooms)).node_id == winner(key(1))  # 27 vs 26
    prefill = PlacementWeights(overlap_weight=4.0, load_weight=1.0)  # 4 * 6 + 21 = 45 vs 4 * 8 + 18 = 50
    assert store.open_sequence(new("b", num_keys=2, rooms=rooms, weights=prefill)).node_id == "n1"
    heavy = PlacementWeights(overlap_weight=4.0, load_weight=8.0)  # 24 + 168 vs 32 + 144
    assert store.open_sequence(new("c", num_keys=2, rooms=rooms, weights=heavy)).node_id == winner(key(1))


def test_evictable_blocks_are_room_not_load(store: Store) -> None:
    register(store, "n1", "n2")
    # n1: no free block but 90 evictable (idle, full of cache); n2: 30 free, 70 active.
    rooms = (NodeRoom("n1", 0, 100, 90), NodeRoom("n2", 30, 100))
    placement = store.open_sequence(new(rooms=rooms))
    assert (placement.node_id, placement.scores) == ("n1", {"n1": -(8 + 18), "n2": -(8 + 78)})
    with pytest.raises(CapacityExceeded) as err:  # 8 blocks fit in neither 0 + 7 nor 5
        store.open_sequence(new("s2", rooms=(NodeRoom("n1", 0, 100, 7), NodeRoom("n2", 5, 100))))
    assert (err.value.requested, err.value.available) == (8, 7)


def test_concurrent_opens_of_one_uncached_prefix_land_on_one_node(store: Store) -> None:
    register(store, "n1", "n2")
    ttl = {"pending_ttl_ms": 10_000}
    first = store.open_sequence(new("a", rooms=(NodeRoom("n1", 90, 100), NodeRoom("n2", 90, 100)), **ttl))
    other = "n2" if first.node_id == "n1" else "n1"
    # Before n(first) reports the blocks, it looks 5 blocks busier (the coordinator's account):
    # alone that sends the next open elsewhere (8 + 18 vs 8 + 23), but the first open is
    # bringing all 6 keys there, so 2 + 23 < 26 and the second open follows it.
    rooms = (NodeRoom(first.node_id, 85, 100), NodeRoom(other, 90, 100))
    second = store.open_sequence(new("b", rooms=rooms, **ttl))
    assert (second.node_id, second.cached_blocks, second.pending_blocks) == (first.node_id, 0, 6)
    # Once the first open's node reports the keys stored, they count as cached and the marker goes.
    store.apply_events(first.node_id, [key(i) for i in range(1, 7)], [])
    third = store.open_sequence(new("b2", rooms=rooms, **ttl))
    assert (third.node_id, third.cached_blocks, third.pending_blocks) == (first.node_id, 6, 0)
    store.apply_events(first.node_id, [], [key(1)])  # evicted: no stale marker steers the next open
    assert store.open_sequence(new("b3", rooms=rooms, **ttl)).pending_blocks == 0
    # Without a marker (pending_ttl_ms=0, or once it lapsed) the load decides.
    fresh = replace(new("d", rooms=rooms, pending_ttl_ms=0), keys=b"".join(key(i) for i in range(40, 46)))
    assert store.open_sequence(fresh).pending_blocks == 0
    assert store.open_sequence(replace(fresh, seq_id="e")).node_id == other
    brief = replace(new("f", pending_ttl_ms=30, rooms=rooms), keys=b"".join(key(i) for i in range(50, 56)))
    assert store.open_sequence(brief).node_id == other
    time.sleep(0.25)
    rooms2 = (NodeRoom(first.node_id, 90, 100), NodeRoom(other, 85, 100))
    assert store.open_sequence(replace(brief, seq_id="g", candidates=rooms2)).pending_blocks == 0


def test_candidates_that_are_not_live_are_skipped(store: Store) -> None:
    register(store, "n1")
    register(store, "n2", ttl_s=0.2)
    store.apply_events("n2", [key(i) for i in range(1, 7)], [])
    deadline = time.monotonic() + 3
    while store.expired_nodes() != ["n2"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    rooms = (NodeRoom("n1", 50, 100), NodeRoom("n2", 90, 100), NodeRoom("ghost", 100, 100))
    placement = store.open_sequence(new(rooms=rooms))
    assert (placement.node_id, placement.cached_blocks, set(placement.scores)) == ("n1", 0, {"n1"})
    # Only candidates the caller names count, even if other nodes are live.
    before = snapshot(store)
    with pytest.raises(Unavailable, match="no live cache node"):
        store.open_sequence(new("s2", rooms=(NodeRoom("n2", 90, 100), NodeRoom("ghost", 9, 9))))
    with pytest.raises(Unavailable):
        store.open_sequence(new("s2", rooms=()))
    assert snapshot(store) == before
    with pytest.raises(Exception, match="s2"):
        store.get_sequence("s2")


def test_no_room_raises_capacity_exceeded_with_the_numbers_and_changes_nothing(store: Store) -> None:
    register(store, "n1", "n2")
    store.apply_events("n1", [key(1), key(2), key(3)], [])
    rooms = (NodeRoom("n1", 4, 100), NodeRoom("n2", 6, 100))  # n1 needs 5 new, n2 needs 8
    before = snapshot(store)
    with pytest.raises(CapacityExceeded) as err:
        store.open_sequence(new(rooms=rooms))
    assert (err.value.requested, err.value.available) == (5, 6)
    assert "8-block sequence" in str(err.value)
    assert snapshot(store) == before
    # One more free block on n1 and it fits there; n2 is listed as rejected.
    placement = store.open_sequence(new(rooms=(NodeRoom("n1", 5, 100), NodeRoom("n2", 6, 100))))
    assert (placement.node_id, placement.new_blocks, placement.rejected) == ("n1", 5, ("n2",))


def test_the_quota_is_reserved_in_the_same_step(store: Store) -> None:
    register(store, "n1", "n2")
    store.reserve_blocks("acme", 5, 100)
    store.open_sequence(new("a", quota=13))  # 5 + 8 = 13: exactly at the quota
    assert store.tenant_usage("acme") == 13
    before = snapshot(store)
    with pytest.raises(QuotaExceeded) as err:
        store.open_sequence(new("b", quota=13))
    assert (err.value.tenant, err.value.requested, err.value.quota, err.value.used) == ("acme", 8, 13, 13)
    assert snapshot(store) == before
    # Another tenant's usage is its own; the closer releases what the open reserved.
    store.open_sequence(new("c", quota=8, tenant="other"))
    assert (store.tenant_usage("other"), store.tenant_usage("acme")) == (8, 13)
    store.delete_sequence("a")
    assert store.release_blocks("acme", 8) == 5


def test_a_taken_id_raises_sequence_exists_and_reserves_nothing(store: Store) -> None:
    register(store, "n1", "n2")
    store.open_sequence(new(quota=100))
    before = snapshot(store), store.get_sequence("s1")
    with pytest.raises(SequenceExists, match="s1"):
        store.open_sequence(new(quota=100, rooms=(NodeRoom("n2", 90, 100),)))
    assert (snapshot(store), store.get_sequence("s1")) == before
    assert store.tenant_usage("acme") == 8


def test_errors_are_checked_in_order_placement_quota_id(store: Store) -> None:
    register(store, "n1")
    store.open_sequence(new())
    with pytest.raises(CapacityExceeded):  # no room beats an over-quota tenant and a taken id
        store.open_sequence(new(quota=0, rooms=(NodeRoom("n1", 0, 100),)))
    with pytest.raises(QuotaExceeded):  # over quota beats a taken id
        store.open_sequence(new(quota=0))


def test_a_removed_nodes_keys_no_longer_count(store: Store) -> None:
    register(store, "n1", "n2")
    store.apply_events("n1", [key(i) for i in range(1, 7)], [])
    store.apply_events("n2", [key(1)], [])
    store.remove_node("n1")
    placement = store.open_sequence(new(rooms=(NodeRoom("n1", 100, 100), NodeRoom("n2", 50, 100))))
    assert (placement.node_id, placement.cached_blocks) == ("n2", 1)


def test_more_keys_than_one_script_slice(store: Store) -> None:
    register(store, "n1", "n2")
    n = 4500
    store.apply_events("n1", [key(i) for i in range(1, n + 1)], [])
    store.apply_events("n2", [key(i) for i in range(1, 4200)], [])
    placement = store.open_sequence(new(num_keys=n, num_blocks=n + 1))
    assert (placement.node_id, placement.cached_blocks, placement.new_blocks) == ("n1", n, 1)


def test_the_quota_is_never_exceeded_under_16_threads(store: Store) -> None:
    register(store, "n1", "n2")
    opened, refused = [], []

    def worker(i: int) -> None:
        try:
            store.open_sequence(new(f"t{i}", num_blocks=3, quota=20))
            opened.append(i)
        except QuotaExceeded:
            refused.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(opened), len(refused)) == (6, 10)
    assert store.tenant_usage("acme") == 18
    linked = [r.seq_id for n in ("n1", "n2") for r in store.sequences_of_node(n)]
    assert sorted(linked) == sorted(f"t{i}" for i in opened)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"keys": b"x" * 17}, "16-byte"),
        ({"keys": [key(1)]}, "16-byte"),
        ({"candidates": (NodeRoom("n1", 5, 4),)}, "free_blocks 5 \\+ evictable_blocks 0 > total_blocks 4"),
        ({"candidates": (NodeRoom("n1", 1, 4), NodeRoom("n1", 2, 4))}, "distinct"),
        ({"candidates": (("n1", 1),)}, "candidate"),
        ({"candidates": (NodeRoom("", 1, 4),)}, "node_id"),
        ({"candidates": (NodeRoom("n1", -1, 4),)}, "free_blocks"),
        ({"quota": -1}, "quota"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": -2}, "num_blocks"),
        ({"seq_id": ""}, "seq_id"),
        ({"weights": (1.0, 1.0)}, "weights"),
    ],
)
def test_bad_input_is_refused_before_any_store_sees_it(fields: dict[str, object], match: str) -> None:
    good = {
        "seq_id": "s1",
        "tenant": "acme",
        "num_tokens": 5,
        "num_blocks": 1,
        "block_size": BS,
        "keys": key(1),
        "candidates": (NodeRoom("n1", 1, 4),),
    }
    with pytest.raises(InvalidArgument, match=match):
        NewSequence(**{**good, **fields})  # type: ignore[arg-type]


def test_candidates_are_normalised_to_node_id_order(store: Store) -> None:
    request = new(rooms=(NodeRoom("n2", 1, 2), ("n1", 1, 2)))
    assert request.candidates == (NodeRoom("n1", 1, 2), NodeRoom("n2", 1, 2))
    with pytest.raises(InvalidArgument, match="NewSequence"):
        store.open_sequence("s1")  # type: ignore[arg-type]


def test_offloaded_keys_stay_held_on_the_host_tier_until_stored_again(store: Store) -> None:
    register(store, "n1", "n2")
    rooms = (NodeRoom("n1", 90, 100), NodeRoom("n2", 90, 100))
    w = PlacementWeights(load_weight=0.0, host_weight=0.5)
    # n1: blocks 1-2 on its device, 3-5 on its host tier, 6 on its device again (not reached:
    # a node serves its device run, then the host run that continues it).
    store.apply_events("n1", [key(1), key(2), key(6)], [], [key(3), key(4), key(5)])
    assert store.match_prefix([key(i) for i in range(1, 7)]) == {"n1": 6, "n2": 0}  # held, either tier
    placement = store.open_sequence(new("a", rooms=rooms, weights=w))
    assert (placement.node_id, placement.cached_blocks, placement.host_blocks) == ("n1", 5, 3)
    assert placement.scores["n1"] == -(3 + 0.5 * 3)
    # Block 3 comes back to the device (a promotion stores it again), block 5 leaves the node.
    store.apply_events("n1", [key(3)], [key(5)])
    placement = store.open_sequence(new("b", rooms=rooms, weights=w))
    assert (placement.cached_blocks, placement.host_blocks) == (4, 1)
    # A key in two lists of one batch is refused, changing nothing.
    with pytest.raises(InvalidArgument, match="in two of"):
        store.apply_events("n1", [key(7)], [], [key(7)])
    assert store.match_prefix([key(i) for i in range(1, 8)])["n1"] == 4
    # Re-registering (the node restarted) forgets its host tier too.
    store.register_node("n1", "n1.local:50051", SPEC, 100, 30.0)
    store.apply_events("n1", [key(1), key(2), key(3), key(4)], [])
    assert store.open_sequence(new("c", rooms=rooms, weights=w)).host_blocks == 0


def test_the_policy_a_node_registers_with_is_listed(store: Store) -> None:
    store.register_node("n1", "n1.local:50051", SPEC, 100, 30.0, policy="slru")
    store.register_node("n2", "n2.local:50051", SPEC, 100, 30.0)
    assert [(n.node_id, n.policy) for n in store.live_nodes()] == [("n1", "slru"), ("n2", "")]
    with pytest.raises(InvalidArgument, match="policy"):
        store.register_node("n3", "n3.local:50051", SPEC, 100, 30.0, policy="x" * 65)


def test_active_blocks_are_the_load_and_scans_take_the_fixed_order(store: Store) -> None:
    register(store, "n1", "n2", "n3")
    # Reports say all idle; the coordinator counts 40 / 0 / 10 blocks of its own open: n2 wins.
    rooms = (
        NodeRoom("n1", 100, 100, 0, 0.0, 40),
        NodeRoom("n2", 100, 100, 0, 0.0, 0),
        NodeRoom("n3", 100, 100, 0, 0.0, 10),
    )
    placement = store.open_sequence(new("a", rooms=rooms))
    assert (placement.node_id, placement.is_scan) == ("n2", False)
    # The same 8-block prompt as a scan (class 4: 8-15 blocks) goes to the first node in the
    # scan order whatever the load.
    first = min(("n1", "n2", "n3"), key=lambda n: tie_rank(b"pagedkv:scan", n))
    placement = store.open_sequence(new("b", rooms=rooms, scan_classes=1 << 4))
    assert (placement.node_id, placement.is_scan) == (first, True)


def test_a_host_run_longer_than_one_script_slice(store: Store) -> None:
    register(store, "n1")
    many = [key(i) for i in range(1, 9_002)]  # 9,001 blocks: more than Lua's unpack() takes at once
    store.apply_events("n1", many[:10], [], many[10:])
    blob = b"".join(many)
    rooms = (NodeRoom("n1", 100_000, 100_000),)
    new_seq = NewSequence("long", "acme", 9_002 * BS, 9_002, BS, blob, rooms, pending_ttl_ms=0)
    placement = store.open_sequence(new_seq)
    assert (placement.cached_blocks, placement.host_blocks) == (9_001, 8_991)


def test_scaled_recent_opens_place_as_their_counts(store: Store) -> None:
    """recent_opens / opens_scale is the count the balance bound sees (the coordinator sends
    its counts scaled so that a decay changes no row)."""
    register(store, "n1", "n2")
    store.apply_events("n1", [key(i) for i in range(1, 7)], [])
    # Within the bound by its counts (3 + 1 <= fair 2 + margin 4), over it by the raw values.
    w = PlacementWeights(balance_slack=0.0, balance_margin=4.0, affinity_share=2.0)
    plain = (NodeRoom("n1", 50, 100, 0, 3.0, 0), NodeRoom("n2", 50, 100, 0, 0.0, 0))
    scaled = tuple(r._replace(recent_opens=r.recent_opens * 1e30) for r in plain)
    first = store.open_sequence(new("s1", rooms=plain, weights=w))
    second = store.open_sequence(new("s2", rooms=scaled, weights=w, opens_scale=1e30))
    assert first.node_id == second.node_id == "n1"  # the holder, within its share
    assert first.scores == second.scores
    with pytest.raises(InvalidArgument, match="opens_scale"):
        new("s3", opens_scale=0.0)


def test_opens_sent_together_answer_each_as_alone(store: Store) -> None:
    """open_sequences (a coordinator's turn of opens, pipelined on Redis): each its own answer,
    in order, as open_sequence one after the other; an error changes nothing of the others."""
    register(store, "n1", "n2")
    store.apply_events("n1", [key(1), key(2), key(3)], [])
    store.open_sequence(new("taken", num_keys=0))
    batch = [
        new("a", rooms=(NodeRoom("n1", 90, 100), NodeRoom("n2", 90, 100))),  # n1 holds 3 of its keys
        new("taken"),  # SequenceExists
        new("big", num_blocks=200),  # no node has room: CapacityExceeded
        new("q", quota=3),  # over its quota
        new("b", num_keys=0, tenant="other"),
        new("a"),  # the first of the batch took the id
    ]
    out = store.open_sequences(batch)
    assert [type(o).__name__ for o in out] == [
        "Placement",
        "SequenceExists",
        "CapacityExceeded",
        "QuotaExceeded",
        "Placement",
        "SequenceExists",
    ]
    a, b = out[0], out[4]
    assert not isinstance(a, Exception) and (a.node_id, a.cached_blocks) == ("n1", 3)
    assert not isinstance(b, Exception) and b.cached_blocks == 0
    assert store.get_sequence("a").extents == (Extent("n1", 0, 8),)
    assert store.get_sequence("b").tenant == "other"
    with pytest.raises(SequenceNotFound):
        store.get_sequence("big")
    assert store.tenant_usage("acme") == 0  # the refused quota reserved nothing
    assert store.open_sequences([]) == []


def test_deletes_sent_together_answer_each_as_alone(store: Store) -> None:
    register(store, "n1", "n2")
    for seq_id, tenant in (("a", "acme"), ("b", "acme"), ("c", "other")):
        store.open_sequence(new(seq_id, num_keys=0, tenant=tenant))
    out = store.delete_sequences(
        [
            ("a", "acme", False),
            ("absent", "acme", False),
            ("c", "acme", False),
            ("b", None, True),
            ("a", None, False),
        ]
    )
    assert [type(o).__name__ for o in out] == [
        "SequenceRecord",
        "SequenceNotFound",
        "PermissionDenied",
        "SequenceRecord",
        "SequenceNotFound",  # the first of the batch deleted it
    ]
    assert [o.seq_id for o in out if isinstance(o, SequenceRecord)] == ["a", "b"]
    assert store.get_sequence("c").tenant == "other"  # another tenant's close changed nothing
    assert store.sequences_of_node("n1") + store.sequences_of_node("n2") == [store.get_sequence("c")]
