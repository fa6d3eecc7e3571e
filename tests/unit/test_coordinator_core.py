"""The coordinator's domain logic with the embedded store and real in-process
cache nodes (gRPC servers on port 0): placement spreads cold prompts and
follows cached prefixes; the index follows the nodes' events."""

from __future__ import annotations

import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig, OpenArgs
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorCollector
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.errors import (
    CapacityExceeded,
    NodeLost,
    PermissionDenied,
    PrefixUnknown,
    SequenceNotFound,
    Unavailable,
)
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)


@pytest.fixture
def cluster():
    engines, servers = {}, []
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    for name in ("n1", "n2"):
        engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
        server, port = create_server(engine, "127.0.0.1:0")
        server.start()
        servers.append(server)
        engines[name] = engine
        coordinator.register(name, f"127.0.0.1:{port}", SPEC.to_dict(), 64)
        coordinator.heartbeat(name, {"free_blocks": 64, "used_blocks": 0})
    yield coordinator, engines
    coordinator.stop()
    for server in servers:
        server.stop(0)


def publish(coordinator, engines, name):
    """What the node's CoordinatorLink does within ~10 ms of new events."""
    events = engines[name].take_events()
    coordinator.report_events(name, [(1 if e.kind == "stored" else 2, e.key) for e in events])


def test_cold_opens_spread_and_hits_follow_the_prefix(cluster):
    coordinator, engines = cluster
    # wait=True: the node Open is asynchronous, and this test calls the engines directly
    a = coordinator.open("t", list(range(40)), seq_id="a", wait=True)  # 10 blocks (a tie: either node)
    b = coordinator.open("t", list(range(100, 140)), seq_id="b")  # a's node now looks busier
    assert {a.node_id, b.node_id} == {"n1", "n2"}
    engine = engines[a.node_id]
    k = torch.randn(1, 40, 1, 8)
    engine.append("a", list(range(40)), k, k)
    publish(coordinator, engines, a.node_id)
    assert coordinator.lookup("t", list(range(40)) + [5]) == (40, a.node_id)
    assert coordinator.lookup("other-tenant", list(range(40)) + [5]) == (0, "")
    c = coordinator.open("t", list(range(40)) + [7], seq_id="c")
    assert (c.node_id, c.num_cached_tokens) == (a.node_id, 40)
    with pytest.raises(PermissionDenied):
        coordinator.close("someone-else", "c")
    for seq_id in ("a", "b", "c"):
        coordinator.close("t", seq_id)
    coordinator.wait_idle()  # the node Frees are asynchronous too
    for e in engines.values():
        e.check_integrity()
        assert e.stats()["used_blocks"] == 0


def test_a_removed_nodes_sequences_are_lost_with_its_name(cluster):
    coordinator, engines = cluster
    x = coordinator.open("t", list(range(8)), seq_id="x")
    coordinator.store.remove_node(x.node_id)
    coordinator.refresh_nodes()
    with pytest.raises(NodeLost, match=f"'x' was lost: .*{x.node_id}"):
        coordinator.describe("t", "x")
    with pytest.raises(NodeLost, match=f"'x' was lost: .*{x.node_id}"):
        coordinator.close("t", "x")  # close reports the loss once, dropping the page table
    coordinator.close("t", "x")  # then it is closed: a retried close succeeds
    with pytest.raises(SequenceNotFound):
        coordinator.describe("t", "x")


def test_a_lease_that_lapsed_before_the_coordinator_started_is_not_a_death():
    """A coordinator (re)started on existing state gives every node one lease to beat
    again (the reaper's grace): meanwhile a sequence on a node whose lease lapsed is
    Unavailable (retry), not lost; the node's next beat makes it live at once. A lapse
    is never a loss by itself: a suspect's sequences answer Unavailable (and a close
    changes nothing) until the node beats again or is declared dead."""
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0")
    server.start()
    store = MemoryStore()
    first = Coordinator(store, CoordinatorConfig(lease_ttl_s=0.4))
    try:
        first.register("n1", f"127.0.0.1:{port}", SPEC.to_dict(), 64)
        first.open("t", list(range(8)), seq_id="x", wait=True)
        first.stop()
        time.sleep(0.5)  # no coordinator: the lease lapses
        second = Coordinator(store, CoordinatorConfig(lease_ttl_s=0.4))
        with pytest.raises(Unavailable, match="node n1 missed its lease"):
            second.describe("t", "x")
        assert second.heartbeat("n1", {"free_blocks": 62, "used_blocks": 2})[0]
        record, node = second.describe("t", "x")
        assert (record.seq_id, node.node_id) == ("x", "n1")
        time.sleep(0.5)  # past the grace, and the lease lapses again
        second.refresh_nodes()
        for call in (second.describe, second.close):
            with pytest.raises(Unavailable, match="node n1 missed its lease .*suspect"):
                call("t", "x")
        assert engine.stats()["num_sequences"] == 1  # the close changed nothing
        assert second.heartbeat("n1", {"free_blocks": 62, "used_blocks": 2})[0]
        second.close("t", "x")
        second.wait_idle()
        second.stop()
        engine.check_integrity()
        assert engine.stats()["used_blocks"] == 0
    finally:
        server.stop(0)


def test_open_close_bursts_between_heartbeats_do_not_fill_a_node(cluster):
    """The coordinator's view of a node's room changes with its own opens and closes
    until the next heartbeat: a close gives back what an open took, so many open +
    close pairs between two beats never look like a full node (before, a close gave
    nothing back and the 7th pair of 10-block prompts on two 64-block nodes was
    refused with CapacityExceeded), while open sequences still count."""
    coordinator, engines = cluster
    for i in range(40):
        prompt = list(range(1000 * i, 1000 * i + 40))  # 10 blocks, never cached
        coordinator.open("t", prompt, seq_id=f"s{i}")
        coordinator.close("t", f"s{i}")
    held = [
        coordinator.open("t", list(range(90_000 + 100 * i, 90_040 + 100 * i)), seq_id=f"h{i}")
        for i in range(12)
    ]
    with pytest.raises(CapacityExceeded):  # 12 x 10 of 128 blocks held: the 13th does not fit
        coordinator.open("t", list(range(80_000, 80_040)), seq_id="over")
    for h in held:
        coordinator.close("t", h.seq_id)
    coordinator.wait_idle()
    for e in engines.values():
        e.check_integrity()
        assert e.stats()["used_blocks"] == 0


def test_misses_are_counted_by_why_the_first_uncached_block_missed(cluster):
    coordinator, engines = cluster
    prompt = list(range(200, 240))  # 10 blocks, 9 of them matchable (the last token is computed)
    a = coordinator.open("t", prompt, seq_id="a", wait=True)
    assert coordinator.counters["misses_not_cached"] == 1
    # A second open of the same prompt before a's blocks are reported: a's in-flight marker
    # sends it to a's node, and the miss is counted as in flight.
    b = coordinator.open("t", prompt, seq_id="b", wait=True)
    assert b.node_id == a.node_id and coordinator.counters["misses_in_flight"] == 1
    k = torch.randn(1, 40, 1, 8)
    engines[a.node_id].append("a", prompt, k, k)
    publish(coordinator, engines, a.node_id)
    assert coordinator.open("t", prompt, seq_id="c").num_cached_tokens == 36  # a hit: nothing counted
    # The node reports the first block removed (evicted): the next open's miss says so.
    assert coordinator.open("t", prompt + [1], seq_id="d").placement.cached_blocks == 10  # all 10 hit
    key0 = engines[a.node_id].manager.block_keys(prompt[:4], coordinator._salt("t")[0])[0]
    coordinator.report_events(a.node_id, [(2, key0)])
    coordinator.open("t", prompt, seq_id="e")
    counts = {
        r: coordinator.counters["misses_" + r] for r in ("in_flight", "other_node", "evicted", "not_cached")
    }
    assert counts == {"in_flight": 1, "other_node": 0, "evicted": 1, "not_cached": 1}


def test_a_node_that_registers_starts_at_its_fair_share_of_recent_opens(cluster):
    coordinator, engines = cluster
    for i in range(30):
        coordinator.open("t", list(range(1000 * i, 1000 * i + 8)), seq_id=f"s{i}")
    before = {n: coordinator._opens_of(n) for n in ("n1", "n2")}
    # n2 comes back (restarted, empty), and a third node twice its size joins.
    coordinator.register("n2", "127.0.0.1:1", SPEC.to_dict(), 64)
    assert coordinator._opens_of("n2") == pytest.approx(before["n1"])  # n1's per block, 64 blocks
    coordinator.register("n3", "127.0.0.1:2", SPEC.to_dict(), 128)
    assert coordinator._opens_of("n3") == pytest.approx(2 * before["n1"])  # n1 and n2 per block, 128 blocks


def test_a_registrations_fair_share_comes_from_running_sums_that_match_a_full_count(cluster):
    """A registration reads the live nodes' blocks and recent opens from running sums (a pass
    over every node made 1,000 registrations O(N^2)): after joins, opens, a node coming back
    and a refresh of the node list, the sums are what a full count gives."""
    coordinator, _ = cluster

    def counted() -> tuple[int, float]:
        nodes, opens = coordinator._nodes, coordinator._recent_opens
        return sum(n.num_blocks for n in nodes.values()), sum(opens.get(n, 0.0) for n in nodes)

    for i in range(20):
        coordinator.open("t", list(range(1000 * i, 1000 * i + 8)), seq_id=f"s{i}")
    coordinator.register("n3", "127.0.0.1:1", SPEC.to_dict(), 32)  # joins: no opens yet to it
    assert coordinator._fleet_sums == pytest.approx(counted())
    for _ in range(5):
        coordinator._count_open("n3", 2)
    coordinator._count_open("gone", 2)  # a node no longer live counts in no sum
    assert coordinator._fleet_sums == pytest.approx(counted())
    blocks, opens = counted()
    others = opens - coordinator._recent_opens["n2"]
    coordinator.register("n2", "127.0.0.1:2", SPEC.to_dict(), 64)  # comes back: the others' share
    assert coordinator._recent_opens["n2"] == pytest.approx(others * 64 / (blocks - 64))
    assert coordinator._fleet_sums == pytest.approx(counted())
    coordinator.refresh_nodes()
    assert coordinator._fleet_sums is None  # summed again at the next registration
    blocks, opens = counted()
    coordinator.register("n4", "127.0.0.1:3", SPEC.to_dict(), 64)
    assert coordinator._recent_opens["n4"] == pytest.approx(opens * 64 / blocks)
    assert coordinator._fleet_sums == pytest.approx(counted())


def test_a_close_the_worker_freed_sends_no_free_but_one_after_an_open_in_flight(cluster):
    """freed_extents: the worker freed it on its node (client/closing.py), so the coordinator
    sends no Free of its own; unless its own node Open is still in flight (the worker's Free
    may have come first): then it frees after that Open, and nothing stays on the node."""
    coordinator, engines = cluster
    held = coordinator.open("t", list(range(40)), seq_id="settled")
    coordinator.wait_idle()
    coordinator.close("t", "settled", freed_extents=1)
    coordinator.wait_idle()
    engine = engines[held.node_id]
    assert engine.stats()["num_sequences"] == 1  # no Free came: this test is the worker here
    engine.free("settled")
    with coordinator.node_calls.held():  # the node Open is held back: in flight at the close
        raced = coordinator.open("t", list(range(100, 140)), seq_id="raced")
        coordinator.close("t", "raced", freed_extents=1)
    coordinator.wait_idle()
    for e in engines.values():
        e.check_integrity()
        assert e.stats()["num_sequences"] == 0 and e.stats()["used_blocks"] == 0, raced.node_id
    with pytest.raises(SequenceNotFound):
        coordinator.store.get_sequence("raced")


def test_a_batch_names_prompts_by_ref_and_one_unknown_ref_fails_alone(cluster):
    """Refs through open_many (the framed loop's path): the named open is placed and ordered
    as the whole prompt would be, an unknown ref fails only its own open, and the counters
    (and their metrics) say so."""
    coordinator, _ = cluster
    prompt = list(range(500, 541))  # 10 whole blocks and one token
    first = coordinator.open("t", prompt, seq_id="src", worker_opens=True, carried_prompt=True)
    assert first.prompt_ref and first.prompt_ref_tokens == 40 and first.block_size == 4
    coordinator.close("t", "src", freed_extents=1)  # (the worker would have freed it)
    tail = prompt[36:] + list(range(900, 912)) + [9]  # 13 whole blocks keyed: 9 named, 4 hashed
    named, unknown, whole = coordinator.open_many(
        [
            OpenArgs("t", tail, "named", worker_opens=True, carried_prompt=True, prefix_ref=first.prompt_ref,
                     prefix_tokens=36),
            OpenArgs("t", tail, "lost", worker_opens=True, carried_prompt=True, prefix_ref=b"\1" * 16,
                     prefix_tokens=36),
            OpenArgs("t", prompt[:36] + tail, "whole", worker_opens=True, carried_prompt=True),
        ]
    )  # fmt: skip
    assert isinstance(unknown, PrefixUnknown) and unknown.seq_id == "lost"
    assert named.prompt_ref == whole.prompt_ref != first.prompt_ref and named.prompt_ref_tokens == 52
    order, whole_order = (pb.OpenRequest.FromString(r.node_open.order) for r in (named, whole))
    assert (order.prompt_tokens, order.prompt_key) == (whole_order.prompt_tokens, whole_order.prompt_key)
    assert coordinator.counters["ref_opens"] == 1 and coordinator.counters["ref_tokens"] == 36
    assert coordinator.counters["ref_unknown"] == 1
    registry = CollectorRegistry()
    registry.register(CoordinatorCollector(coordinator))
    text = generate_latest(registry).decode()
    assert 'pagedkv_coordinator_ref_opens_total{outcome="named"} 1.0' in text
    assert 'pagedkv_coordinator_ref_opens_total{outcome="unknown"} 1.0' in text
    assert "pagedkv_coordinator_ref_tokens_total 36.0" in text
    for seq_id in ("named", "whole"):
        coordinator.close("t", seq_id, freed_extents=1)
