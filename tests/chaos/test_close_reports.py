"""A close that comes before anything found its sequence's loss (issue 18), with real
processes: a redis-server, a coordinator and two nodes.

The worker's close frees the sequence on each extent's node itself, with its ticket, before
the coordinator drops the page table (client/closing.py). So a close right after its node
was SIGKILLed, stopped or restarted (no data call since, no verdict yet) answers Unavailable
naming the node's address and keeps the page table and the handle; retried once the node is
declared dead it answers SequenceLost naming the node; a normal close frees every block on
every node at once (not after reconciliation); a Free with another sequence's ticket or none
is refused with nothing freed; a worker that dies between its Free and the coordinator's
Close leaves a record that reconciliation marks lost, and a retried close answers OK before
that and SequenceLost after.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import torch
from harness import (
    DETECTION_BOUND_S,
    LEASE_S,
    PROMPT_TOKENS,
    SPEC,
    TOKEN,
    ChaosCluster,
    placed,
    wait_for,
)
from harness import seeded_kv as kv

from pagedkv.client import (
    AsyncCacheClient,
    AsyncSequence,
    CacheClient,
    ClientConfig,
    SequenceLost,
    SequenceNotFound,
    Unavailable,
)
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(180)


def verdict(client: CacheClient, seq_id: str) -> str:
    """What the page table says: live, suspect (node lapsed, no verdict), lost or gone."""
    try:
        client.routing.describe(seq_id)
    except SequenceLost:
        return "lost"
    except Unavailable:
        return "suspect"
    except SequenceNotFound:
        return "gone"
    return "live"


def registered(cc: ChaosCluster, i: int) -> bool:
    """The node serves under a registration and can prove its lease (its Stats say so)."""
    with grpc.insecure_channel(cc.cluster.node_addresses[i]) as channel:
        reply = pb_grpc.CacheNodeStub(channel).Stats(pb.Empty(), timeout=2)
    return reply.epoch != 0 and not reply.is_fenced


@pytest.mark.parametrize("secure", [True, False], ids=["tickets", "no-secret"])
def test_a_close_right_after_its_node_was_killed_reports_the_loss(tmp_path, secure):
    """Plain, sharded with the dead node first or last, and through the asyncio client:
    Unavailable while the node is only unreachable, SequenceLost naming it once declared
    dead; a handle kept through the node's restart on its port answers SequenceLost too;
    nothing leaks on the live node (a sharded sequence's live extent) or in Redis."""
    config = ClientConfig(deadline_s=4.0)
    with (
        ChaosCluster(tmp_path, secure=secure) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC, config=config) as client,
    ):
        address = cc.cluster.node_addresses[0]
        plain, live, kept = (
            placed(client, n, name)
            for n, name in [("node-0", "plain"), ("node-1", "live"), ("node-0", "kept")]
        )
        dead_tail, dead_head = placed(client, "node-1", "tail"), placed(client, "node-0", "head")
        dead_tail.extend()
        dead_head.extend()
        assert [e.route.node_id for e in dead_tail.extents] == ["node-1", "node-0"]
        assert [e.route.node_id for e in dead_head.extents] == ["node-0", "node-1"]
        aclient = AsyncCacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC, config=config)
        aseq = AsyncSequence(aclient, placed(aclient.sync, "node-0", "async"))
        handles = [plain, dead_tail, dead_head]
        cc.cluster.kill("node-0")  # SIGKILL; it stays down until the restart below
        killed = time.monotonic()
        for seq in handles:
            with pytest.raises(Unavailable, match=address):
                seq.close()
            assert not seq.is_closed and verdict(client, seq.seq_id) == "live", seq.seq_id
        with pytest.raises(Unavailable, match=address):
            asyncio.run(aseq.close())
        assert time.monotonic() - killed < LEASE_S * 0.8, "too slow to close before the verdict"

        wait_for(
            lambda: verdict(client, plain.seq_id) == "lost", DETECTION_BOUND_S + 2, "node-0 declared dead"
        )
        for seq in handles:
            with pytest.raises(SequenceLost, match="node-0") as info:
                seq.close()
            assert (info.value.seq_id, info.value.node_id) == (seq.seq_id, "node-0")
            assert seq.is_closed and verdict(client, seq.seq_id) == "gone"
            seq.close()  # reported once: the handle is closed
            client.routing.close(seq.seq_id)  # and the record went with the report
        with pytest.raises(SequenceLost, match="node-0"):
            asyncio.run(aseq.close())
        asyncio.run(aclient.close())
        live.close()

        cc.cluster.start_node(0)  # same id, same port: back empty under a new epoch
        wait_for(lambda: registered(cc, 0), DETECTION_BOUND_S, "node-0 registered again")
        with pytest.raises(SequenceLost, match="node-0") as info:
            kept.close()  # its first call since the kill
        assert info.value.node_id == "node-0"
        cc.converged(client, timeout_s=6 * LEASE_S)


def test_a_close_while_its_node_is_stopped_reports_the_loss(tmp_path):
    """SIGSTOP: the Free times out (Unavailable, the handle kept) until the node is declared
    dead, then SequenceLost; continued, the node comes back empty and nothing leaks."""
    config = ClientConfig(deadline_s=4.0)
    with (
        ChaosCluster(tmp_path) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC, config=config) as client,
    ):
        seq = placed(client, "node-0", "stopped")
        cc.signal("node-0", signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            with pytest.raises(Unavailable):
                seq.close(timeout_s=1.0)
            assert not seq.is_closed and verdict(client, seq.seq_id) in ("live", "suspect")
            wait_for(
                lambda: verdict(client, seq.seq_id) == "lost", DETECTION_BOUND_S + 2, "node-0 declared dead"
            )
            with pytest.raises(SequenceLost, match="node-0") as info:
                seq.close(timeout_s=1.0)
            assert info.value.node_id == "node-0" and seq.is_closed
        finally:
            time.sleep(max(0.0, 2.5 * LEASE_S - (time.monotonic() - stopped)))
            cc.signal("node-0", signal.SIGCONT)
        wait_for(lambda: registered(cc, 0), 3 * LEASE_S, "node-0 back")
        cc.converged(client, timeout_s=6 * LEASE_S)


def test_a_normal_close_frees_every_extent_at_once_and_a_retry_answers_ok(tmp_path):
    """Every block on every node freed by the closes themselves: converged well before
    reconciliation's grace (two leases) could have freed anything."""
    with (
        ChaosCluster(tmp_path) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC) as client,
    ):
        seqs = [placed(client, n, f"normal{i}") for i, n in enumerate(("node-0", "node-1", "node-0"))]
        seqs[2].extend()
        seqs[2].append([7] * SPEC.block_size, *kv(SPEC.block_size, 99))
        assert [e.route.node_id for e in seqs[2].extents] == ["node-0", "node-1"]
        for seq in seqs:
            seq.close()
        took = cc.converged(client, timeout_s=LEASE_S)
        assert took < LEASE_S, took
        seqs[2].is_closed = False  # as a close whose reply was lost: the retry answers OK
        seqs[2].close()
        client.routing.close(seqs[0].seq_id)


def test_a_free_without_the_sequences_ticket_frees_nothing(tmp_path):
    with (
        ChaosCluster(tmp_path) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC) as client,
    ):
        a, b = placed(client, "node-0", "a"), placed(client, "node-0", "b")
        node = client.node(cc.cluster.node_addresses[0])
        a_id, b_id = node.wallet.node_id(a.seq_id), node.wallet.node_id(b.seq_id)
        for metadata, code in [
            (node.wallet.metadata([b_id]), grpc.StatusCode.PERMISSION_DENIED),
            ((), grpc.StatusCode.UNAUTHENTICATED),
        ]:
            with pytest.raises(grpc.RpcError) as info:
                node.control.stub.Free(pb.SeqRequest(seq_id=a_id), timeout=5, metadata=metadata)
            assert info.value.code() == code, info.value.details()
        assert node.control.stats().counters["num_sequences"] == 2
        assert torch.equal(
            a.read_kv(0, PROMPT_TOKENS)[0], kv(PROMPT_TOKENS, int(a.seq_id.rsplit("-", 1)[1]))[0]
        )
        a.close()
        b.close()
        cc.converged(client, timeout_s=LEASE_S)


def test_a_worker_dead_between_its_free_and_the_close_leaves_nothing_behind(tmp_path):
    """The worker's Free went out, its Close never did: the record stays live until
    reconciliation sees the node no longer holds it and marks it lost (expiring). A retried
    close answers OK before that (the coordinator frees: NOT_FOUND), SequenceLost after."""
    with (
        ChaosCluster(tmp_path) as cc,
        CacheClient(coordinator=cc.coordinator, token=TOKEN, spec=SPEC) as client,
    ):
        early, late = placed(client, "node-0", "early"), placed(client, "node-0", "late")
        node = client.node(cc.cluster.node_addresses[0])
        for seq in (early, late):
            node.control.free(seq.seq_id)  # the worker's Free, with its ticket; no Close after it
        assert node.control.stats().counters["num_sequences"] == 0
        early.close()  # before reconciliation: OK
        assert verdict(client, early.seq_id) == "gone"
        wait_for(
            lambda: verdict(client, late.seq_id) == "lost", 4 * LEASE_S + 2, "reconciliation marked it lost"
        )
        with pytest.raises(SequenceLost, match="node-0") as info:
            late.close()
        assert info.value.node_id == "node-0"
        cc.converged(client, timeout_s=LEASE_S)
