"""Redis high availability (issue 18): the coordinator follows the primary through Redis
Sentinel (a redis+sentinel:// URL), with a real primary, a replica and three sentinels on
loopback, and the primary SIGKILLed mid-workload. The workload goes on on the promoted
replica; nothing is corrupted, no node is declared dead for the failover, and the cluster
converges (what the asynchronous replication lost is repaired by reconciliation)."""

from __future__ import annotations

import time

import pytest
from harness import LEASE_S, ChaosCluster, Workload, wait_for
from sentinels import SentinelRedis

pytestmark = pytest.mark.timeout(240)


def test_a_sentinel_failover_mid_workload(tmp_path):
    store = SentinelRedis(tmp_path)
    with ChaosCluster(tmp_path, redis=store) as cc:
        work = Workload(cc.coordinator).start()
        time.sleep(2.0)
        before = work.tally.counts["completed"]
        old = store.kill_primary()
        took = wait_for(lambda: _promoted(store, old), 20, "a sentinel failover")
        wait_for(lambda: work.tally.counts["completed"] > before + 20, 6 * LEASE_S, "work after the failover")
        tally = work.stop()
        assert not tally.wrong, tally.wrong[:5]
        stats = cc.cluster.stats()
        assert stats.counters["nodes_reaped"] == 0, dict(stats.counters)
        # A liveness key written to the old primary may be lost with it: the node is then
        # live again at its next beat (a quarter lease), never reaped.
        both = {"node-0", "node-1"}
        wait_for(lambda: {n.node_id for n in cc.cluster.stats().nodes} == both, 2 * LEASE_S, "both live")
        with work.client() as client:
            cc.converged(client, timeout_s=5 * LEASE_S)
        print(f"failover in {took:.1f}s: {dict(tally.counts)}")


def _promoted(store: SentinelRedis, old_port: int) -> bool:
    try:
        return store.primary_port() != old_port
    except Exception:  # noqa: BLE001 - no sentinel answers for a moment
        return False
