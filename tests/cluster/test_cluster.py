"""The distributed system, with real processes: redis-server, a coordinator and
cache nodes on free ports, and worker processes talking to them over gRPC.

Leases are 3 s here (heartbeat every 1.5 s, reaper every 0.75 s), so a dead
node must be noticed within 6 s (2x the TTL). Shorter leases make a busy
2-core machine declare live nodes dead."""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest
import torch
from conftest import TOKENS, make_cluster, run_worker
from worker import SPEC, expected_kv

from pagedkv.client import CacheClient, FailedPrecondition, SequenceLost, Unavailable
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.errors import PagedKVError, SequenceNotFound, Unauthenticated

SYSTEM = list(range(1000, 1000 + 96))  # six full blocks


def client(cluster, tenant="alpha") -> CacheClient:
    return CacheClient(coordinator=cluster.coordinator_address, token=TOKENS[tenant], spec=SPEC)


def wait_until(predicate, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout_s}s")


def _reachable(c: CacheClient) -> bool:
    try:
        c.cluster_stats()
        return True
    except Unavailable:
        return False


def _leases_live(c: CacheClient) -> bool:
    """Every node can prove its lease again (its Stats say it is not fenced): a node whose
    lease ran out while no coordinator answered refuses data calls until a beat lands."""
    for node in c.cluster_stats().nodes:
        with grpc.insecure_channel(node.address) as channel:
            if pb_grpc.CacheNodeStub(channel).Stats(pb.Empty(), timeout=2).is_fenced:
                return False
    return True


def all_nodes_clean(c: CacheClient) -> None:
    """Every node passes its integrity check and holds nothing. A close answers before its node Free
    lands (the coordinator sends it off the close's path), so the emptiness is awaited, bounded."""

    def empty(address: str) -> bool:
        counters = c.node_stats(address).counters
        return counters["used_blocks"] == 0 and counters["num_sequences"] == 0

    for node in c.cluster_stats().nodes:
        c.node(node.address).control.check_integrity()
        if not empty(node.address):
            time.sleep(0.05)
            deadline = time.monotonic() + 5.0
            while not empty(node.address) and time.monotonic() < deadline:
                time.sleep(0.05)
        counters = c.node_stats(node.address).counters
        assert counters["used_blocks"] == 0 and counters["num_sequences"] == 0, (node.node_id, counters)
        c.node(node.address).control.check_integrity()


def test_second_worker_process_reuses_the_first_ones_system_prompt(cluster):
    first = run_worker(cluster, "w1", SYSTEM + [1, 2, 3])
    assert first["cached"] == 0 and first["max_rel_err"] < 1e-5
    with client(cluster) as c:  # the node reports new blocks to the coordinator within ~10 ms
        wait_until(lambda: c.lookup(SYSTEM + [5]) == len(SYSTEM), 10.0, "the prefix in the index")
    second = run_worker(cluster, "w2", SYSTEM + [9, 9, 9, 9])
    assert second["cached"] == len(SYSTEM)  # six whole blocks, served from the first worker's KV
    assert second["node"] == first["node"]  # placement followed the prefix
    assert second["reused_ok"] and second["max_rel_err"] < 1e-5
    with client(cluster) as c:
        assert c.lookup(SYSTEM + [5]) == len(SYSTEM)
        stats = c.cluster_stats().counters
        assert stats["cached_tokens"] >= len(SYSTEM)
        all_nodes_clean(c)


def test_connect_reaches_every_node(cluster):
    """CacheClient.connect() opens each live node's connections before any request:
    the bulk port learned, TCP pinged, the same-host listener's name learned."""
    with client(cluster) as c:
        nodes = c.cluster_stats().nodes
        assert len(nodes) >= 2
        c.connect()
        for node in nodes:
            ch = c.node(node.address).data.bulk
            assert ch is not None and ch.port, node.node_id
            assert ch.local_name, node.node_id  # learned by the HELLO that connect() sent
        seq = c.open("connected", SYSTEM)  # and the connections serve the requests
        seq.close()
        all_nodes_clean(c)


def test_tenants_never_hit_each_others_cache(cluster):
    prompt = list(range(5000, 5000 + 64)) + [1]
    run_worker(cluster, "t-alpha", prompt, tenant="alpha")
    with client(cluster, "alpha") as c:  # alpha's blocks are findable before beta asks
        wait_until(lambda: c.lookup(prompt) == 64, 10.0, "alpha's prefix in the index")
    beta = run_worker(cluster, "t-beta", prompt, tenant="beta", keep=True)
    assert beta["cached"] == 0  # same tokens, other tenant: no hit
    with client(cluster, "beta") as c:
        assert c.lookup(prompt) == 64  # beta's own copy is cached now
    with client(cluster, "alpha") as c:
        assert c.lookup(prompt) == 64
        with pytest.raises(SequenceNotFound, match="unknown sequence 't-beta'"):
            c.sequence("t-beta")  # another tenant's id answers as one nobody opened
    with client(cluster, "beta") as c:
        c.sequence("t-beta").close()
    with pytest.raises(Unauthenticated, match="unknown bearer token"):
        CacheClient(coordinator=cluster.coordinator_address, token="forged", spec=SPEC).lookup(prompt)


def test_a_sequence_is_found_by_id_from_another_worker(cluster):
    run_worker(cluster, "shared-seq", SYSTEM + [4, 4], keep=True)
    with client(cluster) as c:
        seq = c.sequence("shared-seq")
        k, v = expected_kv(SYSTEM + [4, 4, 7])
        got_k, _ = seq.read_kv()
        assert torch.equal(got_k, k)  # 98 prompt tokens + the decoded one
        seq.close()
        with client(cluster, "beta") as other, pytest.raises(PagedKVError):
            other.sequence("shared-seq")
        all_nodes_clean(c)


def test_killed_node_is_detected_and_its_sequences_are_lost(tmp_path, redis_url):
    with make_cluster(tmp_path, redis_url=redis_url) as cluster, client(cluster) as c:
        # One sequence per node: the second open avoids the (equally loaded) first by load.
        a = c.open("on-a", SYSTEM + [1])
        a.append(SYSTEM + [1], *expected_kv(SYSTEM + [1]))
        wait_until(lambda: c.lookup(SYSTEM + [1]) == len(SYSTEM), 10.0, "a's blocks in the index")
        b = c.open("on-b", list(range(7000, 7100)))
        victim = a.route
        name = victim.node_id
        survivor = next(n for n in c.cluster_stats().nodes if n.node_id != name)
        cluster.kill(name, signal.SIGKILL)
        # Declared dead after its grace and a failed probe (liveness.py: within 1.75 L + 1 s of
        # its last beat); until then its sequence answers Unavailable, never a premature loss,
        # and from then on every data call answers the loss (the client asks on Unavailable).
        with pytest.raises(Unavailable, match=f"node {victim.address}"):
            a.attend(0, torch.zeros(4, SPEC.head_dim))
        detected = wait_until(lambda: len(c.cluster_stats().nodes) == 1, 8.0, "node lapse")
        assert detected < 2 * cluster.lease_ttl_s  # a suspect: out of placement
        wait_until(lambda: _lost(c, "on-a", name), 12.0, "the verdict")
        with pytest.raises(SequenceLost, match=name):
            a.attend(0, torch.zeros(4, SPEC.head_dim))
        # New opens, even of the prefix the dead node held, go to the survivor.
        fresh = c.open("after", SYSTEM + [2])
        assert fresh.route.node_id == survivor.node_id and fresh.num_cached_tokens == 0
        with pytest.raises(SequenceLost, match=name):
            a.close()  # the loss, once: the page table goes with it
        fresh.close()
        if b.route.node_id == survivor.node_id:
            b.close()
        else:  # lost too; or, when the kill beat its asynchronous node Open, never opened (dropped)
            try:
                b.close()
            except SequenceLost:
                pass
            except SequenceNotFound:
                assert c.cluster_stats().counters["open_failures"] >= 1
        all_nodes_clean(c)


def _lost(c: CacheClient, seq_id: str, node_id: str) -> bool:
    """Describe says the sequence was lost with its node (False while the node is a suspect)."""
    try:
        c.sequence(seq_id)
    except SequenceLost as exc:
        assert exc.node_id == node_id, exc
        return True
    except Unavailable:
        return False
    raise AssertionError(f"{seq_id} is still described as live")


def test_restarted_node_comes_back_empty(tmp_path, redis_url):
    with make_cluster(tmp_path, redis_url=redis_url, num_nodes=1) as cluster, client(cluster) as c:
        seq = c.open("before", SYSTEM + [1])
        seq.append(SYSTEM + [1], *expected_kv(SYSTEM + [1]))
        wait_until(lambda: c.lookup(SYSTEM + [1]) == len(SYSTEM), 10.0, "the prefix in the index")
        cluster.kill("node-0")
        wait_until(lambda: not c.cluster_stats().nodes, 8.0, "node death")
        cluster.start_node(0)  # same address, same id
        wait_until(lambda: len(c.cluster_stats().nodes) == 1, 10.0, "re-registration")
        assert c.lookup(SYSTEM + [1]) == 0  # its index entries were purged
        with pytest.raises(FailedPrecondition, match="lost"):
            c.sequence("before")
        with pytest.raises(FailedPrecondition, match="'before' was lost: node node-0"):
            seq.close()  # SequenceLost, once: the page table goes with it
        seq.close()
        again = c.open("after", SYSTEM + [1])
        assert again.num_cached_tokens == 0
        again.close()
        all_nodes_clean(c)


def test_coordinator_restart_keeps_sequences_and_index(tmp_path, redis_url):
    with make_cluster(tmp_path, redis_url=redis_url) as cluster, client(cluster) as c:
        seq = c.open("long-lived", SYSTEM + [3])
        seq.append(SYSTEM + [3], *expected_kv(SYSTEM + [3]))
        wait_until(lambda: c.lookup(SYSTEM + [3]) == len(SYSTEM), 10.0, "the prefix in the index")
        framed = c.routing.framed
        old_port = framed.port
        assert old_port  # the open's reply named the coordinator's framed port
        c.open("seeded", SYSTEM + [6]).close()  # framed and packed: the client holds its ref
        assert c.routing.sent_prompts.name(np.asarray(SYSTEM + [7], "<i4").tobytes())[1] == len(SYSTEM)
        cluster.kill("coordinator", signal.SIGTERM)
        with pytest.raises(Unavailable):
            c.lookup(SYSTEM)
        # Data calls never touch the coordinator: the worker keeps decoding meanwhile.
        out = seq.attend(0, torch.randn(4, SPEC.head_dim))
        assert out.out.shape == (4, SPEC.head_dim)
        cluster.start_coordinator()  # same address, same Redis
        wait_until(lambda: _reachable(c), 5.0, "the client reconnecting")
        # Leases may have lapsed while no coordinator ran: within the restarted one's grace
        # that is Unavailable, not a loss, and the nodes' next beats make them live again.
        wait_until(lambda: len(c.cluster_stats().nodes) == 2, 10.0, "both nodes listed again")
        # A node's gRPC channel may still be backing off from the refused connects (up to 1 s):
        # a restart slower than the lease leaves it fenced until its next beat lands.
        wait_until(lambda: _leases_live(c), 10.0, "both nodes beating again")
        assert c.sequence("long-lived").route == seq.route
        assert c.lookup(SYSTEM + [3]) == len(SYSTEM)
        # The ref the client holds names a prompt of the coordinator before: answered
        # PrefixUnknown, the open goes whole and succeeds.
        hit = c.open("hit", SYSTEM + [4])
        assert hit.num_cached_tokens == len(SYSTEM) and hit.route == seq.route
        hit.close()
        counters = c.cluster_stats().counters
        assert counters["ref_unknown"] == 1 and counters["ref_opens"] == 0
        # The restarted coordinator's framed port (another free port) is learned and used again.
        assert framed.port and framed.port != old_port
        calls = framed.num_calls
        c.open("framed-again", SYSTEM + [5]).close()
        assert framed.num_calls == calls + 2
        assert c.cluster_stats().counters["ref_opens"] == 1  # named by the ref "hit" got
        seq.close()
        all_nodes_clean(c)


def test_redis_outage_gives_unavailable_then_recovers(tmp_path, redis_server, redis_url):
    with make_cluster(tmp_path, redis_url=redis_url) as cluster, client(cluster) as c:
        seq = c.open("survives", SYSTEM + [5])
        seq.append(SYSTEM + [5], *expected_kv(SYSTEM + [5]))
        redis_server.stop()
        try:
            with pytest.raises(Unavailable):
                c.open("during", SYSTEM + [6])
            with pytest.raises(Unavailable):
                c.lookup(SYSTEM)
        finally:
            redis_server.start()
        # The test server keeps nothing on disk: the state is gone, but the
        # coordinator and the nodes reconnect and the cluster serves again.
        wait_until(lambda: len(c.cluster_stats().nodes) == 2, 10.0, "nodes re-registering")
        again = c.open("after", SYSTEM + [6])
        assert again.route.node_id in {"node-0", "node-1"}
        again.close()


def test_a_decode_batch_spanning_two_nodes_is_split_and_reassembled(cluster):
    with client(cluster) as c:
        seqs = []
        for i in range(8):  # cold opens spread over the nodes
            prompt = list(range(20_000 + 100 * i, 20_000 + 100 * i + 40))
            seq = c.open(f"span-{i}", prompt)
            seq.append(prompt, *expected_kv(prompt))
            seqs.append(seq)
            if len({s.route.node_id for s in seqs}) == 2 and len(seqs) >= 3:
                break
        assert len({s.route.node_id for s in seqs}) == 2, [s.route for s in seqs]
        q = torch.randn(len(seqs), 4, SPEC.head_dim)
        batch = c.attend_batch(seqs, 1, q)  # attend only: no new token, nothing changes
        for i, seq in enumerate(seqs):
            alone = seq.attend(1, q[i])
            torch.testing.assert_close(batch.out[i], alone.out)
            torch.testing.assert_close(batch.lse[i], alone.lse)
        for seq in seqs:
            seq.close()
        all_nodes_clean(c)
