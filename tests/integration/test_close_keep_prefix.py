"""close(keep_prefix=k) over the wire: the end-of-conversation hint reaches the node through the
coordinator (cluster mode) or straight (direct mode), the node drops the blocks past k, and the
coordinator's prefix index follows its REMOVED events. Real gRPC servers and a real Redis."""

from __future__ import annotations

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, InvalidArgument
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
SYSTEM = list(range(16))  # 4 blocks: what every conversation starts with
TURN = SYSTEM + list(range(100, 124))  # + 6 blocks of this conversation


def kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)


@pytest.fixture
def node():
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    server, port = create_node_server(engine, "127.0.0.1:0")
    server.start()
    yield engine, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture
def cluster(node, redis_url):
    engine, address = node
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=30))
    coordinator.register("n1", address, SPEC.to_dict(), 32)
    coordinator.heartbeat("n1", {"free_blocks": 32, "used_blocks": 0})
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants())
    server.start()
    client = CacheClient(coordinator=f"127.0.0.1:{port}", spec=SPEC)
    yield engine, coordinator, client
    client.close()
    server.stop(0)
    coordinator.stop()
    store.close()


def report(coordinator: Coordinator, engine: CacheEngine) -> None:
    """What the node's CoordinatorLink sends within ~10 ms of new events."""
    events = engine.take_events()
    coordinator.report_events("n1", [(1 if e.kind == "stored" else 2, e.key) for e in events])


def test_the_hint_drops_the_conversation_and_the_index_keeps_the_system_prompt(cluster):
    engine, coordinator, client = cluster
    seq = client.open("chat-1", TURN)
    seq.append(TURN, kv(len(TURN)), kv(len(TURN)))
    coordinator.wait_idle()
    report(coordinator, engine)
    assert client.lookup(TURN + [1]) == len(TURN)
    seq.close(keep_prefix=len(SYSTEM))
    coordinator.wait_idle()  # the node's Free runs in the background
    assert engine.lookup(TURN, coordinator.store.tenant_salt("default")) == len(SYSTEM)
    assert engine.stats()["dropped_on_close"] == 6 and engine.stats()["num_sequences"] == 0
    report(coordinator, engine)
    assert client.lookup(TURN + [1]) == len(SYSTEM)  # the index forgot the conversation too
    engine.check_integrity()


def test_a_negative_hint_is_refused_before_anything_is_freed(cluster):
    engine, coordinator, client = cluster
    seq = client.open("chat-1", TURN)
    seq.append(TURN, kv(len(TURN)), kv(len(TURN)))
    with pytest.raises(InvalidArgument, match="keep_prefix must be >= 0 tokens, got -4"):
        seq.close(keep_prefix=-4)
    assert not seq.is_closed and seq.read_kv()[0].shape[1] == len(TURN)  # nothing lost
    # a client that skips the check reaches the coordinator, which refuses it the same way
    with pytest.raises(InvalidArgument, match="keep_prefix must be >= 0 tokens, got -4"):
        client.routing.close("chat-1", None, -4)
    assert seq.read_kv()[0].shape[1] == len(TURN)
    seq.close()
    coordinator.wait_idle()
    salt = coordinator.store.tenant_salt("default")
    assert engine.stats()["num_sequences"] == 0 and engine.lookup(TURN, salt) == len(TURN)
    engine.check_integrity()


def test_direct_mode_carries_the_hint_to_the_node(node):
    engine, address = node
    with CacheClient(address, spec=SPEC) as client:
        seq = client.open("chat-1", TURN)
        seq.append(TURN, kv(len(TURN)), kv(len(TURN)))
        assert engine.lookup(TURN) == len(TURN)
        seq.close(keep_prefix=0)
        assert engine.lookup(TURN) == 0 and engine.stats()["dropped_on_close"] == 10
        # the node checks it too (a client that skips its own check)
        seq = client.open("chat-2", TURN)
        seq.append(TURN, kv(len(TURN)), kv(len(TURN)))
        with pytest.raises(InvalidArgument, match="keep_prefix must be >= 0 tokens, got -1"):
            client.routing.close("chat-2", None, -1)
        assert seq.read_kv()[0].shape[1] == len(TURN)  # still open, nothing lost
        seq.close()
    assert engine.stats()["num_sequences"] == 0
    engine.check_integrity()
