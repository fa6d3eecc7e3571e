"""A coordinator on Redis Cluster end to end: a real node (engine served over gRPC), a
coordinator whose store is ClusterStore on the 3-master loopback cluster, the client over
the wire. A prompt is cached, published, found by a lookup and by the next open (which the
node serves from its cache), the quota is charged and given back, and a node that registers
again loses its sequences: the paths that cross slots in ClusterStore."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.cluster_store import ClusterStore
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.errors import SequenceLost
from pagedkv.protos.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
TENANT = "default"
PROMPT = list(range(40))  # 10 blocks


def kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)


def test_open_hit_close_and_reregister_through_a_cluster_store(redis_cluster_url: str) -> None:
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    store = ClusterStore(redis_cluster_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30, quotas={TENANT: 1000}))
    coordinator.register("n1", f"127.0.0.1:{node_port}", SPEC.to_dict(), 32)
    coordinator.heartbeat("n1", {"free_blocks": 32, "used_blocks": 0})
    coord_server, coord_port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    coord_server.start()
    client = CacheClient(coordinator=f"127.0.0.1:{coord_port}", spec=SPEC)
    try:
        with client.open("warm", PROMPT) as seq:
            assert seq.num_cached_tokens == 0
            seq.append(PROMPT, kv(40), kv(40))
        coordinator.wait_idle()
        events = engine.take_events()
        coordinator.report_events("n1", [(1 if e.kind == "stored" else 2, e.key) for e in events])
        stored = [e.key for e in events if e.kind == "stored"]
        assert len(stored) == 10 and all(store.nodes_holding(k) == {"n1"} for k in stored)
        assert client.lookup(PROMPT + [1]) == 40
        seq = client.open("s", PROMPT + [7, 8, 9])
        assert seq.num_cached_tokens == 40
        assert seq.append([7, 8, 9], kv(3), kv(3)) == 43  # the node took exactly the 40 promised
        assert store.tenant_usage(TENANT) == 11
        assert [r.seq_id for r in store.sequences_of_node("n1")] == ["s"]
        seq.close()
        coordinator.wait_idle()
        assert store.tenant_usage(TENANT) == 0
        assert store.sequences_of_node("n1") == []
        engine.check_integrity()
        # The node comes back empty: its keys leave the index (every shard), its open sequence is lost.
        kept = client.open("kept", PROMPT)
        coordinator.wait_idle()
        result = coordinator.register("n1", f"127.0.0.1:{node_port}", SPEC.to_dict(), 32, epoch=2)
        assert result.lost_seq_ids == ("kept",) and result.num_keys_purged == 10
        assert store.keys_of("n1") == set() and all(store.nodes_holding(k) == set() for k in stored)
        assert store.match_prefix(stored) == {"n1": 0}
        assert store.get_sequence("kept").state == "lost"
        with pytest.raises(SequenceLost, match="re-registered"):  # the worker learns it
            kept.close()
    finally:
        client.close()
        coord_server.stop(0)
        coordinator.stop()
        node_server.stop(0)
        store.close()
