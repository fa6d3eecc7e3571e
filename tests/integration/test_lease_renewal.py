"""A node keeps its lease while its coordinator answers beats slowly: the next beat is due an
interval after the last was sent, not after its answer came. A real CacheEngine's
CoordinatorLink and gate against a coordinator served in-process whose store takes 0.3 of the
lease to renew each beat (a loaded Redis, or a coordinator just restarted): with the beats
spaced from their answers the node fenced itself for a while in each lease."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from kvref import SPEC

from pagedkv.cache_node.coordinator_link import CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.gate import Gate, NodeTrust
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.service import create_server as create_coordinator_server

LEASE_S = 3.0  # a beat every 0.75 s; the node's lease runs 2.25 s from a renewal's send
SLOW_S = 0.9  # each renewal's answer: two in a row came 2.55 s after the first was sent


class SlowBeats(MemoryStore):
    """A store that takes SLOW_S to renew a lease (and counts the renewals)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_beats = 0

    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        time.sleep(SLOW_S)
        self.num_beats += 1
        return super().heartbeat(node_id, load, ttl_s)


def test_slow_beat_answers_never_fence_the_node() -> None:
    store = SlowBeats()
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=LEASE_S))
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants(), frame_port=0)
    server.start()
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    gate = Gate(NodeTrust(node_id="n1"))
    link = CoordinatorLink(engine, f"127.0.0.1:{port}", "n1", f"127.0.0.1:{node_port}", gate=gate).start()
    fenced_for = 0.0
    stop = threading.Event()
    try:
        assert link.is_registered.wait(10)
        assert link.heartbeat_interval_s == LEASE_S / 4
        start = time.monotonic()
        while time.monotonic() - start < 2.5 * LEASE_S:  # past three leases' worth of beats
            if gate.is_fenced:
                fenced_for += 0.01
            stop.wait(0.01)
        assert fenced_for == 0.0, f"the node fenced itself for {fenced_for:.2f}s, its beats answered"
        assert store.num_beats >= 6, store.num_beats  # the beats ran back to back, each renewing
    finally:
        link.stop()
        node_server.stop(0)
        server.stop(0)
        coordinator.stop()
