"""A node's link to the coordinator's framed port is served in turns: a real CacheEngine's
CoordinatorLink beats and reports one-way to a coordinator served in-process (gRPC and its
framed port); its requests say they may wait (LINK_WAIT_S), so the coordinator's loop serves
that link in turns, and every event it reports still reaches the store."""

from __future__ import annotations

import time

import torch
from kvref import SPEC

from pagedkv.cache_node.coordinator_link import LINK_WAIT_S, CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos.framed_loop import PACE_S


def until(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.02)


def test_a_nodes_link_is_served_in_turns_and_its_events_arrive() -> None:
    assert LINK_WAIT_S >= PACE_S  # (else the link would never be paced)
    store = MemoryStore()
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=2))
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants(), frame_port=0)
    server.start()
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    link = CoordinatorLink(engine, f"127.0.0.1:{port}", "n1", f"127.0.0.1:{node_port}").start()
    loop = server.companions[0]._loop
    try:
        assert link.is_registered.wait(10)
        until(lambda: loop.num_paced == 1, 10, "the node's link served in turns")
        tokens = list(range(3 * SPEC.block_size))
        shape = (SPEC.num_layers, len(tokens), SPEC.num_kv_heads, SPEC.head_dim)
        engine.open("s", tokens)
        engine.append("s", tokens, torch.randn(shape), torch.randn(shape))
        until(lambda: link._framed.num_notified > 0, 10, "a report sent one-way")
        until(lambda: store.keys_of("n1") == set(engine.manager.device.block_of_key), 10, "events applied")
        assert store.keys_of("n1") and loop.num_paced == 1
    finally:
        link.stop()
        node_server.stop(0)
        server.stop(0)
        coordinator.stop()
