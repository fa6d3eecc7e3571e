"""Node faults under a live workload (issue 18): SIGKILL and restart on the same port with
workers holding handles, SIGSTOP beyond the lease, and stalls shorter than the lease (a slow
node's stop/continue duty cycle). After each: zero corruptions, every lost sequence reported
as SequenceLost naming its node, detection within the stated bound, and the cluster converged
by itself (no block held on any node, no page table in Redis)."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from harness import (
    DETECTION_BOUND_S,
    LEASE_S,
    ChaosCluster,
    Workload,
    assert_lost_everywhere,
    hold_on,
    reads_back,
    wait_for,
)

from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(240)


def finish(cc: ChaosCluster, work: Workload) -> None:
    tally = work.stop()
    assert not tally.wrong, tally.wrong[:5]
    assert tally.counts["completed"] > 0, tally.counts
    with work.client() as client:
        cc.converged(client, timeout_s=6 * LEASE_S)


@pytest.mark.parametrize("secure", [True, False], ids=["tickets", "no-secret"])
def test_node_sigkill_and_restart_on_its_port_with_handles_held(tmp_path, secure):
    """With tickets the node itself answers SequenceLost; without a cluster secret it can only
    say NOT_FOUND, and the client asks the coordinator, which checks with the node: either way
    a worker's sequence that the restart took answers SequenceLost, never NOT_FOUND (the
    workload counts any other answer as wrong), including opens whose node Open the
    coordinator could not deliver while the node was down or just back."""
    with ChaosCluster(tmp_path, secure=secure) as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, "node-0", 3)
        time.sleep(1.0)
        cc.cluster.kill("node-0")
        cc.cluster.start_node(0)  # same id, same port (returns once it serves health checks)
        start = time.monotonic()
        # it takes over its own registration at once: the old one's address answers another epoch
        took = wait_for(lambda: _registered(cc, 0), DETECTION_BOUND_S, "node-0 registered again")
        assert_lost_everywhere(held, "node-0")
        print(
            f"restarted node registered {took:.1f}s after it served, losses reported after "
            f"{time.monotonic() - start:.1f}s"
        )
        time.sleep(2.0)  # the workload goes on over both nodes
        finish(cc, work)
        assert work.tally.counts["completed"] > 0


def test_node_sigstop_beyond_the_lease_is_fenced_declared_dead_and_comes_back(tmp_path):
    with ChaosCluster(tmp_path) as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, "node-0", 3)
        cc.signal("node-0", signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            detected = wait_for(lambda: "node-0" not in cc.live_nodes(), DETECTION_BOUND_S + 2, "node-0 dead")
        finally:
            time.sleep(max(0.0, 2.5 * LEASE_S - (time.monotonic() - stopped)))
            cc.signal("node-0", signal.SIGCONT)
        assert detected <= DETECTION_BOUND_S, detected
        # It fenced itself before the coordinator declared it dead; back, it learns it was,
        # comes back empty under a new epoch, and every held handle learns its loss.
        wait_for(lambda: "node-0" in cc.live_nodes(), 3 * LEASE_S, "node-0 back")
        assert_lost_everywhere(held, "node-0")
        time.sleep(2.0)
        finish(cc, work)


def test_a_node_stopped_past_a_lengthened_lease_lapses_later_and_is_still_declared_dead(tmp_path):
    """A coordinator sized for 2 beats a second doubles the 3 s lease for two nodes (2.7 beats a
    second on 3 s, 1.3 on 6): a node SIGSTOPped then lapses only after the longer lease (more
    than 4 s after the stop; on the configured lease at most 3.75 with the reaper's tick) and is
    still declared dead within that lease's bound, fenced before, and comes back empty with every
    held handle told of its loss."""
    chaos = ChaosCluster(tmp_path)
    chaos.cluster.env["PAGEDKV_MAX_BEATS_PER_S"] = "2"
    lease_s = 2 * LEASE_S
    with chaos as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, "node-0", 3)
        time.sleep(LEASE_S)  # (both nodes beat on the longer lease by now)
        cc.signal("node-0", signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            bound = lease_s * 1.75 + 1.0 + 2.0
            detected = wait_for(lambda: "node-0" not in cc.live_nodes(), bound + 2, "node-0 dead")
        finally:
            time.sleep(max(0.0, 2.5 * lease_s - (time.monotonic() - stopped)))
            cc.signal("node-0", signal.SIGCONT)
        assert 4.0 < detected <= bound, detected
        wait_for(lambda: "node-0" in cc.live_nodes(), 3 * lease_s, "node-0 back")
        assert_lost_everywhere(held, "node-0")
        time.sleep(2.0)
        finish(cc, work)


def test_stalls_shorter_than_the_lease_lose_nothing(tmp_path):
    """A slow node: stopped for 60% of the lease, three times, a lease apart."""
    with ChaosCluster(tmp_path) as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, "node-0", 2)
        seen_dead = threading.Event()
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.1):
                if cc.live_nodes() and "node-0" not in cc.live_nodes():
                    seen_dead.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            for _ in range(3):
                cc.signal("node-0", signal.SIGSTOP)
                time.sleep(0.6 * LEASE_S)
                cc.signal("node-0", signal.SIGCONT)
                time.sleep(LEASE_S)
        finally:
            cc.signal("node-0", signal.SIGCONT)
            stop.set()
            watcher.join()
        assert not seen_dead.is_set(), "a node stalled for less than the lease was declared dead"
        for seq in held:  # retried while the node renews its lease after a stall (fenced: refused)
            wait_for(lambda s=seq: reads_back(s), LEASE_S, f"{seq.seq_id} reads back")
            seq.close()
        tally = work.stop()
        assert not tally.wrong, tally.wrong[:5]
        assert tally.counts["lost_reported"] == tally.counts["close_lost_reported"] == 0, tally.counts
        with work.client() as client:
            cc.converged(client, timeout_s=6 * LEASE_S)


def _registered(cc: ChaosCluster, i: int) -> bool:
    """The node serves under a registration and can prove its lease (its Stats say so)."""
    with grpc.insecure_channel(cc.cluster.node_addresses[i]) as channel:
        reply = pb_grpc.CacheNodeStub(channel).Stats(pb.Empty(), timeout=2)
    return reply.epoch != 0 and not reply.is_fenced
