"""Node faults under a live workload (issue 18): SIGKILL and restart on the same port with
workers holding handles, SIGSTOP beyond the lease, and stalls shorter than the lease (a slow
node's stop/continue duty cycle). After each: zero corruptions, every lost sequence reported
as SequenceLost naming its node, detection within the stated bound, and the cluster converged
by itself (no block held on any node, no page table in Redis)."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import torch
from harness import (
    DETECTION_BOUND_S,
    LEASE_S,
    SYSTEM,
    ChaosCluster,
    Workload,
    expected_kv,
    wait_for,
)

from pagedkv.client import SequenceLost, Unavailable

pytestmark = pytest.mark.timeout(240)


def hold_on(work: Workload, node_id: str, count: int) -> list:
    """`count` sequences opened (prompt appended) and kept on `node_id`."""
    client = work.client()
    held = []
    for i in range(200):
        prompt = SYSTEM + [30_000 + i]
        seq = client.open(f"held-{node_id}-{i}", prompt)
        if seq.route.node_id != node_id:
            seq.close()
            continue
        k, v = expected_kv(prompt)
        seq.append(
            prompt[seq.num_cached_tokens :], k[:, seq.num_cached_tokens :], v[:, seq.num_cached_tokens :]
        )
        held.append(seq)
        if len(held) == count:
            return held
    raise AssertionError(f"no {count} sequences placed on {node_id} in 200 opens")


def read_back(seq) -> bool:
    """The held sequence still reads back exactly what was written."""
    prompt = SYSTEM + [int(seq.seq_id.rsplit("-", 1)[1]) + 30_000]
    k, v = expected_kv(prompt)
    got_k, got_v = seq.read_kv(0, len(prompt))
    return torch.equal(got_k, k) and torch.equal(got_v, v)


def assert_lost_everywhere(held: list, node_id: str) -> None:
    """Each held sequence answers SequenceLost naming the node, on a data call and on close."""
    for seq in held:
        deadline = time.monotonic() + 2 * LEASE_S
        while True:
            try:
                seq.read_kv(0, 1)
                raise AssertionError(f"{seq.seq_id} still reads after its node lost it")
            except SequenceLost as exc:
                assert exc.node_id == node_id and node_id in str(exc), exc
                break
            except Unavailable:  # fenced, not yet re-registered
                assert time.monotonic() < deadline, f"{seq.seq_id}: Unavailable for {2 * LEASE_S}s"
                time.sleep(0.2)
        with pytest.raises(SequenceLost, match=node_id):
            seq.close()
        seq.close()  # the record is gone with the report: a second close succeeds


def finish(cc: ChaosCluster, work: Workload) -> None:
    tally = work.stop()
    assert not tally.wrong, tally.wrong[:5]
    assert tally.counts["completed"] > 0, tally.counts
    with work.client() as client:
        cc.converged(client, timeout_s=6 * LEASE_S)


def test_node_sigkill_and_restart_on_its_port_with_handles_held(tmp_path):
    with ChaosCluster(tmp_path) as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, "node-0", 3)
        time.sleep(1.0)
        cc.cluster.kill("node-0")
        start = time.monotonic()
        cc.cluster.start_node(0)  # same id, same port: it takes over its own registration at once
        wait_for(lambda: "node-0" in cc.live_nodes(), DETECTION_BOUND_S, "node-0 registered again")
        assert_lost_everywhere(held, "node-0")
        took = time.monotonic() - start
        assert took < DETECTION_BOUND_S + 2 * LEASE_S, took
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
            wait_for(lambda s=seq: _reads(s), LEASE_S, f"{seq.seq_id} reads back")
            seq.close()
        tally = work.stop()
        assert not tally.wrong, tally.wrong[:5]
        assert tally.counts["lost_reported"] == tally.counts["close_lost_reported"] == 0, tally.counts
        with work.client() as client:
            cc.converged(client, timeout_s=6 * LEASE_S)


def _reads(seq) -> bool:
    try:
        return read_back(seq)
    except Unavailable:
        return False
