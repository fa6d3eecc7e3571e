"""Membership at scale: a registration and a heartbeat never list every node, and one
replica at a time scans for expired nodes (the holder of the store's reaper lease)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.liveness import Liveness, LivenessConfig
from pagedkv.coordinator.memory_store import MemoryStore

SPEC = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32", "block_size": 4}


class CountingStore:
    """A shared MemoryStore seen through one coordinator: counts that coordinator's calls."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


def test_registrations_and_heartbeats_never_list_the_nodes() -> None:
    store = CountingStore(MemoryStore())
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30))  # type: ignore[arg-type]
    for i in range(300):
        coordinator.register(f"n{i:03}", f"10.0.0.{i % 250}:{5000 + i}", SPEC, 64)
        coordinator.heartbeat(f"n{i:03}", {"free_blocks": 64})
    assert coordinator.num_live_nodes() == 300
    assert coordinator.node("n299") is not None and coordinator.node("n299").load == {"free_blocks": 64}
    # A node missing from this replica's cache (it registered through another) is read alone.
    store._store.register_node("elsewhere", "10.0.1.1:5000", SPEC, 64, 30)
    assert coordinator.heartbeat("elsewhere", {"free_blocks": 3})[0]
    assert coordinator.node("elsewhere").load == {"free_blocks": 3}
    assert coordinator.live_node("n007").address == "10.0.0.7:5007"
    assert store.calls["live_nodes"] == 0 and store.calls["expired_nodes"] == 0
    assert store.calls["live_node"] == 2
    coordinator.stop()


def test_one_replica_reaps_and_both_drop_the_dead_node() -> None:
    shared = MemoryStore()
    stores = [CountingStore(shared), CountingStore(shared)]
    config = CoordinatorConfig(lease_ttl_s=1.0)
    replicas = [Coordinator(s, config) for s in stores]  # type: ignore[arg-type]
    replicas[0].register("dead", "10.0.0.1:5000", SPEC, 64)
    replicas[0].register("beating", "10.0.0.2:5000", SPEC, 64)
    for replica in replicas:
        replica.start(interval_s=0.05)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            replicas[1].heartbeat("beating", {})
            gone = all(r.node("dead") is None for r in replicas)
            if gone and sum(r.counters["nodes_reaped"] for r in replicas) == 1:
                break
            time.sleep(0.05)
        assert sum(r.counters["nodes_reaped"] for r in replicas) == 1
        assert all(r.node("dead") is None and r.node("beating") is not None for r in replicas)
        # Only the lease holder scanned for expired nodes; both refreshed their node cache.
        scanners = [s for s in stores if s.calls["expired_nodes"] > 0]
        assert len(scanners) == 1
        assert all(s.calls["live_nodes"] > 0 for s in stores)
    finally:
        for replica in replicas:
            replica.stop()


def test_a_mass_expiry_is_held_and_real_deaths_reaped_once_beats_resume() -> None:
    now = [0.0]
    store = MemoryStore(clock=lambda: now[0])
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30))
    # liveness.py on the same clock, no grace, no node answering its probe: a lapse is a death
    coordinator.liveness = Liveness(LivenessConfig(30, grace_s=0), lambda _n, _t: None, lambda: now[0])
    coordinator.liveness.store_answered()
    ids = [f"n{i:02}" for i in range(12)]
    for node_id in ids:
        coordinator.register(node_id, f"10.0.0.1:{node_id[1:]}", SPEC, 64)
    now[0] = 20.0
    for node_id in ids[:7]:
        coordinator.heartbeat(node_id, {})
    now[0] = 35.0  # 5 of 12 lapsed at once: more than a third
    assert coordinator.reap() == []
    assert coordinator.counters["reaps_held"] == 1 and coordinator.counters["nodes_reaped"] == 0
    assert store.expired_nodes() == ids[7:]  # suspects, not removed
    assert coordinator.node("n07") is None  # ...and invisible to placement meanwhile
    for node_id in ids[7:10]:
        assert coordinator.heartbeat(node_id, {})[0]  # the late ones beat again
    assert coordinator.reap() == ["n10", "n11"]  # 2 of 12: reaped
    assert coordinator.counters["nodes_reaped"] == 2 and coordinator.num_live_nodes() == 10
    coordinator.stop()
