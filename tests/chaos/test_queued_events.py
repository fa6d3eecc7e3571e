"""A coordinator SIGKILLed with a node's block events queued and not yet applied (it
gathers a stream of reports for a minute before applying them): its successor on the same
port asks the node for them again, and the prefix index ends equal to what the node's pool
holds. Reported one-way (as a node does where the coordinator takes them so: the node
learns what was lost from its next beat) or as calls. Real parts: redis-server, `pagedkv
coordinator` processes, an in-process cache node with its CoordinatorLink over gRPC and
the framed port."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch

from pagedkv.cache_node.coordinator_link import CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.cluster import free_port
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos.spec import ModelSpec

pytestmark = pytest.mark.timeout(120)
SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)


def coordinator(port: int, redis_url: str, log, flush_s: float = 0.002) -> subprocess.Popen:
    args = ["--listen", f"127.0.0.1:{port}", "--redis", redis_url, "--lease-ttl-s", "20"]
    args += ["--event-flush-s", str(flush_s)]
    proc = subprocess.Popen([sys.executable, "-m", "pagedkv", "coordinator", *args], stdout=log, stderr=log)
    grpc.channel_ready_future(grpc.insecure_channel(f"127.0.0.1:{port}")).result(timeout=30)
    return proc


def prompts(engine: CacheEngine, first: int, last: int) -> None:
    """Prompts of 3 blocks each, stored then released: a 32-block pool evicts the oldest."""
    for i in range(first, last):
        tokens = [i * 1000 + j for j in range(12)]
        shape = (SPEC.num_layers, len(tokens), SPEC.num_kv_heads, SPEC.head_dim)
        engine.open(f"s{i}", tokens)
        engine.append(f"s{i}", tokens, torch.randn(shape), torch.randn(shape))
        engine.free(f"s{i}")


def until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)


@pytest.mark.parametrize("one_way", [True, False], ids=["one-way", "two-way"])
def test_events_queued_by_a_killed_coordinator_reach_the_index_through_its_successor(
    tmp_path, redis_url, one_way: bool
) -> None:
    port = free_port()
    log = open(tmp_path / "coordinator.log", "ab")  # noqa: SIM115 - closed at the end
    first = coordinator(port, redis_url, log, flush_s=60.0)  # a report after the first waits a minute
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    link = CoordinatorLink(
        engine, f"127.0.0.1:{port}", "n1", f"127.0.0.1:{node_port}", one_way_reports=one_way
    ).start()
    store = RedisStore(redis_url)
    box = link.outbox
    second = None
    try:
        assert link.is_registered.wait(20)
        for i in range(20):  # 20 prompts x 3 blocks through a 32-block pool: REMOVED events too
            prompts(engine, i, i + 1)
            time.sleep(0.02)  # a report each (the link sends at most every 10 ms)
        until(lambda: box.sent == box.last > 0, 20, "every event queued")
        applied = store.applied_seq("n1", link.epoch)
        assert 0 < applied < box.last  # the first report was applied at once, the rest wait
        until(lambda: box.first == applied + 1, 15, "a reply (one-way: a beat's) said what was applied")
        assert box.first == applied + 1 and box.pending  # the node keeps what is not applied
        assert (link._framed.num_notified >= 10) == one_way
        assert store.keys_of("n1") != set(engine.manager.device.block_of_key)
        first.send_signal(signal.SIGKILL)
        first.wait(10)

        second = coordinator(port, redis_url, log)  # the same port, the same store
        until(lambda: not box.pending, 30, "the queued events resent and applied")
        assert store.applied_seq("n1", link.epoch) == box.last
        assert store.keys_of("n1") == set(engine.manager.device.block_of_key)
        assert link.num_registrations == 1  # the node never left the cluster
        stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        counters = stub.Stats(pb.Empty(), timeout=10).counters  # the successor's
        assert counters["events_applied"] >= box.last - applied and counters["events_queued"] == 0
    finally:
        link.stop()
        node_server.stop(0)
        store.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        log.close()
