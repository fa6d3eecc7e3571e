"""One Store contract suite, run against every backend (tooz style: built from a URL).

Exact outcomes: every method, its errors, TTL expiry (short TTLs, bounded waits),
index exactness against a Python shadow under thousands of seeded random events,
and atomicity of salts and quotas under threads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator

import pytest

from pagedkv.coordinator.records import (
    Extent,
    NodeInfo,
    NodeNotLive,
    PurgeResult,
    SequenceExists,
    SequenceRecord,
)
from pagedkv.coordinator.store import Store, open_store
from pagedkv.protos.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    SequenceNotFound,
)

pytestmark = pytest.mark.timeout(60)

SPEC = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "dtype": "float32", "block_size": 16}
TTL_S = 30.0  # long enough never to lapse during a test, unless the test wants it to
SHORT_TTL_S = 0.3


def key(i: int) -> bytes:
    return i.to_bytes(16, "big")


@pytest.fixture(params=["memory", "redis", "cluster"])
def store_url(request: pytest.FixtureRequest) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "cluster":  # a real 3-master Redis Cluster (tests/contract/conftest.py)
        return str(request.getfixturevalue("redis_cluster_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def store(store_url: str) -> Iterator[Store]:
    s = open_store(store_url)
    yield s
    s.close()


def register(store: Store, *node_ids: str, ttl_s: float = TTL_S) -> None:
    for n in node_ids:
        store.register_node(n, f"{n}.local:50051", SPEC, 1000, ttl_s)


def wait_until(predicate, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def seq(seq_id: str, *extents: tuple[str, int, int], tenant: str = "acme", **kw) -> SequenceRecord:
    return SequenceRecord(seq_id, tenant, tuple(Extent(*e) for e in extents), **kw)


# ---- membership -------------------------------------------------------------------------------


def test_register_then_live_with_spec_address_and_empty_load(store: Store) -> None:
    first = store.register_node("n1", "n1.local:50051", SPEC, 1000, TTL_S)
    assert first == PurgeResult("n1", False, 0, ())
    assert store.live_nodes() == [NodeInfo("n1", "n1.local:50051", SPEC, 1000, {})]
    assert store.expired_nodes() == []


def test_listing_again_shows_each_change_since_the_last(store: Store) -> None:
    """live_nodes keeps what it parsed for rows that did not change (a reaper tick lists every
    node): a new load, a new registration and a removal each show in the next listing."""
    register(store, "n1", "n2")
    before = store.live_nodes()
    assert store.live_nodes() == before
    store.heartbeat("n1", {"free_blocks": 7}, TTL_S)
    assert [(n.node_id, n.load) for n in store.live_nodes()] == [("n1", {"free_blocks": 7}), ("n2", {})]
    store.heartbeat("n1", {"free_blocks": 6}, TTL_S)
    assert store.live_nodes()[0].load == {"free_blocks": 6}
    store.register_node("n2", "n2.moved:1", {**SPEC, "model": "m2"}, 3, TTL_S, policy="lfu")
    assert store.live_nodes()[1] == NodeInfo("n2", "n2.moved:1", {**SPEC, "model": "m2"}, 3, {}, "lfu")
    store.remove_node("n1")
    assert [n.node_id for n in store.live_nodes()] == ["n2"]


def test_heartbeat_records_load_and_unknown_node_gets_false(store: Store) -> None:
    register(store, "n2", "n1")
    load = {"free_blocks": 900, "used_blocks": 100, "num_sequences": 3}
    assert store.heartbeat("n1", load, TTL_S) is True
    assert [(n.node_id, n.load) for n in store.live_nodes()] == [("n1", load), ("n2", {})]
    assert store.heartbeat("ghost", load, TTL_S) is False
    assert [n.node_id for n in store.live_nodes()] == ["n1", "n2"]


def test_heartbeat_rejects_bad_load(store: Store) -> None:
    register(store, "n1")
    with pytest.raises(InvalidArgument, match="free_blocks"):
        store.heartbeat("n1", {"free_blocks": -1}, TTL_S)
    with pytest.raises(InvalidArgument, match="ttl_s"):
        store.heartbeat("n1", {}, 0)


def test_heartbeats_answer_each_as_heartbeat_would_and_check_all_first(store: Store) -> None:
    """Several beats in one call (a framed loop's turn): each renews and records its load as
    heartbeat does, an unknown node's answers False; one bad load refuses the call before any
    beat in it changes anything."""
    register(store, "n1", "n2")
    beats = [("n1", {"free_blocks": 5}), ("ghost", {"free_blocks": 1}), ("n2", {"free_blocks": 7})]
    assert store.heartbeats(beats, TTL_S) == [True, False, True]
    assert [(n.node_id, n.load) for n in store.live_nodes()] == [
        ("n1", {"free_blocks": 5}),
        ("n2", {"free_blocks": 7}),
    ]
    with pytest.raises(InvalidArgument, match="free_blocks"):
        store.heartbeats([("n1", {"free_blocks": 9}), ("n2", {"free_blocks": -1})], TTL_S)
    assert store.live_nodes()[0].load == {"free_blocks": 5}
    assert store.heartbeats([], TTL_S) == []


def test_a_beat_that_repeats_its_load_is_checked_and_kept_as_the_first(store: Store) -> None:
    """The stores keep a node's last load with its encoding (an idle node's beats repeat it):
    a repeat renews and keeps it; a changed load is recorded; a load equal to a kept one but
    not valid (a bool for a count, a negative count) is refused as it always was."""
    register(store, "n1", "n2")
    load = {"free_blocks": 5, "used_blocks": 1}
    for _ in range(3):
        assert store.heartbeats([("n1", dict(load)), ("n2", load)], TTL_S) == [True, True]
    assert [n.load for n in store.live_nodes()] == [load, load]
    for bad in ({"free_blocks": 5, "used_blocks": True}, {"free_blocks": 5, "used_blocks": -1}):
        with pytest.raises(InvalidArgument, match="used_blocks"):
            store.heartbeats([("n1", bad)], TTL_S)
    assert store.heartbeat("n1", {"free_blocks": 4, "used_blocks": 2}, TTL_S) is True
    assert store.heartbeat("n1", load, TTL_S) is True  # back to a load seen before
    assert [n.load for n in store.live_nodes()] == [load, load]
    assert store.heartbeat("ghost", load, TTL_S) is False


def test_ttl_lapses_without_heartbeat_and_node_must_reregister(store: Store) -> None:
    register(store, "n1", ttl_s=SHORT_TTL_S)
    register(store, "n2")
    store.apply_events("n1", [key(1)], [])
    assert store.match_prefix([key(1)]) == {"n1": 1, "n2": 0}
    wait_until(lambda: store.expired_nodes() == ["n1"])
    assert [n.node_id for n in store.live_nodes()] == ["n2"]
    assert store.match_prefix([key(1)]) == {"n2": 0}  # expired nodes are never candidates
    with pytest.raises(NodeNotLive, match="n1"):
        store.apply_events("n1", [key(2)], [])
    assert store.keys_of("n1") == {key(1)}  # unchanged until removed / re-registered
    # A lapse makes a suspect, not a corpse: a late beat before any removal revives it, keys intact.
    assert store.heartbeat("n1", {}, TTL_S) is True
    assert store.expired_nodes() == [] and store.match_prefix([key(1)]) == {"n1": 1, "n2": 0}
    register(store, "n3", ttl_s=SHORT_TTL_S)
    wait_until(lambda: store.expired_nodes() == ["n3"])
    assert store.remove_node("n3", require_expired=True).was_registered
    assert store.heartbeat("n3", {}, TTL_S) is False  # removed: it must register again
    assert store.register_node("n1", "n1.local:50051", SPEC, 1000, TTL_S).num_keys_purged == 1
    assert store.expired_nodes() == []


def test_beating_at_half_the_ttl_keeps_a_node_live(store: Store) -> None:
    register(store, "n1", ttl_s=SHORT_TTL_S)
    deadline = time.monotonic() + 3 * SHORT_TTL_S
    while time.monotonic() < deadline:
        assert store.heartbeat("n1", {"free_blocks": 1}, SHORT_TTL_S) is True
        assert [n.node_id for n in store.live_nodes()] == ["n1"]
        time.sleep(SHORT_TTL_S / 2)


def test_reregistered_node_comes_back_empty(store: Store) -> None:
    register(store, "n1", "n2")
    store.apply_events("n1", [key(1), key(2)], [])
    store.apply_events("n2", [key(1)], [])
    store.create_sequence(seq("s1", ("n1", 0, 2)))
    store.create_sequence(seq("s2", ("n2", 0, 1)))
    store.heartbeat("n1", {"free_blocks": 5}, TTL_S)

    result = store.register_node("n1", "n1.new:50051", SPEC, 2000, TTL_S)

    assert result == PurgeResult("n1", True, 2, ("s1",))
    assert store.keys_of("n1") == set()
    assert store.nodes_holding(key(1)) == {"n2"}
    assert store.nodes_holding(key(2)) == set()
    assert store.match_prefix([key(1), key(2)]) == {"n1": 0, "n2": 1}
    lost = store.get_sequence("s1")
    assert (lost.state, lost.lost_reason) == (
        "lost",
        "node n1 re-registered (restarted; its blocks are gone)",
    )
    assert store.get_sequence("s2").state == "active"
    assert store.sequences_of_node("n1") == []
    assert store.live_nodes()[0] == NodeInfo("n1", "n1.new:50051", SPEC, 2000, {})


def test_remove_node_purges_marks_lost_and_drops(store: Store) -> None:
    register(store, "n1", "n2")
    store.apply_events("n1", [key(1), key(2), key(3)], [])
    store.apply_events("n2", [key(1)], [])
    store.create_sequence(seq("b", ("n1", 0, 2)))
    store.create_sequence(seq("a", ("n2", 0, 4), ("n1", 4, 2)))  # spans both nodes
    store.create_sequence(seq("c", ("n2", 0, 1)))

    assert store.remove_node("n1") == PurgeResult("n1", True, 3, ("a", "b"))

    assert [n.node_id for n in store.live_nodes()] == ["n2"]
    assert store.expired_nodes() == []
    assert store.keys_of("n1") == set()
    assert store.nodes_holding(key(1)) == {"n2"}
    for seq_id in ("a", "b"):
        record = store.get_sequence(seq_id)
        assert (record.state, record.lost_reason) == ("lost", "node n1 died")
    assert store.get_sequence("c").state == "active"
    assert [r.seq_id for r in store.sequences_of_node("n2")] == ["a", "c"]
    assert store.heartbeat("n1", {}, TTL_S) is False
    # idempotent: a second reaper finds nothing to do
    assert store.remove_node("n1") == PurgeResult("n1", False, 0, ())


def test_remove_node_require_expired_spares_a_live_node(store: Store) -> None:
    register(store, "n1")
    register(store, "n2", ttl_s=SHORT_TTL_S)
    store.apply_events("n1", [key(7)], [])
    with pytest.raises(FailedPrecondition, match="n1"):
        store.remove_node("n1", require_expired=True)
    assert store.keys_of("n1") == {key(7)}
    wait_until(lambda: store.expired_nodes() == ["n2"])
    assert store.remove_node("n2", require_expired=True).was_registered is True
    assert store.expired_nodes() == []
    assert [n.node_id for n in store.live_nodes()] == ["n1"]


def test_live_node_reads_one_node_and_none_once_lapsed_or_removed(store: Store) -> None:
    assert store.live_node("n1") is None
    register(store, "n1", "n2")
    store.heartbeat("n1", {"free_blocks": 7}, TTL_S)
    listed = {n.node_id: n for n in store.live_nodes()}
    assert store.live_node("n1") == listed["n1"]
    assert store.live_node("n1") == NodeInfo("n1", "n1.local:50051", SPEC, 1000, {"free_blocks": 7})
    store.remove_node("n2")
    assert store.live_node("n2") is None
    store.register_node("n3", "n3.local:50051", SPEC, 1000, SHORT_TTL_S)
    wait_until(lambda: store.live_node("n3") is None)
    assert store.heartbeat("n3", {}, TTL_S)  # lapsed, not removed: a beat revives it
    assert store.live_node("n3") is not None
    with pytest.raises(InvalidArgument, match="node_id"):
        store.live_node("")


def test_one_holder_leads_a_role_until_its_lease_lapses(store: Store) -> None:
    assert store.try_lead("reaper", "a", SHORT_TTL_S)
    assert not store.try_lead("reaper", "b", TTL_S)
    assert store.try_lead("other-role", "b", TTL_S)  # roles are independent
    assert store.try_lead("reaper", "a", SHORT_TTL_S)  # renewed by its holder
    wait_until(lambda: store.try_lead("reaper", "b", TTL_S))
    assert not store.try_lead("reaper", "a", TTL_S)  # the lapsed holder lost it
    with pytest.raises(InvalidArgument, match="holder"):
        store.try_lead("reaper", "", TTL_S)
    with pytest.raises(InvalidArgument, match="ttl"):
        store.try_lead("reaper", "b", 0)


# ---- prefix index -----------------------------------------------------------------------------


def test_match_prefix_counts_leading_keys_and_a_gap_stops_the_count(store: Store) -> None:
    register(store, "n1", "n2", "n3")
    keys = [key(i) for i in range(6)]
    store.apply_events("n1", keys[:4], [])
    store.apply_events("n2", [keys[0], keys[1], keys[3], keys[4], keys[5]], [])  # gap at 2
    store.apply_events("n3", keys[1:], [])  # lacks the first key
    assert store.match_prefix(keys) == {"n1": 4, "n2": 2, "n3": 0}
    assert store.match_prefix(keys[:1]) == {"n1": 1, "n2": 1, "n3": 0}
    assert store.match_prefix([]) == {"n1": 0, "n2": 0, "n3": 0}
    assert store.match_prefix([key(99)] + keys) == {"n1": 0, "n2": 0, "n3": 0}


def test_match_prefix_over_more_keys_than_one_script_slice(store: Store) -> None:
    """9,001 keys: the Redis script asks in slices of 4,000 (Lua's unpack limit)."""
    register(store, "n1", "n2", "n3")
    keys = [key(i) for i in range(9001)]
    store.apply_events("n1", keys, [])
    store.apply_events("n2", keys[:4000] + keys[4001:], [])  # gap at the first key of slice 2
    store.apply_events("n3", keys[:8500], [])
    assert store.match_prefix(keys) == {"n1": 9001, "n2": 4000, "n3": 8500}


def test_match_prefix_with_no_nodes_is_empty(store: Store) -> None:
    assert store.match_prefix([key(1)]) == {}


def test_apply_events_is_set_semantics_and_validates_before_changing(store: Store) -> None:
    register(store, "n1")
    store.apply_events("n1", [key(1), key(1), key(2)], [])
    store.apply_events("n1", [key(2)], [key(3)])  # re-store and remove-absent: no-ops
    assert store.keys_of("n1") == {key(1), key(2)}
    with pytest.raises(InvalidArgument, match="in two of stored, removed and offloaded"):
        store.apply_events("n1", [key(4)], [key(4)])
    with pytest.raises(InvalidArgument, match="a block key in stored must be 16 bytes"):
        store.apply_events("n1", [key(5), b"short"], [])
    with pytest.raises(InvalidArgument, match="a block key in offloaded must be 16 bytes"):
        store.apply_events("n1", [], [], [b"short"])
    with pytest.raises(NodeNotLive, match="ghost"):
        store.apply_events("ghost", [key(6)], [])
    assert store.keys_of("n1") == {key(1), key(2)}
    assert store.keys_of("ghost") == set()
    assert store.nodes_holding(key(6)) == set()
    store.apply_events("n1", [], [key(1), key(2)])
    assert store.keys_of("n1") == set()
    assert store.nodes_holding(key(1)) == set()


def test_index_is_exact_after_thousands_of_random_events(store: Store) -> None:
    rng = random.Random(1234)
    nodes = ["n0", "n1", "n2", "n3"]
    register(store, *nodes)
    universe = [key(i) for i in range(150)]
    shadow: dict[str, set[bytes]] = {n: set() for n in nodes}
    for _ in range(1500):
        node = rng.choice(nodes)
        picked = rng.sample(universe, rng.randint(0, 6))
        cut = rng.randint(0, len(picked))
        stored, removed = picked[:cut], picked[cut:]
        store.apply_events(node, stored, removed)
        shadow[node] |= set(stored)
        shadow[node] -= set(removed)
    for n in nodes:
        assert store.keys_of(n) == shadow[n]
    for k in universe:
        assert store.nodes_holding(k) == {n for n in nodes if k in shadow[n]}
    for _ in range(200):
        chain = rng.sample(universe, rng.randint(0, 8))
        expected = {}
        for n in nodes:
            count = 0
            while count < len(chain) and chain[count] in shadow[n]:
                count += 1
            expected[n] = count
        assert store.match_prefix(chain) == expected
    # a long chain a node holds completely
    store.apply_events("n2", universe, [])
    assert store.match_prefix(universe)["n2"] == len(universe)


# ---- page tables ------------------------------------------------------------------------------


def test_sequence_crud(store: Store) -> None:
    register(store, "n1", "n2")
    record = seq("s1", ("n1", 0, 3), num_tokens=40)
    store.create_sequence(record)
    assert store.get_sequence("s1") == record
    assert store.sequences_of_node("n1") == [record]

    updated = store.update_sequence("s1", num_tokens=50, state="swapped")
    assert updated == seq("s1", ("n1", 0, 3), num_tokens=50, state="swapped")
    assert store.get_sequence("s1") == updated

    moved = store.update_sequence("s1", extents=[("n1", 0, 3), ("n2", 3, 1)], state="active")
    assert moved.extents == (Extent("n1", 0, 3), Extent("n2", 3, 1))
    assert [r.seq_id for r in store.sequences_of_node("n2")] == ["s1"]
    moved = store.update_sequence("s1", extents=[("n2", 0, 4)])
    assert store.sequences_of_node("n1") == []
    assert store.sequences_of_node("n2") == [moved]

    assert store.delete_sequence("s1") == moved
    assert store.sequences_of_node("n2") == []
    with pytest.raises(SequenceNotFound, match="s1"):
        store.get_sequence("s1")
    with pytest.raises(SequenceNotFound, match="s1"):
        store.delete_sequence("s1")


def test_delete_sequence_with_a_tenant_refuses_another_tenants_and_keeps_it(store: Store) -> None:
    register(store, "n1")
    record = seq("s1", ("n1", 0, 2), tenant="acme")
    store.create_sequence(record)
    with pytest.raises(PermissionDenied, match="'s1' belongs to another tenant"):
        store.delete_sequence("s1", tenant="other")
    assert store.get_sequence("s1") == record
    assert store.sequences_of_node("n1") == [record]
    with pytest.raises(InvalidArgument):
        store.delete_sequence("s1", tenant="")
    assert store.delete_sequence("s1", tenant="acme") == record
    assert store.sequences_of_node("n1") == []
    with pytest.raises(SequenceNotFound, match="s1"):
        store.delete_sequence("s1", tenant="acme")


def test_sequence_errors_change_nothing(store: Store) -> None:
    register(store, "n1")
    store.create_sequence(seq("s1", ("n1", 0, 1)))
    with pytest.raises(SequenceExists, match="s1"):
        store.create_sequence(seq("s1", ("n1", 0, 9)))
    assert store.get_sequence("s1").num_blocks == 1
    with pytest.raises(NodeNotLive, match="ghost"):
        store.create_sequence(seq("s2", ("ghost", 0, 1)))
    with pytest.raises(SequenceNotFound):
        store.get_sequence("s2")
    with pytest.raises(NodeNotLive, match="ghost"):
        store.update_sequence("s1", extents=[("ghost", 0, 1)], num_tokens=3)
    assert store.get_sequence("s1") == seq("s1", ("n1", 0, 1))
    with pytest.raises(SequenceNotFound, match="nope"):
        store.update_sequence("nope", num_tokens=1)
    with pytest.raises(InvalidArgument, match="tenant"):
        store.update_sequence("s1", tenant="other")
    with pytest.raises(InvalidArgument, match="state"):
        store.update_sequence("s1", state="gone")
    with pytest.raises(InvalidArgument, match="tile"):
        store.update_sequence("s1", extents=[("n1", 1, 1)])
    assert store.get_sequence("s1") == seq("s1", ("n1", 0, 1))


def test_sequence_record_validates() -> None:
    with pytest.raises(InvalidArgument, match="at least one extent"):
        SequenceRecord("s", "t", ())
    with pytest.raises(InvalidArgument, match="tile"):
        SequenceRecord("s", "t", (Extent("n1", 0, 2), Extent("n2", 3, 1)))
    with pytest.raises(InvalidArgument, match="num_tokens"):
        SequenceRecord("s", "t", (Extent("n1", 0, 2),), num_tokens=-1)
    with pytest.raises(InvalidArgument, match="seq_id"):
        SequenceRecord("", "t", (Extent("n1", 0, 2),))


# ---- tenants ----------------------------------------------------------------------------------


def test_salts_are_random_stable_and_distinct_per_tenant(store: Store) -> None:
    a, b = store.tenant_salt("acme"), store.tenant_salt("globex")
    assert len(a) == len(b) == 16
    assert a != b
    assert store.tenant_salt("acme") == a


def test_concurrent_first_use_of_a_salt_agrees(store_url: str) -> None:
    stores = (
        [open_store(store_url) for _ in range(4)] if store_url != "memory://" else [open_store("memory://")]
    )
    salts: list[bytes] = []
    barrier = threading.Barrier(16)

    def first_use(i: int) -> None:
        barrier.wait()
        salts.append(stores[i % len(stores)].tenant_salt("initech"))

    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(salts) == 16 and len(set(salts)) == 1
    for s in stores:
        s.close()


def test_quota_reserve_release_and_error_fields(store: Store) -> None:
    assert store.tenant_usage("acme") == 0
    assert store.reserve_blocks("acme", 6, quota=10) == 6
    with pytest.raises(QuotaExceeded) as info:
        store.reserve_blocks("acme", 5, quota=10)
    assert (info.value.tenant, info.value.used, info.value.requested, info.value.quota) == ("acme", 6, 5, 10)
    assert "acme" in str(info.value)
    assert store.tenant_usage("acme") == 6
    assert store.reserve_blocks("acme", 4, quota=10) == 10
    assert store.release_blocks("acme", 7) == 3
    with pytest.raises(InvalidArgument, match="only 3 reserved"):
        store.release_blocks("acme", 4)
    assert store.tenant_usage("acme") == 3
    assert store.tenant_usage("globex") == 0
    with pytest.raises(InvalidArgument):
        store.reserve_blocks("acme", -1, quota=10)


def test_quota_is_never_exceeded_under_16_threads(store: Store) -> None:
    quota, per_thread = 100, 15
    successes: list[int] = []
    failures: list[QuotaExceeded] = []
    lock = threading.Lock()
    barrier = threading.Barrier(16)

    def worker() -> None:
        barrier.wait()
        for _ in range(per_thread):
            try:
                used = store.reserve_blocks("acme", 1, quota)
                with lock:
                    successes.append(used)
            except QuotaExceeded as e:
                with lock:
                    failures.append(e)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(successes) == list(range(1, quota + 1))  # every value seen once: no lost update
    assert len(failures) == 16 * per_thread - quota
    assert all(e.used == quota for e in failures)
    assert store.tenant_usage("acme") == quota


# ---- operations -------------------------------------------------------------------------------


def test_ping_and_bad_input_names_the_field(store: Store) -> None:
    store.ping()
    with pytest.raises(InvalidArgument, match="node_id"):
        store.register_node("", "a:1", SPEC, 10, TTL_S)
    with pytest.raises(InvalidArgument, match="num_blocks"):
        store.register_node("n1", "a:1", SPEC, -1, TTL_S)
    with pytest.raises(InvalidArgument, match="16 bytes"):
        store.match_prefix([b"x"])
    with pytest.raises(InvalidArgument, match="tenant"):
        store.tenant_salt("")
    assert store.live_nodes() == []


def test_open_store_rejects_unknown_scheme() -> None:
    with pytest.raises(InvalidArgument, match="memory://"):
        open_store("etcd://x")


def test_a_new_store_object_sees_the_same_state(store_url: str) -> None:
    """A restarted coordinator (or a replica) sees everything: state lives in the store."""
    if store_url == "memory://":
        pytest.skip("the embedded store lives and dies with its process")
    first = open_store(store_url)
    register(first, "n1")
    first.apply_events("n1", [key(1)], [])
    first.create_sequence(seq("s1", ("n1", 0, 1)))
    salt = first.tenant_salt("acme")
    first.reserve_blocks("acme", 3, 10)
    first.close()
    second = open_store(store_url)
    assert [n.node_id for n in second.live_nodes()] == ["n1"]
    assert second.match_prefix([key(1)]) == {"n1": 1}
    assert second.get_sequence("s1") == seq("s1", ("n1", 0, 1))
    assert second.tenant_salt("acme") == salt
    assert second.tenant_usage("acme") == 3
    second.close()


def test_memory_store_ttl_follows_the_injected_clock() -> None:
    from pagedkv.coordinator.memory_store import MemoryStore

    now = [100.0]
    store = MemoryStore(clock=lambda: now[0])
    store.register_node("n1", "a:1", SPEC, 10, ttl_s=5.0)
    now[0] = 104.9
    assert store.heartbeat("n1", {}, ttl_s=5.0) is True  # deadline now 109.9
    now[0] = 109.8
    assert store.expired_nodes() == []
    now[0] = 109.9
    assert store.expired_nodes() == ["n1"]
    store.remove_node("n1", require_expired=True)
    assert store.heartbeat("n1", {}, ttl_s=5.0) is False


def test_a_new_empty_tail_extent_links_its_node(store: Store) -> None:
    """An Extend (coordinator/extents.py) seals the tail and adds an extent of 0 blocks on
    another node: that node lists the sequence, and its death loses it."""
    register(store, "n1", "n2", "n3")
    store.create_sequence(seq("s", ("n1", 0, 5), num_tokens=17))
    grown = store.update_sequence("s", extents=[("n1", 0, 4), ("n2", 4, 3), ("n3", 7, 0)])
    assert grown.extents[-1] == Extent("n3", 7, 0) and grown.num_blocks == 7
    assert [r.seq_id for r in store.sequences_of_node("n3")] == ["s"]
    assert store.remove_node("n3").lost_seq_ids == ("s",)
    lost = store.get_sequence("s")
    assert (lost.state, lost.lost_reason) == ("lost", "node n3 died")
    assert lost.extents == grown.extents  # kept whole: close frees the live extents
