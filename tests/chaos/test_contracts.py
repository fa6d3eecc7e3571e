"""The pieces the fault experiments rely on, each pinned alone with real parts (issue 18):
idempotent control calls across a coordinator restart (two Coordinator objects on one
redis-server), the node's fence and its SequenceLost answers, the wait a ticketed data call
gives its sequence's Open, liveness's verdicts with a fake clock and probe, and that losses
leave nothing behind in Redis."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.gate import NodeTrust
from pagedkv.cache_node.server import create_server
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.liveness import Liveness, LivenessConfig, ProbeAnswer
from pagedkv.coordinator.reconcile import Reconciler
from pagedkv.coordinator.records import Extent, NodeInfo, SequenceRecord
from pagedkv.coordinator.store import open_store
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.errors import SequenceExists, SequenceLost, SequenceNotFound, Unavailable
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.status import error_from_rpc
from pagedkv.protos.tickets import RIGHT_ADMIN, RIGHT_DATA, TICKET_KEY, ClusterKeys, Ticket, issue

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
KEYS = ClusterKeys([b"chaos-secret-" + b"c" * 32])


@pytest.fixture
def node():
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    server, port = create_server(engine, "127.0.0.1:0", bulk_port=None)
    server.start()
    yield engine, f"127.0.0.1:{port}"
    server.stop(0)


def test_a_retried_open_gets_its_first_answer_even_from_another_coordinator(node, redis_url):
    engine, address = node
    first, second = (Coordinator(open_store(redis_url), CoordinatorConfig(lease_ttl_s=30)) for _ in range(2))
    try:
        first.register("n1", address, SPEC.to_dict(), 64)
        first.open("t", list(range(9)), seq_id="warm", wait=True)  # caches two blocks
        k = torch.randn(1, 9, 1, 8)
        engine.append("warm", list(range(9)), k, k)
        first.report_events("n1", [(1, e.key) for e in engine.take_events() if e.kind == "stored"])
        answer = first.open("t", list(range(12)), seq_id="s", request_id="req-1")
        assert (answer.node_id, answer.num_cached_tokens) == ("n1", 8)
        for coordinator in (first, second):  # the same process, and one that never saw the open
            again = coordinator.open("t", list(range(12)), seq_id="s", request_id="req-1")
            assert (again.node_id, again.address, again.num_cached_tokens) == ("n1", address, 8)
        with pytest.raises(SequenceExists):
            second.open("t", list(range(12)), seq_id="s", request_id="another-open")
        with pytest.raises(SequenceExists):
            second.open("u", list(range(12)), seq_id="s", request_id="req-1")  # another tenant's
        first.wait_idle()
        assert engine.stats()["num_sequences"] == 2  # one Open reached the node, not three
        for seq_id in ("s", "warm"):
            second.close("t", seq_id)
            second.close("t", seq_id)  # a retried close succeeds
        second.wait_idle()
        assert engine.stats()["num_sequences"] == 0
    finally:
        first.stop()
        second.stop()


def _stub(address: str) -> pb_grpc.CacheNodeStub:
    return pb_grpc.CacheNodeStub(grpc.insecure_channel(address))


def _call(rpc, request, *tickets: bytes):
    try:
        return rpc(request, timeout=10, metadata=[(TICKET_KEY, t) for t in tickets])
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


@pytest.fixture
def cluster_node():
    """A node of a cluster (tickets checked) registered as n1, epoch 5, with a live lease."""
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu", unknown_seq_grace_s=0.3))
    server, port = create_server(engine, "127.0.0.1:0", bulk_port=None, trust=NodeTrust(KEYS, node_id="n1"))
    server.start()
    gate = server.gate
    gate.set_registration("n1", 5)
    gate.keep_lease()
    stop = threading.Event()

    def renew() -> None:  # what the node's link does with every acknowledged heartbeat
        while not stop.is_set():
            gate.lease_renewed(time.monotonic(), 3.0, 0.75)
            stop.wait(0.5)

    renewer = threading.Thread(target=renew, daemon=True)
    renewer.start()
    yield engine, gate, _stub(f"127.0.0.1:{port}"), stop
    stop.set()
    renewer.join()
    server.stop(0)


def _ticket(seq_id: str, epoch: int = 5, rights: int = RIGHT_DATA) -> bytes:
    return issue(KEYS, Ticket(rights, int(time.time()) + 60, epoch, "t", seq_id, "n1"))


def _read(stub, seq_id: str, ticket: bytes) -> list:
    try:
        return list(
            stub.ReadKV(pb.ReadKVRequest(seq_id=seq_id, start=0), timeout=10, metadata=[(TICKET_KEY, ticket)])
        )
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


def _open(stub, seq_id: str) -> None:
    admin = issue(KEYS, Ticket(RIGHT_ADMIN, int(time.time()) + 60, 5, "", "", "n1"))
    _call(stub.Open, pb.OpenRequest(seq_id=seq_id, token_ids=[1, 2, 3]), admin)


def test_a_ticketed_data_call_waits_for_its_open_and_an_unticketed_id_does_not(cluster_node):
    engine, gate, stub, _ = cluster_node
    late = threading.Timer(1.0, _open, (stub, "t/late"))  # well past the short grace (0.3 s)
    late.start()
    start = time.monotonic()
    assert _read(stub, "t/late", _ticket("t/late"))  # waited for the Open, then read it
    assert 0.9 < time.monotonic() - start < 3.0
    late.join()
    # An id the coordinator placed whose Open never comes: lost, after a lease (3 s here).
    start = time.monotonic()
    with pytest.raises(SequenceLost, match="never reached node 'n1'"):
        _read(stub, "t/never", _ticket("t/never"))
    assert 2.5 < time.monotonic() - start < 6.0
    # An admin call on an unknown id (no ticket names it): NOT_FOUND after the short grace.
    admin = issue(KEYS, Ticket(RIGHT_ADMIN, int(time.time()) + 60, 5, "", "", "n1"))
    start = time.monotonic()
    with pytest.raises(SequenceNotFound):
        _read(stub, "t/unknown", admin)
    assert time.monotonic() - start < 1.5


def test_the_fence_and_the_lost_answers(cluster_node):
    engine, gate, stub, renewing = cluster_node
    _open(stub, "t/a")
    assert _read(stub, "t/a", _ticket("t/a"))
    assert _call(stub.Stats, pb.Empty()).is_fenced is False
    renewing.set()  # the renewals stop: fenced 2.25 s (a lease minus a beat) after the last one
    gate.lease_renewed(time.monotonic() - 10, 3.0, 0.75)  # (an old renewal never moves it back)
    assert not gate.is_fenced
    gate.lease_failing("its coordinator answered UNAVAILABLE")
    wait_until = time.monotonic() + 3.0
    while not gate.is_fenced:
        assert time.monotonic() < wait_until, "not fenced a lease after the last renewal"
        time.sleep(0.05)
    with pytest.raises(Unavailable, match="cannot prove its lease is live .*UNAVAILABLE"):
        _read(stub, "t/a", _ticket("t/a"))
    stats = _call(stub.Stats, pb.Empty())
    assert (stats.is_fenced, stats.epoch) == (True, 5)  # what the coordinator's probe reads
    assert engine.stats()["num_sequences"] == 1  # refused before anything changed
    gate.lease_renewed(time.monotonic(), 3.0, 0.75)
    assert _read(stub, "t/a", _ticket("t/a"))
    with pytest.raises(SequenceLost, match="earlier registration of node 'n1'") as info:
        _read(stub, "t/a", _ticket("t/a", epoch=4))
    assert info.value.node_id == "n1"
    gate.mark_lost(["t/a"], "node n1 restarted")
    with pytest.raises(SequenceLost, match="node n1 restarted"):
        _read(stub, "t/a", _ticket("t/a"))
    engine.free("t/a")
    _open(stub, "t/a")  # opened again: no longer lost
    assert _read(stub, "t/a", _ticket("t/a"))


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_waits_out_store_outages_and_grace_and_believes_probes() -> None:
    clock, answers = FakeClock(), {}
    live = Liveness(LivenessConfig(4.0), lambda node, _t: answers.get(node.node_id), clock)
    nodes = [NodeInfo(n, f"{n}:1", {}, 8, epoch=7) for n in ("a", "b", "c")]
    live.seen_live(nodes)
    assert live.dead(["a"]) == []  # the store never answered yet: no verdict
    live.store_answered()
    clock.now += 3.9
    assert live.dead(["a"]) == []  # the store answered for less than a lease
    clock.now += 0.2
    assert live.dead(["a", "b", "c"]) == []  # suspects from now: a grace of half a lease
    answers.update(a=ProbeAnswer(7, False), b=ProbeAnswer(8, False), c=None)
    clock.now += 1.9
    assert live.dead(["a", "b", "c"]) == []
    clock.now += 0.2
    # a answers as itself: kept; b is another process (a restart); c does not answer
    assert live.dead(["a", "b", "c"]) == ["b", "c"]
    answers["a"] = ProbeAnswer(7, True)  # fenced: it cannot renew, so it serves nothing
    assert live.dead(["a"]) == ["a"]
    live.store_failed()  # an outage: every lease is extended by it
    live.store_answered()
    assert live.dead(["a"]) == []
    clock.now += 4.0
    assert live.dead(["a"]) == []  # a suspect again from now, not from before the outage
    clock.now += 2.0
    assert live.dead(["a"]) == ["a"]
    assert live.config.detection_bound_s == pytest.approx(4.0 * 1.25 + 2.0 + 1.0)


def test_reconcile_grace_counts_only_time_the_store_answered(redis_url) -> None:
    """A worker that freed its sequence on the node just before a store outage cannot drop the
    page table until the store is back: the outage restarts the grace of that ghost (and of an
    orphan), so the first report after it declares nothing, and the grace after it does."""
    clock, store = FakeClock(), open_store(redis_url)
    reconciler = Reconciler(store, 6.0, 30.0, release=lambda _record: None, clock=clock)
    store.register_node("n1", "n1:1", SPEC.to_dict(), 64, 30.0)
    store.create_sequence(SequenceRecord("freed", "t", (Extent("n1", 0, 1),)))
    assert reconciler.report("n1", ["orphan"]) == []  # both tracked from now
    reconciler.store_failed()
    clock.now += 10.0  # an outage longer than the grace
    assert reconciler.report("n1", ["orphan"]) == []  # tracked again from now, not from before it
    assert store.get_sequence("freed").state == "active"
    clock.now += 6.0
    assert reconciler.report("n1", ["orphan"]) == ["orphan"]
    assert store.get_sequence("freed").state == "lost"
    assert (reconciler.counters["ghosts_lost"], reconciler.counters["orphans_freed"]) == (1, 1)


def test_a_reaper_tick_in_a_store_outage_restarts_the_reconcile_grace(redis_server, redis_url) -> None:
    """No beat reaches a coordinator while Redis hangs (SIGSTOP): its reaper's failed tick alone
    must restart the grace, or the first report after the outage declares a ghost seen just
    before it, a grace earlier by the clock but not by time the store answered."""
    config = CoordinatorConfig(lease_ttl_s=3.0, reconcile_grace_s=1.0)
    coordinator = Coordinator(open_store(redis_url), config)
    try:
        coordinator.register("n1", "n1.local:1", SPEC.to_dict(), 64, epoch=1)
        coordinator.store.create_sequence(SequenceRecord("freed", "t", (Extent("n1", 0, 1),)))
        coordinator.start(interval_s=0.1)  # ticks once a lease has passed (its grace after a start)
        time.sleep(1.6)
        coordinator.heartbeat("n1", {"free_blocks": 64})
        time.sleep(1.6)
        coordinator.heartbeat("n1", {"free_blocks": 64}, held=[])  # the ghost, tracked from now
        redis_server.pause()
        try:
            time.sleep(1.5)  # a tick times out (1 s) in the outage
        finally:
            redis_server.resume()
        coordinator.heartbeat("n1", {"free_blocks": 64}, held=[])
        assert coordinator.store.get_sequence("freed").state == "active"
        time.sleep(1.1)
        coordinator.heartbeat("n1", {"free_blocks": 64}, held=[])
        assert coordinator.store.get_sequence("freed").state == "lost"
    finally:
        coordinator.stop()


def test_nothing_in_redis_grows_with_losses(redis_url):
    """Rounds of page tables whose open never reached the node (ghosts: reconciliation marks
    them lost), of a node's re-registration (its sequences lost) and of closes: once the lost
    records' expiry passed, Redis holds exactly the keys it held before the first round."""
    import redis as redis_py

    coordinator = Coordinator(
        open_store(redis_url), CoordinatorConfig(lease_ttl_s=30, reconcile_grace_s=0, lost_ttl_s=0.3)
    )
    r = redis_py.Redis.from_url(redis_url)
    try:
        for node_id in ("n1", "n2"):
            coordinator.register(node_id, f"{node_id}.local:1", SPEC.to_dict(), 64, epoch=1)
        coordinator.store.tenant_salt("t")
        baseline = set(r.keys("*"))
        for round_ in range(3):
            for i in range(20):
                node_id = "n1" if i % 2 else "n2"
                record = SequenceRecord(f"r{round_}-{i}", "t", (Extent(node_id, 0, 1),))
                coordinator.store.create_sequence(record)
            coordinator.close("t", f"r{round_}-0")  # (on n2: freed there, never lost)
            # n1 reports holding none of its ten: ghosts, lost at once (grace 0); one report
            # more finds nothing to do (and an orphan it holds is named for freeing).
            for _ in range(2):
                assert coordinator.heartbeat("n1", {"free_blocks": 64}, held=["orphan"])[1] == ["orphan"]
            with pytest.raises(SequenceLost, match="node n1 does not hold it"):
                coordinator.close("t", f"r{round_}-1")  # a worker that learns of its loss
            assert r.scard(b"pkv:nseqs:n1") == 0  # a lost record leaves its node's set at once
            # n2 restarts: its nine left are lost by the re-registration.
            lost = coordinator.register("n2", "n2.local:1", SPEC.to_dict(), 64, epoch=2 + round_)
            assert len(lost.lost_seq_ids) == 9
            assert all(r.pttl(b"pkv:seq:" + s.encode()) > 0 for s in lost.lost_seq_ids)  # expiring
            deadline = time.monotonic() + 10
            while set(r.keys("*")) != baseline:
                assert time.monotonic() < deadline, sorted(set(r.keys("*")) ^ baseline)[:5]
                time.sleep(0.05)
        counters = coordinator.reconciler.counters
        assert (counters["ghosts_lost"], counters["orphans_freed"]) == (30, 6)
    finally:
        r.close()
        coordinator.stop()
