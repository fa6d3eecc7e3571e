"""The coordinator's framed port with real sockets: the same answers and errors as its
gRPC port, the client's fallback to gRPC when the port is off or gone, the limits
that keep a connection from holding it (idle, trickle, per peer), and a node's events
reported one-way and settled by its beats. Real parts: the
coordinator's gRPC server and framed port on free ports, the embedded store, one
in-process cache node."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pagedkv.cache_node.coordinator_link import CoordinatorLink
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import create_server as create_node_server
from pagedkv.client import CacheClient, ClientConfig
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.service import FRAMED_METHODS, CoordinatorServicer
from pagedkv.coordinator.service import create_server as create_coordinator_server
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import wire
from pagedkv.protos.errors import InvalidArgument, SequenceExists
from pagedkv.protos.framed_server import FramedServer
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire.limits import BulkLimits

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
TENANTS = Tenants(tokens={"tok-a": "a"})
PROMPT = list(range(12))


@pytest.fixture
def stack():
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    coordinator.register("n1", f"127.0.0.1:{node_port}", SPEC.to_dict(), 64)
    servers = []

    def serve(frame_port: int | None = 0):
        server, port = create_coordinator_server(
            coordinator, "127.0.0.1:0", tenants=TENANTS, frame_port=frame_port
        )
        servers.append(server.start())
        return server, f"127.0.0.1:{port}"

    yield coordinator, engine, serve
    for server in servers:
        server.stop(0)
    coordinator.stop()
    node_server.stop(0)


def client(address: str, frames: bool = True) -> CacheClient:
    return CacheClient(
        coordinator=address, token="tok-a", spec=SPEC, config=ClientConfig(coordinator_frames=frames)
    )


def test_frames_and_grpc_answer_alike(stack) -> None:
    _, engine, serve = stack
    _, address = serve()
    errors = {}
    for frames in (True, False):
        with client(address, frames) as c:
            name = f"s-{frames}"
            c.open(name, PROMPT).close()  # (the first open learns the port)
            seq = c.open(name, PROMPT)
            with pytest.raises(SequenceExists) as exists:
                c.open(name, PROMPT)
            seq.close()
            with pytest.raises(InvalidArgument) as missing:
                c.routing._call("Close", pb.CoordSeqRequest(seq_id=""), None)
            framed = c.routing.framed
            assert (framed.num_calls >= 4) if frames else framed is None
            assert exists.value.seq_id == name  # the tenant's scope taken off, as gRPC does
            errors[frames] = (str(exists.value).replace(name, "X"), str(missing.value))
    assert errors[True] == errors[False]
    assert "a/" not in errors[True][0] and "seq_id is required" in errors[True][1]
    assert not engine.manager.seqs  # every sequence freed on the node


def test_without_a_framed_port_grpc_carries_everything(stack) -> None:
    _, _, serve = stack
    _, address = serve(frame_port=None)
    with client(address) as c:
        for i in range(3):
            c.open(f"g{i}", PROMPT).close()
        assert c.routing.framed.port == 0 and c.routing.framed.num_calls == 0


def test_a_framed_port_that_went_away_falls_back_to_grpc(stack) -> None:
    _, engine, serve = stack
    server, address = serve()
    with client(address) as c:
        c.open("f0", PROMPT).close()
        framed = c.routing.framed
        assert framed.num_calls == 1  # the close (the open learned the port)
        server.companions[0].stop()
        c.open("f1", PROMPT).close()  # refused at connect: gRPC carries both
        c.open("f2", PROMPT).close()  # and the port is left alone for a while
        assert framed.num_calls == 1 and framed.num_fallbacks == 1
    assert not engine.manager.seqs


def test_a_restarted_coordinators_new_port_is_learned(stack) -> None:
    _, _, serve = stack
    first, address = serve()
    with client(address) as c:
        c.open("r0", PROMPT).close()
        old = c.routing.framed.port
        first.companions[0].stop()
        c.open("r1", PROMPT).close()  # falls back; the gRPC reply names the same (dead) port
        assert c.routing.framed.port == old and not c.routing.framed.is_usable  # (backing off)
        second, _ = serve()
        c.routing.framed.learn(second.companions[0].port)
        assert c.routing.framed.is_usable
        calls = c.routing.framed.num_calls
        c.open("r2", PROMPT).close()
        assert c.routing.framed.num_calls == calls + 2


@pytest.fixture
def limited(stack):
    coordinator, _, _ = stack
    servicer = CoordinatorServicer(coordinator, TENANTS, CoordinatorMetrics(coordinator))
    limits = BulkLimits(max_per_peer=2, idle_timeout_s=0.4, frame_timeout_s=0.4, min_bytes_per_s=1 << 20)
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    server = FramedServer(servicer, service, pb, FRAMED_METHODS, limits=limits).start()
    yield server
    server.stop()


def ping(sock: socket.socket) -> bool:
    sock.sendall(wire.Frame(wire.OP_PING, 1).pack())
    return wire.read_reply(sock).status == wire.Status.OK


def test_an_idle_or_trickling_connection_is_closed(limited: FramedServer) -> None:
    idle = socket.create_connection(("127.0.0.1", limited.port))
    assert ping(idle)
    time.sleep(0.8)
    assert idle.recv(1) == b""  # idle past its timeout
    trickle = socket.create_connection(("127.0.0.1", limited.port))
    header = wire.Frame(wire.OP_PING, 2).pack()
    start = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for byte in header:
            trickle.sendall(bytes([byte]))
            time.sleep(0.1)
    assert time.monotonic() - start < 3
    fresh = socket.create_connection(("127.0.0.1", limited.port))
    assert ping(fresh)  # the port keeps serving


def test_connections_per_peer_are_capped(limited: FramedServer) -> None:
    held = [socket.create_connection(("127.0.0.1", limited.port)) for _ in range(2)]
    assert all(ping(s) for s in held)
    extra = socket.create_connection(("127.0.0.1", limited.port))
    extra.settimeout(2)
    assert extra.recv(1) == b""  # closed at once: a client takes gRPC
    held[0].close()
    time.sleep(0.1)
    again = socket.create_connection(("127.0.0.1", limited.port))
    assert ping(again)


def test_a_closed_id_reopens_at_once_with_the_same_prompt(stack) -> None:
    """Each open's signed node order is distinct (its request id): the same id and prompt
    opened again within the second its close took is a new order, not a replay."""
    _, engine, serve = stack
    _, address = serve()
    with client(address) as c:
        for _ in range(3):
            seq = c.open("again", PROMPT)
            assert c.routing.node_opens.failure("again") is None
            assert seq.read_kv()[0].shape[1] == 0  # its node holds it
            seq.close()
    assert not engine.manager.seqs


@pytest.fixture
def linked():
    """A coordinator (1 s lease) serving gRPC and its framed port, and a node's engine and
    server; `link(one_way_reports)` starts the node's CoordinatorLink to it."""
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=1.0))
    server, port = create_coordinator_server(coordinator, "127.0.0.1:0")
    server.start()
    coordinator.start()
    engine = CacheEngine(EngineConfig(SPEC, 16, device="cpu"))
    node_server, node_port = create_node_server(engine, "127.0.0.1:0")
    node_server.start()
    links: list[CoordinatorLink] = []

    def link(one_way_reports: bool = True) -> CoordinatorLink:
        addresses = f"127.0.0.1:{port}", "n2", f"127.0.0.1:{node_port}"
        links.append(CoordinatorLink(engine, *addresses, one_way_reports=one_way_reports).start())
        assert links[-1].is_registered.wait(10)
        return links[-1]

    yield coordinator, server, engine, link
    for started in links:
        started.stop()
    node_server.stop(0)
    server.stop(0)
    coordinator.stop()


def test_a_nodes_beats_and_events_take_the_framed_port_and_fall_back(linked) -> None:
    coordinator, server, engine, start_link = linked
    link = start_link()
    framed = link._framed
    assert framed.port == server.companions[0].port
    engine.open("s", list(range(8)))
    engine.append("s", list(range(8)), *kv(8))
    deadline = time.monotonic() + 10
    while framed.num_calls + framed.num_notified < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert framed.num_calls >= 1 and framed.num_notified >= 1  # a beat and the stored blocks' events
    server.companions[0].stop()
    beats = link.num_beats
    while link.num_beats < beats + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert link.num_beats >= beats + 3 and framed.num_fallbacks == 1  # gRPC carries them
    assert coordinator.live_node("n2") is not None and link.num_registrations == 1


@pytest.mark.parametrize("one_way", [True, False], ids=["one-way", "two-way"])
def test_a_nodes_events_go_one_way_and_its_beats_settle_them(linked, one_way: bool) -> None:
    coordinator, server, engine, start_link = linked
    link = start_link(one_way)
    for i in range(3):
        tokens = list(range(i * 100, i * 100 + 8))
        engine.open(f"s{i}", tokens)
        engine.append(f"s{i}", tokens, *kv(8))
        time.sleep(0.03)  # a report each
    box = link.outbox
    deadline = time.monotonic() + 5
    while (box.last < 6 or box.pending) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert box.last >= 6 and not box.pending  # every event applied and settled
    assert coordinator.store.keys_of("n2") == set(engine.manager.device.block_of_key)
    framed, port_server = link._framed, server.companions[0]
    if one_way:
        assert framed.num_notified >= 3 and port_server.num_one_way == framed.num_notified
        assert framed.num_calls <= link.num_beats  # every call a beat: no report asked how far
    else:
        assert framed.num_notified == 0 and port_server.num_one_way == 0


def kv(n: int):
    shape = (SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.zeros(shape), torch.zeros(shape)


def test_the_framing_caps_calls_as_grpc_caps_messages() -> None:
    """frame.py keeps its own copy of gRPC's message cap (it stays torch-free): the same."""
    from pagedkv.protos import tensors

    assert wire.MAX_CALL_BYTES == tensors.MAX_MESSAGE_BYTES
