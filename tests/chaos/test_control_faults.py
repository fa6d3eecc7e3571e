"""Control-plane faults under a live workload (issue 18): the coordinator SIGKILLed during
open/close bursts, and Redis SIGKILLed with and without AOF for longer than the lease. After
each: zero corruptions, every lost sequence reported as SequenceLost, no node declared dead
for the store's outage, and the cluster converged by itself (reconciliation frees what a
crash left on a node; nothing stays in Redis)."""

from __future__ import annotations

import signal
import time

import pytest
from harness import LEASE_S, ChaosCluster, Workload, assert_lost_everywhere, hold_on, reads_back, wait_for

from pagedkv.client import Unavailable

pytestmark = pytest.mark.timeout(240)
# reconcile.py: a grace of two leases, seen in full reports once a lease, plus slack
CONVERGE_S = 5 * LEASE_S


@pytest.mark.parametrize("secure", [True, False], ids=["tickets", "no-secret"])
def test_coordinator_sigkill_during_bursts_leaks_nothing(tmp_path, secure):
    """Without a cluster secret an open answered just before a kill may never reach its node:
    its data calls answer SequenceLost (the coordinator checks with the node), never NOT_FOUND."""
    with ChaosCluster(tmp_path, secure=secure) as cc:
        work = Workload(cc.coordinator, num_workers=8).start()
        for _ in range(3):
            time.sleep(1.5)
            cc.cluster.kill("coordinator", signal.SIGKILL)
            cc.cluster.start_coordinator()  # same port; its state is all in Redis
        time.sleep(2.0)
        tally = work.stop()
        assert not tally.wrong, tally.wrong[:5]
        assert tally.counts["completed"] > 0, tally.counts
        assert work.framed_calls > 0  # the opens and closes took the framed port between kills
        with work.client() as client:
            took = cc.converged(client, timeout_s=CONVERGE_S)
            client.open("after-kills", [1, 2, 3, 4, 5]).close()  # learns the last restart's port
            assert client.routing.framed.num_calls == 1  # (the close: the open learned it)
        assert cc.live_nodes() == {"node-0", "node-1"}
        print(f"coordinator kills: {dict(tally.counts)}; converged in {took:.1f}s")


@pytest.mark.parametrize("aof", [True, False], ids=["aof", "no-aof"])
def test_redis_outage_longer_than_the_lease(tmp_path, aof):
    with ChaosCluster(tmp_path, aof=aof) as cc:
        work = Workload(cc.coordinator).start()
        held = hold_on(work, None, 2)
        time.sleep(1.0)
        cc.redis.kill()
        killed = time.monotonic()
        time.sleep(LEASE_S)  # no node can renew: past its fence (0.75 lease), data calls are refused
        with pytest.raises(Unavailable, match="cannot prove its lease"):
            held[0].read_kv(0, 1)
        time.sleep(max(0.0, 1.7 * LEASE_S - (time.monotonic() - killed)))  # every lease key lapses
        cc.redis.start()
        wait_for(lambda: cc.live_nodes() == {"node-0", "node-1"}, 3 * LEASE_S, "both nodes live")
        time.sleep(2 * LEASE_S)  # past the reaper's grace after the outage
        if aof:  # the held sequences were kept: they read back exactly
            for seq in held:
                wait_for(lambda s=seq: reads_back(s), LEASE_S, f"{seq.seq_id} reads back")
                seq.close()
        else:  # Redis forgot the nodes: they came back empty, and every handle learns it
            for seq in held:
                assert_lost_everywhere([seq], seq.route.node_id)
        tally = work.stop()
        assert not tally.wrong, tally.wrong[:5]
        stats = cc.cluster.stats()
        if aof:  # the outage was no node's failure: nothing declared dead, nothing lost
            assert stats.counters["nodes_reaped"] == 0, dict(stats.counters)
            assert tally.counts["lost_reported"] + tally.counts["close_lost_reported"] == 0, tally.counts
        with work.client() as client:
            cc.converged(client, timeout_s=CONVERGE_S)
        assert tally.counts["completed"] > 0, tally.counts
        print(f"redis outage (aof={aof}): {dict(tally.counts)}")


def test_a_close_cut_in_two_by_a_store_outage_is_no_loss(tmp_path):
    """A close freed its sequence on the node, then Redis died before the page table was
    dropped, for longer than reconciliation's grace (2 leases) since a report found the record
    not held: the close retried after the outage answers OK. The grace counts time the store
    answered; counted from before the outage, the first report after it declared the record
    lost and the close answered SequenceLost for a sequence nobody lost."""
    with ChaosCluster(tmp_path, aof=True) as cc:
        work = Workload(cc.coordinator)
        (seq,) = hold_on(work, None, 1)
        seq.node.control.free(seq.seq_id)  # the close's first half: the node frees it
        time.sleep(1.5 * LEASE_S)  # a full report (one a lease) finds the record not held
        cc.redis.kill()
        time.sleep(2.5 * LEASE_S)
        cc.redis.start()
        restarted = time.monotonic()
        wait_for(lambda: cc.live_nodes() == {"node-0", "node-1"}, 3 * LEASE_S, "both nodes live")
        # Past a report after the restart, well within a grace counted from it.
        time.sleep(max(0.0, 1.2 * LEASE_S - (time.monotonic() - restarted)))
        work.close(seq)
        assert dict(work.tally.counts) == {"closed": 1}, (work.tally.counts, work.tally.wrong)
        counters = cc.cluster.stats().counters
        assert (counters["ghosts_lost"], counters["nodes_reaped"]) == (0, 0), dict(counters)
        with work.client() as client:
            cc.converged(client, timeout_s=CONVERGE_S)
