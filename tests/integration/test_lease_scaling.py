"""A lease that grows with the fleet (coordinator/lease_scale.py), end to end on a real Redis:
a coordinator served in-process (gRPC and its framed port) lengthens the lease once the
fleet's beats would pass its budget, a real node's CoordinatorLink takes it up from a beat's
reply (and the shorter one when the fleet shrinks), a renewal never runs shorter than the
lease the node holds, an older node keeps the configured lease, and no beat buys a lease past
the cap. Leases are read from Redis (PTTL of the node's alive key)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import grpc
import redis
from kvref import SPEC
from test_node_link_paced import until

from pagedkv.cache_node.coordinator_link import CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc

# A 1 s lease sized for 8 beats a second: 2 nodes stay on it (8), a third doubles it.
CONFIG = CoordinatorConfig(lease_ttl_s=1.0, max_beats_per_s=8)


def pttl_ms(redis_url: str, store: RedisStore, node_id: str) -> int:
    return int(redis.Redis.from_url(redis_url).pttl(f"{store.config.prefix}alive:{node_id}"))


@contextlib.contextmanager
def node_beating(redis_url: str) -> Iterator[tuple[RedisStore, Coordinator, CoordinatorLink]]:
    """A coordinator served in-process on a real Redis (CONFIG) and a real node "n1" whose
    CoordinatorLink registers and beats there."""
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CONFIG)
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants(), frame_port=0)
    server.start()
    engine = CacheEngine(EngineConfig(SPEC, 32, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    link = CoordinatorLink(engine, f"127.0.0.1:{port}", "n1", f"127.0.0.1:{node_port}").start()
    try:
        yield store, coordinator, link
    finally:
        link.stop()
        node_server.stop(0)
        server.stop(0)
        coordinator.stop()
        store.close()


def test_a_growing_fleet_gets_a_longer_lease_that_its_node_takes_up(redis_url: str) -> None:
    with node_beating(redis_url) as (store, coordinator, link):
        assert link.is_registered.wait(10)
        assert (link.lease_ttl_s, link.heartbeat_interval_s) == (1.0, 0.25)
        for i in range(2):  # 12 beats a second on the 1 s lease: over the budget
            coordinator.register(f"other{i}", "127.0.0.1:1", SPEC.to_dict(), 32, lease_s=60.0)
        assert coordinator.lease_s == 2.0
        held = lambda: (link.lease_ttl_s, link.heartbeat_interval_s)  # noqa: E731
        until(lambda: held() == (2.0, 0.5), 10, "the longer lease taken")
        until(lambda: pttl_ms(redis_url, store, "n1") > 1100, 10, "a renewal for the longer lease")
        for i in range(2):  # the fleet shrinks: 4 beats a second on a 1 s lease
            store.remove_node(f"other{i}")
        coordinator.refresh_nodes()
        assert coordinator.lease_s == 1.0
        until(lambda: held() == (1.0, 0.25), 10, "the shorter lease taken")
        until(lambda: pttl_ms(redis_url, store, "n1") <= 1000, 10, "renewals for the shorter lease")
        assert link.is_registered.is_set() and coordinator.node("n1") is not None


def test_a_renewal_runs_as_long_as_the_lease_its_node_holds(redis_url: str) -> None:
    """After the lease shortened, a node still holding the longer one is renewed for that (it
    fences itself by it), then takes the shorter one from the reply; no more than the cap."""
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CONFIG)
    try:
        coordinator.register("n1", "127.0.0.1:1", SPEC.to_dict(), 32, lease_s=1.0)
        beat = coordinator.heartbeat("n1", {"free_blocks": 32}, held_lease_s=4.0)
        assert beat.is_registered and beat.lease_s == 1.0  # what the reply hands out from now on
        assert 3000 < pttl_ms(redis_url, store, "n1") <= 4000
        coordinator.heartbeat("n1", {"free_blocks": 32}, held_lease_s=1.0)
        assert pttl_ms(redis_url, store, "n1") <= 1000
        # In one batch, one node's claim (a lapsed belief, or a lie) stretches no other's renewal
        coordinator.register("n2", "127.0.0.1:2", SPEC.to_dict(), 32, lease_s=1.0)
        beats = coordinator.heartbeats([("n1", {}, None), ("n2", {}, None)], [1e9, 1.0])
        assert all(b.is_registered and b.lease_s == 1.0 for b in beats)  # type: ignore[union-attr]
        assert 15_000 < pttl_ms(redis_url, store, "n1") <= 16_000  # the cap: 16 leases
        assert pttl_ms(redis_url, store, "n2") <= 1000
    finally:
        coordinator.stop()
        store.close()


def test_no_beat_buys_a_lease_past_the_cap_and_an_older_node_keeps_the_configured_one(
    redis_url: str,
) -> None:
    """Over gRPC as a hostile or buggy node would send them: a beat claiming a lease of 10^9 s,
    infinity, NaN or a negative one renews for at most the cap (16 leases) or the lease handed
    out, and is answered; a node registering without adapts_lease gets the configured lease
    while the fleet's is longer, one with it the longer one."""
    store = RedisStore(redis_url)
    coordinator = Coordinator(store, CONFIG)
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0", tenants=Tenants(), frame_port=0)
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        for i in range(3):
            coordinator.register(f"other{i}", "127.0.0.1:1", SPEC.to_dict(), 32, lease_s=60.0)
        assert coordinator.lease_s == 2.0
        spec = pb.ModelSpec(**SPEC.to_dict())
        older = stub.Register(
            pb.RegisterRequest(node_id="old", address="127.0.0.1:2", spec=spec, num_blocks=9)
        )
        assert (older.lease_ttl_s, older.heartbeat_interval_s) == (1.0, 0.25)
        assert pttl_ms(redis_url, store, "old") <= 1000
        newer = stub.Register(
            pb.RegisterRequest(
                node_id="new", address="127.0.0.1:3", spec=spec, num_blocks=9, adapts_lease=True
            )
        )
        assert (newer.lease_ttl_s, newer.heartbeat_interval_s) == (2.0, 0.5)
        assert 1000 < pttl_ms(redis_url, store, "new") <= 2000
        assert coordinator.lease_s == 4.0  # (five nodes: 10 beats a second on 2 s)
        for claim, most_ms in ((1e9, 16_000), (math.inf, 4000), (math.nan, 4000), (-5.0, 4000)):
            reply = stub.Heartbeat(pb.HeartbeatRequest(node_id="new", lease_ttl_s=claim))
            assert reply.is_registered and (reply.lease_ttl_s, reply.heartbeat_interval_s) == (4.0, 1.0)
            assert pttl_ms(redis_url, store, "new") <= most_ms, claim
        assert pttl_ms(redis_url, store, "other0") > 50_000  # nothing else touched
    finally:
        channel.close()
        server.stop(0)
        coordinator.stop()
        store.close()


def test_a_node_keeps_its_lease_when_a_reply_hands_out_nonsense(redis_url: str, monkeypatch) -> None:
    """A buggy coordinator's beat replies (an infinite lease, an interval no shorter than the
    lease) are not taken: the node keeps a finite lease and its fence stays ahead of it."""
    from pagedkv.coordinator.service import CoordinatorServicer

    honest = CoordinatorServicer._beat_reply
    nonsense = iter([(math.inf, 0.25), (1.0, 1.0), (0.5, 2.0), (-1.0, 0.25)] * 1000)

    def buggy(self, request, result):  # type: ignore[no-untyped-def]
        reply = pb.HeartbeatResponse()
        reply.CopyFrom(honest(self, request, result))
        reply.lease_ttl_s, reply.heartbeat_interval_s = next(nonsense)
        return reply

    monkeypatch.setattr(CoordinatorServicer, "_beat_reply", buggy)
    with node_beating(redis_url) as (store, coordinator, link):
        assert link.is_registered.wait(10)
        until(lambda: link.num_beats >= 6, 10, "six beats answered with nonsense")
        assert (link.lease_ttl_s, link.heartbeat_interval_s) == (1.0, 0.25)


def test_a_restarted_coordinator_hands_out_the_fleets_lease_again(redis_url: str) -> None:
    """A coordinator that dies with three nodes on a lengthened lease and starts again lists
    the fleet before its reaper's first tick, so it hands out the longer lease again rather
    than the configured one, and reaps none of the nodes that keep beating (here by hand)."""
    store = RedisStore(redis_url)
    first = Coordinator(store, CONFIG)
    for i in range(3):
        first.register(f"n{i}", f"127.0.0.1:{i + 1}", SPEC.to_dict(), 32, lease_s=first.lease_s)
    assert first.lease_s == 2.0
    first.stop()  # (its process gone: nothing of it is read again)
    again = Coordinator(RedisStore(redis_url), CONFIG).start(interval_s=0.05)
    try:
        until(lambda: again.lease_s == 2.0, 0.8, "the fleet's lease before the first tick (1 s in)")
        deadline = time.monotonic() + 3.0  # past a 2 s lease and its grace
        while time.monotonic() < deadline:
            for i in range(3):
                assert again.heartbeat(f"n{i}", {"free_blocks": 32}, held_lease_s=2.0).lease_s == 2.0
            time.sleep(0.2)
        assert again.num_live_nodes() == 3 and again.counters["nodes_reaped"] == 0
    finally:
        again.stop()
        store.close()
