"""The framed port's one-thread loop for node links, with real sockets: a connection moves
there after a beat or a report and is answered as its thread answered it (in order, every
report taken, calls and pings interleaved); what the server refuses by its header is
answered and that connection alone closed; a request that stalls, a connection gone idle,
and one asking for a worker's method are dealt with as the limits say; stop() ends them.
Real parts: a coordinator on the embedded store, its servicer behind a FramedServer on a
free port with the coordinator's node-link methods, raw client sockets."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_framed_one_way import until

from pagedkv.coordinator.auth import ClusterAccess, Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.service import (
    FRAMED_METHODS,
    LOOP_METHODS,
    NODE_LINK_METHODS,
    CoordinatorServicer,
)
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos import wire
from pagedkv.protos.framed_loop import PACE_S, READ_BYTES
from pagedkv.protos.framed_server import FramedServer
from pagedkv.protos.prompt import pack
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire.limits import BulkLimits
from pagedkv.protos.wire.unary import encode_unary

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
EPOCH = 5
KEYS = [bytes([i % 256, i // 256]) * 8 for i in range(400)]
NODES = ("n1", "n2")
WAIT_S = 0.01  # what a node's beats and reports allow (CoordinatorLink's LINK_WAIT_S)


def serve(
    limits: BulkLimits,
    access: ClusterAccess | None = None,
    loop_methods=LOOP_METHODS,
    nodes: dict[str, str] | None = None,
):
    config = CoordinatorConfig(lease_ttl_s=30, access=access or ClusterAccess())
    coordinator = Coordinator(MemoryStore(), config)
    for n, address in (nodes or dict.fromkeys(NODES, "127.0.0.1:1")).items():
        coordinator.register(n, address, SPEC.to_dict(), 64, EPOCH)
    servicer = CoordinatorServicer(coordinator, Tenants(), CoordinatorMetrics(coordinator))
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    server = FramedServer(
        servicer,
        service,
        pb,
        FRAMED_METHODS,
        limits=limits,
        one_way=servicer.one_way_handlers(),
        loop_methods=loop_methods,
        batches={k: v for k, v in servicer.batches().items() if k in loop_methods},  # (as the coordinator's)
    )
    return coordinator, server.start()


@pytest.fixture
def served():
    coordinator, server = serve(BulkLimits(idle_timeout_s=30, frame_timeout_s=0.4, min_bytes_per_s=1 << 20))
    yield coordinator, server
    server.stop()
    coordinator.stop()


def connect(server: FramedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def report(
    node: str, seq: int, key: bytes, request_id: int = 1, op: int = wire.OP_NOTIFY, wait_s: float = 0.0
) -> bytes:
    message = pb.ReportEventsRequest(
        node_id=node, events=[pb.BlockEvent(kind=pb.BlockEvent.STORED, key=key)], epoch=EPOCH, first_seq=seq
    )
    return encode_unary(request_id, "ReportEvents", b"", message.SerializeToString(), op, wait_s)


def beat(node: str, request_id: int, free: int = 60, wait_s: float = 0.0) -> bytes:
    message = pb.HeartbeatRequest(node_id=node, events_epoch=EPOCH)
    message.load.free_blocks = free
    return encode_unary(request_id, "Heartbeat", b"", message.SerializeToString(), wire.OP_UNARY, wait_s)


def reply(sock: socket.socket, message: type) -> tuple[wire.Frame, object]:
    head = wire.read_reply(sock)
    body = wire.recv_bytes(sock, head.payload_len, "reply") if head.payload_len else b""
    return head, (message.FromString(body) if head.status == wire.Status.OK else None)


def is_closed(sock: socket.socket) -> bool:
    try:
        while data := sock.recv(4096):
            del data  # (replies sent before the close)
        return True
    except ConnectionError:
        return True


def frame_threads() -> int:
    return sum(t.name == "frame-conn" for t in threading.enumerate())


def adopted(server: FramedServer) -> int:
    assert server._loop is not None
    return server._loop.num_links


@pytest.mark.parametrize("waits", [(0.0,), (WAIT_S,), (0.0, WAIT_S)], ids=["at-once", "paced", "mixed"])
def test_a_node_link_moves_to_the_loop_and_is_answered_in_order(served, waits) -> None:
    """Beats, one-way reports and pings of two nodes, sent in streams cut at random points:
    each connection leaves its thread after its first node call, every report is taken in
    order, and every reply comes back in its request's order; so too when the requests may
    wait (the link served in turns), and when each says at random whether it may (the link
    moved back and forth between the loop's two ways of serving)."""
    coordinator, server = served
    rng = random.Random(5)
    socks = [connect(server) for _ in NODES]
    streams = []
    for i, node in enumerate(NODES):
        parts = [beat(node, 1, wait_s=rng.choice(waits))]
        for k in range(150):
            parts.append(report(node, k + 1, KEYS[k + 200 * i], wait_s=rng.choice(waits)))
            if k % 50 == 49:
                parts.append(beat(node, 2 + k // 50, free=60 - k // 50, wait_s=rng.choice(waits)))
        parts.append(wire.Frame(wire.OP_PING, 99).pack())
        streams.append(b"".join(parts))
    at = [0, 0]
    while any(a < len(s) for a, s in zip(at, streams, strict=True)):
        for i, sock in enumerate(socks):
            cut = min(len(streams[i]), at[i] + rng.randint(1, 900))
            sock.sendall(streams[i][at[i] : cut])
            at[i] = cut
    for node, sock in zip(NODES, socks, strict=True):
        ids = []
        for _ in range(4):
            head, answer = reply(sock, pb.HeartbeatResponse)
            assert head.status == wire.Status.OK, head.text
            assert answer.is_registered
            ids.append(head.request_id)
        assert ids == [1, 2, 3, 4]
        assert wire.read_reply(sock).request_id == 99
        assert coordinator.events_acknowledged(node, EPOCH)[1] == 151  # every report taken
    assert adopted(server) == 2 and frame_threads() == 0
    assert coordinator.node("n1").load == {"free_blocks": 58}  # the last beat's load
    for sock in socks:
        sock.close()
    until(lambda: adopted(server) == 0 and not server._conns, "links closed by their peers released")


def test_a_request_refused_by_its_header_closes_that_link_alone(served) -> None:
    coordinator, server = served
    with connect(server) as bad, connect(server) as good:
        for sock, node in ((bad, "n1"), (good, "n2")):
            sock.sendall(beat(node, 1))
            assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
        until(lambda: adopted(server) == 2, "both adopted")
        bad.sendall(wire.Frame(wire.OP_UNARY, 7, text="Heartbeat", payload_len=1 << 30).pack())
        head = wire.read_reply(bad)
        assert (head.request_id, head.status) == (7, wire.Status.INVALID_ARGUMENT)
        assert "byte request" in head.text
        assert is_closed(bad)
        good.sendall(beat("n2", 2))
        assert reply(good, pb.HeartbeatResponse)[1].is_registered  # the other link is served
        good.sendall(b"XXXX" + bytes(wire.FRAME.size))  # not a frame: dropped, nothing answered
        assert is_closed(good)
    until(lambda: adopted(server) == 0 and not server._conns, "slots released")
    with connect(server) as fresh:  # the port keeps serving
        fresh.sendall(beat("n1", 1))
        assert reply(fresh, pb.HeartbeatResponse)[1].is_registered


def test_a_method_the_loop_does_not_serve_is_refused_and_the_link_kept() -> None:
    """A port whose loop serves only node links (the coordinator's serves every framed method)."""
    coordinator, server = serve(BulkLimits(idle_timeout_s=30), loop_methods=NODE_LINK_METHODS)
    with connect(server) as sock:
        sock.sendall(beat("n1", 1))
        reply(sock, pb.HeartbeatResponse)
        until(lambda: adopted(server) == 1, "adopted")
        open_request = pb.CoordOpenRequest(seq_id="s", token_ids=[1, 2, 3])
        sock.sendall(encode_unary(2, "Open", b"", open_request.SerializeToString(), wire.OP_UNARY))
        head = wire.read_reply(sock)
        assert (head.request_id, head.status) == (2, wire.Status.INVALID_ARGUMENT)
        assert "not served on a node's link" in head.text
        assert coordinator.counters["opens"] == 0
        sock.sendall(beat("n1", 3))
        assert reply(sock, pb.HeartbeatResponse)[0].request_id == 3
    server.stop()
    coordinator.stop()


def test_a_stalled_request_and_an_idle_link_are_closed() -> None:
    coordinator, server = serve(BulkLimits(idle_timeout_s=1.0, frame_timeout_s=0.3, min_bytes_per_s=1 << 20))
    try:
        with connect(server) as stalled, connect(server) as idle:
            for sock, node in ((stalled, "n1"), (idle, "n2")):
                sock.sendall(beat(node, 1))
                reply(sock, pb.HeartbeatResponse)
            until(lambda: adopted(server) == 2, "adopted")
            stalled.sendall(beat("n1", 2)[:-3])  # its last bytes never come
            start = time.monotonic()
            assert is_closed(stalled)
            assert time.monotonic() - start < 1.0 + 0.5  # the frame deadline, within a sweep
            until(lambda: adopted(server) == 1, "the stalled link released")
            assert is_closed(idle)  # nothing sent for idle_timeout_s
            until(lambda: adopted(server) == 0 and not server._conns, "the idle link released")
    finally:
        server.stop()
        coordinator.stop()


def test_stop_ends_every_link_and_the_loop() -> None:
    coordinator, server = serve(BulkLimits(idle_timeout_s=30))
    socks = [connect(server) for _ in range(5)]
    for i, sock in enumerate(socks):
        sock.sendall(beat(NODES[i % 2], 1))
        reply(sock, pb.HeartbeatResponse)
    until(lambda: adopted(server) == 5, "adopted")
    server.stop()
    coordinator.stop()
    for sock in socks:
        assert is_closed(sock)
        sock.close()
    assert not any(t.name == "frame-loop" for t in threading.enumerate())


def test_a_store_that_fails_a_beat_fails_the_next_at_once() -> None:
    """One thread serves every link: after a beat's store call failed, beats fail without
    waiting on the store for BEAT_RETRY_S, then try it again."""
    from pagedkv.coordinator.membership import BEAT_RETRY_S
    from pagedkv.protos.errors import Unavailable

    class Failing(MemoryStore):
        calls = 0
        is_down = False

        def heartbeat(self, node_id, load, ttl_s):
            Failing.calls += 1
            if Failing.is_down:
                raise Unavailable("store down")
            return super().heartbeat(node_id, load, ttl_s)

    coordinator = Coordinator(Failing(), CoordinatorConfig(lease_ttl_s=30))
    coordinator.register("n1", "127.0.0.1:1", SPEC.to_dict(), 64, EPOCH)
    try:
        Failing.is_down = True
        with pytest.raises(Unavailable):
            coordinator.heartbeat("n1", {"free_blocks": 1})
        with pytest.raises(Unavailable, match="beat again"):
            coordinator.heartbeat("n1", {"free_blocks": 1})
        assert Failing.calls == 1  # the second did not wait on the store
        Failing.is_down = False
        time.sleep(BEAT_RETRY_S + 0.05)
        assert coordinator.heartbeat("n1", {"free_blocks": 1})[0]
        assert Failing.calls == 2
    finally:
        coordinator.stop()


def test_only_a_node_call_that_succeeded_moves_its_link(served) -> None:
    """A beat the servicer refuses (a load counter below 0) or a report it fails (another
    registration) leaves the connection on its thread: a failed call earns no link."""
    coordinator, server = served
    with connect(server) as sock:
        bad = pb.HeartbeatRequest(node_id="n1")
        bad.load.free_blocks = -1
        sock.sendall(encode_unary(1, "Heartbeat", b"", bad.SerializeToString(), wire.OP_UNARY))
        assert wire.read_reply(sock).status == wire.Status.INVALID_ARGUMENT
        stale = pb.ReportEventsRequest(node_id="n1", epoch=EPOCH + 1, first_seq=1)
        sock.sendall(encode_unary(2, "ReportEvents", b"", stale.SerializeToString(), wire.OP_NOTIFY))
        sock.sendall(wire.Frame(wire.OP_PING, 3).pack())
        assert wire.read_reply(sock).request_id == 3
        assert adopted(server) == 0 and frame_threads() == 1
        sock.sendall(beat("n1", 4))
        assert reply(sock, pb.HeartbeatResponse)[1].is_registered
        until(lambda: adopted(server) == 1 and frame_threads() == 0, "adopted after a beat that worked")


def test_links_leave_the_thread_cap() -> None:
    """max_connections bounds the port's threads, not the links the loop serves."""
    coordinator, server = serve(BulkLimits(max_connections=2, idle_timeout_s=30))
    links, plain = [], []
    try:
        for i in range(3):
            sock = connect(server)
            sock.sendall(beat(NODES[i % 2], 1))
            assert reply(sock, pb.HeartbeatResponse)[1].is_registered
            links.append(sock)
            until(lambda n=i + 1: adopted(server) == n, "adopted")
        for _ in range(2):  # two threads' worth of workers' connections still come in
            sock = connect(server)
            sock.sendall(wire.Frame(wire.OP_PING, 7).pack())
            assert wire.read_reply(sock).request_id == 7
            plain.append(sock)
        over = connect(server)  # a third thread: refused (the client would take gRPC)
        assert is_closed(over)
        over.close()
        links[0].sendall(beat("n1", 2))
        assert reply(links[0], pb.HeartbeatResponse)[0].request_id == 2
    finally:
        for sock in links + plain:
            sock.close()
        server.stop()
        coordinator.stop()


def test_a_server_raises_its_open_files_limit_to_the_hard_one() -> None:
    import resource

    from pagedkv.protos.serving import raise_open_files_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 256), hard))
    try:
        got = raise_open_files_limit()
        want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        assert got == want == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


SERVER_WITH_FEW_DESCRIPTORS = """
import os, resource, sys, time
from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.service import FRAMED_METHODS, NODE_LINK_METHODS
from pagedkv.coordinator.service import CoordinatorServicer
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.framed_loop import PACE_S, READ_BYTES
from pagedkv.protos.framed_server import FramedServer
coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
servicer = CoordinatorServicer(coordinator, Tenants(), CoordinatorMetrics(coordinator))
service = pb.DESCRIPTOR.services_by_name["Coordinator"]
server = FramedServer(servicer, service, pb, FRAMED_METHODS, one_way=servicer.one_way_handlers(),
                      loop_methods=NODE_LINK_METHODS).start()
spare = len(os.listdir("/proc/self/fd")) + 2  # two connections fit, a third does not
resource.setrlimit(resource.RLIMIT_NOFILE, (spare, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(server.port, flush=True)
sys.stdin.readline()
"""


def test_the_port_accepts_again_once_descriptors_are_free() -> None:
    """Out of descriptors, accept() fails (EMFILE): the port waits and accepts once some are
    back, instead of its accepting thread ending (every later client falling back to gRPC)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER_WITH_FEW_DESCRIPTORS],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(proc.stdout.readline())
        held = []
        for _ in range(2):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(wire.Frame(wire.OP_PING, 1).pack())
            assert wire.read_reply(sock).request_id == 1
            held.append(sock)
        late = socket.create_connection(("127.0.0.1", port), timeout=5)  # in the backlog
        late.sendall(wire.Frame(wire.OP_PING, 2).pack())
        time.sleep(0.5)  # accept fails meanwhile, more than once
        held.pop().close()  # a descriptor back
        assert wire.read_reply(late).request_id == 2
        late.close()
        for sock in held:
            sock.close()
    finally:
        proc.stdin.close()
        proc.wait(10)
    assert "cannot accept" in proc.stderr.read()


def test_links_still_count_against_their_peers_cap() -> None:
    """max_per_peer holds for links moved to the loop: five links from three addresses (each
    its first beat answered), then a third connection from an address that holds two is
    closed unanswered (its client takes gRPC)."""
    coordinator, server = serve(BulkLimits(max_per_peer=2, idle_timeout_s=30))

    def connect_from(host: str) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port), 5, (host, 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    socks = [connect_from(f"127.0.0.{2 + i // 2}") for i in range(5)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(beat(NODES[i % 2], 1))
            assert reply(sock, pb.HeartbeatResponse)[1].is_registered
        until(lambda: adopted(server) == 5, "five links from three addresses")
        crowded = connect_from("127.0.0.2")  # its third
        with contextlib.suppress(ConnectionError):  # (closed already)
            crowded.sendall(beat("n1", 1))
        assert is_closed(crowded)
        crowded.close()
    finally:
        for sock in socks:
            sock.close()
        server.stop()
        coordinator.stop()


def test_a_link_checks_every_calls_credential() -> None:
    """With a cluster secret (no TLS: links move to the loop), a link that moved there still
    checks each call's node ticket: none, a forged one or another node's is refused, changes
    nothing of the node (its load, its events) and leaves the link usable; a first call
    refused so earns no link."""
    from pagedkv.protos.tickets import RIGHT_NODE, TICKET_KEY, ClusterKeys, Minter
    from pagedkv.protos.wire.unary import encode_metadata

    keys = ClusterKeys([b"the cluster's own secret, long enough ......"])
    forger = ClusterKeys([b"a secret the attacker made up ................."])

    def ticket(keyring: ClusterKeys, node: str) -> bytes:
        return encode_metadata([(TICKET_KEY, Minter(keyring, ttl_s=60).get(RIGHT_NODE, node))])

    coordinator, server = serve(BulkLimits(idle_timeout_s=30), ClusterAccess(keys))

    def beat_with(meta: bytes, request_id: int, free: int) -> bytes:
        message = pb.HeartbeatRequest(node_id="n1")
        message.load.free_blocks = free
        return encode_unary(request_id, "Heartbeat", meta, message.SerializeToString(), wire.OP_UNARY)

    try:
        with connect(server) as stranger:  # refused first: stays on its thread
            stranger.sendall(beat_with(ticket(forger, "n1"), 1, 1))
            assert wire.read_reply(stranger).status == wire.Status.UNAUTHENTICATED
            assert adopted(server) == 0 and frame_threads() == 1
        with connect(server) as sock:
            sock.sendall(beat_with(ticket(keys, "n1"), 1, 50))
            assert reply(sock, pb.HeartbeatResponse)[1].is_registered
            until(lambda: adopted(server) == 1, "the genuine node's link moved")
            for i, (meta, status) in enumerate(
                [
                    (b"", wire.Status.UNAUTHENTICATED),
                    (ticket(forger, "n1"), wire.Status.UNAUTHENTICATED),
                    (ticket(keys, "n2"), wire.Status.PERMISSION_DENIED),
                ]
            ):
                sock.sendall(beat_with(meta, 10 + i, 1))
                head = wire.read_reply(sock)
                assert (head.request_id, head.status) == (10 + i, status), head.text
                forged = pb.ReportEventsRequest(
                    node_id="n1", epoch=EPOCH, first_seq=1, events=[pb.BlockEvent(kind=1, key=KEYS[i])]
                )
                sock.sendall(
                    encode_unary(20 + i, "ReportEvents", meta, forged.SerializeToString(), wire.OP_NOTIFY)
                )
            sock.sendall(wire.Frame(wire.OP_PING, 30).pack())
            assert wire.read_reply(sock).request_id == 30  # nothing else came back
            assert server.num_one_way_failed == 3
            assert coordinator.node("n1").load == {"free_blocks": 50}  # no refused beat changed it
            assert coordinator.events_acknowledged("n1", EPOCH) == (0, 1)  # no forged report queued
            sock.sendall(beat_with(ticket(keys, "n1"), 40, 49))
            assert reply(sock, pb.HeartbeatResponse)[1].is_registered  # the link is still served
            assert coordinator.node("n1").load == {"free_blocks": 49}
    finally:
        server.stop()
        coordinator.stop()


def test_requests_that_may_wait_are_served_in_turns(served) -> None:
    """Twelve links trickle one-way reports that may wait: the loop serves them in turns, at
    most one every PACE_S (so a turn takes many), and takes every report; a request that may
    not wait takes its link out of the turns, and one that may puts it back."""
    coordinator, server = served
    loop = server._loop
    nodes = [f"t{i}" for i in range(12)]  # (the fixture's two beside them: 16 a peer)
    for n in nodes:
        coordinator.register(n, "127.0.0.1:1", SPEC.to_dict(), 64, EPOCH)
    socks = [connect(server) for _ in nodes]
    for node, sock in zip(nodes, socks, strict=True):
        sock.sendall(beat(node, 1, wait_s=WAIT_S))
        assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
    until(lambda: loop.num_paced == len(nodes), "the links served in turns")
    turns, start = loop.num_paced_turns, time.monotonic()
    for k in range(15):
        for i, (node, sock) in enumerate(zip(nodes, socks, strict=True)):
            sock.sendall(report(node, k + 1, KEYS[12 * k + i], wait_s=WAIT_S))
            time.sleep(0.0005)
    for node, sock in zip(nodes, socks, strict=True):  # (a call: every report before it was served)
        sock.sendall(beat(node, 2, wait_s=WAIT_S))
        assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
    taken = loop.num_paced_turns - turns
    # At most a turn every PACE_S, however the reports trickled in (a load slows the sending,
    # which only loosens this); a turn per report would be 180 in the ~0.1 s they take here.
    assert 0 < taken <= (time.monotonic() - start) / PACE_S + 2
    for node in nodes:
        assert coordinator.events_acknowledged(node, EPOCH)[1] == 16
    socks[0].sendall(beat(nodes[0], 3))  # may not wait: served as its bytes come from now on
    assert reply(socks[0], pb.HeartbeatResponse)[0].status == wire.Status.OK
    until(lambda: loop.num_paced == len(nodes) - 1, "a link out of the turns")
    socks[0].sendall(report(nodes[0], 16, KEYS[300], wait_s=WAIT_S))
    until(lambda: loop.num_paced == len(nodes), "back in them")
    for sock in socks:
        sock.close()


@pytest.mark.parametrize("wait_s", [0.0, WAIT_S], ids=["at-once", "paced"])
def test_beats_read_together_are_renewed_in_one_store_call(served, wait_s) -> None:
    """Beats of twelve links that arrive while the loop waits on the store are answered
    together (one Heartbeats batch: one store round trip), each as it would be alone: an
    unknown node's says so, the others renew and update their node's load."""
    coordinator, server = served
    loop = server._loop
    nodes = [f"b{i}" for i in range(11)]
    for n in nodes:
        coordinator.register(n, "127.0.0.1:1", SPEC.to_dict(), 64, EPOCH)
    nodes.append("ghost")  # never registered
    socks = [connect(server) for _ in nodes]
    for i, (node, sock) in enumerate(zip(nodes, socks, strict=True)):
        sock.sendall(beat(node, 1, free=10 + i, wait_s=wait_s))
        assert reply(sock, pb.HeartbeatResponse)[1].is_registered == (node != "ghost")
    until(lambda: adopted(server) == len(nodes), "the links on the loop (an answered beat moves one)")
    batches = loop.num_batches
    with coordinator.store._lock:  # the loop's next store call waits: the beats pile up
        socks[0].sendall(beat(nodes[0], 2, free=1, wait_s=wait_s))
        time.sleep(0.2)
        for i, (node, sock) in enumerate(zip(nodes[1:], socks[1:], strict=True), 1):
            sock.sendall(beat(node, 2, free=i + 1, wait_s=wait_s))
        time.sleep(0.2)
    answers = [reply(sock, pb.HeartbeatResponse) for sock in socks]
    assert [a[1].is_registered for a in answers] == [True] * 11 + [False]
    assert all(a[0].request_id == 2 for a in answers)
    assert loop.num_batches - batches == 2  # the first alone, then the eleven read together
    for i, node in enumerate(nodes[:-1]):
        assert coordinator.node(node).load == {"free_blocks": i + 1}
    for sock in socks:
        sock.close()


def test_a_link_whose_beat_waits_on_the_store_is_not_read_further(served) -> None:
    """A flood behind a beat that waits for the store: the loop stops reading that link until
    the beat is answered (its buffer holds at most a receive past the beat, not everything the
    peer sends), then serves the rest in order: the beat's reply first, every report taken."""
    coordinator, server = served
    loop = server._loop
    sock = connect(server)
    sock.sendall(beat("n1", 1, wait_s=WAIT_S))
    assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
    until(lambda: loop.num_paced == 1, "the link served in turns")
    reports = b"".join(report("n1", k + 1, KEYS[k % 400], wait_s=WAIT_S) for k in range(6000))
    assert len(reports) > 8 * READ_BYTES
    with coordinator.store._lock:  # the beat's renewal waits here
        sender = threading.Thread(target=sock.sendall, args=(beat("n1", 2, wait_s=WAIT_S) + reports,))
        sender.start()
        time.sleep(0.5)
        (link,) = loop._links.values()
        assert link.is_waiting and len(link.buf) <= 2 * READ_BYTES
    sender.join(10)
    head, answer = reply(sock, pb.HeartbeatResponse)
    assert head.request_id == 2 and answer.is_registered
    sock.sendall(beat("n1", 3, wait_s=WAIT_S))
    assert reply(sock, pb.HeartbeatResponse)[0].request_id == 3
    assert coordinator.events_acknowledged("n1", EPOCH)[1] == 6001  # every report, in order
    sock.close()


@pytest.mark.parametrize("wait_s", [0.0, WAIT_S], ids=["at-once", "paced"])
def test_a_stream_cut_mid_request_for_longer_than_the_frame_timeout_is_kept(served, wait_s) -> None:
    """Reports streamed for three frame timeouts, every write ending inside a request: each
    request is whole well within its deadline, so the link stays (a deadline that ran from the
    first partial request of the stream, never restarted, closed it)."""
    coordinator, server = served
    sock = connect(server)
    sock.sendall(beat("n2", 1, wait_s=wait_s))
    assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
    reports = [report("n2", k + 1, KEYS[k % 400], wait_s=wait_s) for k in range(2400)]
    starts = [0]
    for r in reports:
        starts.append(starts[-1] + len(r))
    stream = b"".join(reports)
    start, at = time.monotonic(), 0
    for k in range(8, 2400, 8):  # each write ends 10 bytes into a request
        sock.sendall(stream[at : starts[k] + 10])
        at = starts[k] + 10
        time.sleep(0.004)
    sock.sendall(stream[at:])
    assert time.monotonic() - start > 3 * 0.4  # the fixture's frame timeout
    sock.sendall(beat("n2", 2, wait_s=wait_s))
    assert reply(sock, pb.HeartbeatResponse)[0].request_id == 2
    assert coordinator.events_acknowledged("n2", EPOCH)[1] == 2401
    sock.close()


def test_a_request_that_says_it_may_wait_forever_is_served_in_its_turn(served) -> None:
    """`end` is the client's word only: the largest (2^64 - 1 us) paces the link, no more; the
    beat is answered within a turn, and the link stays usable."""
    coordinator, server = served
    sock = connect(server)
    message = pb.HeartbeatRequest(node_id="n1").SerializeToString()
    forever = wire.Frame(wire.OP_UNARY, 7, end=2**64 - 1, text="Heartbeat", payload_len=len(message))
    for request_id in (7, 8):  # the first moves the link, the second is served in a turn
        sock.sendall(forever._replace(request_id=request_id).pack() + message)
        start = time.monotonic()
        head, answer = reply(sock, pb.HeartbeatResponse)
        assert head.request_id == request_id and answer.is_registered
        assert time.monotonic() - start < 1.0  # (a turn is 5 ms; a second allows a loaded host)
    until(lambda: server._loop.num_paced == 1, "the link paced")
    sock.close()


def open_request(request_id: int, seq_id: str, tokens: list[int], worker_opens: bool = True) -> bytes:
    message = pb.CoordOpenRequest(seq_id=seq_id, token_ids=tokens, worker_opens=worker_opens)
    return encode_unary(request_id, "Open", b"", message.SerializeToString(), wire.OP_UNARY)


def close_request(request_id: int, seq_id: str, freed_extents: int = 1) -> bytes:
    message = pb.CoordSeqRequest(seq_id=seq_id, freed_extents=freed_extents)
    return encode_unary(request_id, "Close", b"", message.SerializeToString(), wire.OP_UNARY)


def test_workers_opens_and_closes_are_served_by_the_loop_in_order(served) -> None:
    """Four workers' connections, each sending its open and close back to back (one of them a
    bad open first, one an open of an id that is taken): each leaves its thread after its
    first call, every reply comes back in its request's order with its own answer, the bad
    and the taken ones refused alone, and every sequence is closed at the end."""
    coordinator, server = served
    prompt = list(range(1, 30))
    socks = [connect(server) for _ in range(4)]
    for sock in socks:  # each link adopted first, so that the rest meet on the loop
        sock.sendall(close_request(1, "never-opened"))
        assert reply(sock, pb.Empty)[0].status == wire.Status.OK
    until(lambda: adopted(server) == 4 and frame_threads() == 0, "worker links on the loop")
    socks[0].sendall(open_request(1, "taken", prompt))
    assert reply(socks[0], pb.CoordOpenResponse)[0].status == wire.Status.OK
    batches = server._loop.num_batches
    streams = [open_request(2, f"s{i}", prompt) + close_request(3, f"s{i}") for i in range(4)]
    bad = pb.CoordOpenRequest(seq_id="s1", token_ids=[1], packed_token_ids=b"\0\0\0\1")
    streams[1] = encode_unary(2, "Open", b"", bad.SerializeToString(), wire.OP_UNARY) + streams[1]
    streams[2] = open_request(4, "taken", prompt) + streams[2]
    for sock, stream in zip(socks, streams, strict=True):
        sock.sendall(stream)
    answers = []
    for i, sock in enumerate(socks):
        n = 3 if i in (1, 2) else 2
        got = [reply(sock, pb.CoordOpenResponse if k < n - 1 else pb.Empty) for k in range(n)]
        answers.append([(head.request_id, wire.Status(head.status).name) for head, _ in got])
        opened = got[n - 2][1]
        assert opened.extents[0].node_id in NODES and opened.node_open.order  # the worker's node Open
    assert answers[0] == [(2, "OK"), (3, "OK")]
    assert answers[1] == [(2, "INVALID_ARGUMENT"), (2, "OK"), (3, "OK")]
    assert answers[2] == [(4, "FAILED_PRECONDITION"), (2, "OK"), (3, "OK")]  # SequenceExists
    assert answers[3] == [(2, "OK"), (3, "OK")]
    assert server._loop.num_batches > batches and frame_threads() == 0
    assert coordinator.counters["opens"] == 5
    socks[0].sendall(close_request(9, "taken"))
    assert reply(socks[0], pb.Empty)[0].status == wire.Status.OK
    for sock in socks:
        sock.close()
    assert coordinator.store.sequences_of_node("n1") + coordinator.store.sequences_of_node("n2") == []


def test_a_large_open_sent_in_pieces_is_received_into_its_own_buffer(served) -> None:
    """A worker's Open of a 100k-token packed prompt (~400 KB, 6 x READ_BYTES) whose first
    bytes come alone: the loop sizes a buffer for the whole request from its header, counted
    against the budget, receives the rest into it and answers it (25,000 blocks: more than the
    64-block nodes hold); the budget is given back and the link's next open is read as usual."""
    coordinator, server = served
    loop = server._loop
    sock = connect(server)
    sock.sendall(close_request(1, "never-opened"))  # adopted by the loop
    assert reply(sock, pb.Empty)[0].status == wire.Status.OK
    until(lambda: adopted(server) == 1 and frame_threads() == 0, "the link on the loop")
    (link,) = loop._links.values()
    tokens = list(range(1, 100_001))
    message = pb.CoordOpenRequest(seq_id="big", packed_token_ids=pack(tokens), worker_opens=True)
    stream = encode_unary(2, "Open", b"", message.SerializeToString(), wire.OP_UNARY)
    assert len(stream) > 6 * READ_BYTES
    sock.sendall(stream[:200])
    until(lambda: link.big is not None and len(link.big) == len(stream), "a buffer of the request's size")
    assert loop._held == len(stream) and link.big_at == 200 and not link.buf
    sock.sendall(stream[200:])
    head, _ = reply(sock, pb.CoordOpenResponse)
    assert head.status == wire.Status.RESOURCE_EXHAUSTED and "a 25000-block sequence" in head.text
    assert link.big is None and loop._held == 0 and link.deadline == 0.0
    sock.sendall(open_request(3, "small", list(range(1, 30))))
    assert reply(sock, pb.CoordOpenResponse)[0].status == wire.Status.OK
    sock.close()


def test_a_large_request_past_the_budget_closes_its_link_alone() -> None:
    """A request whose header says more bytes than the loop's budget holds closes its link as
    soon as it is seen (before its buffer is filled); another link is served."""
    coordinator, server = serve(BulkLimits(idle_timeout_s=30, max_inflight_bytes=4 * READ_BYTES))
    try:
        good, bad = connect(server), connect(server)
        for sock in (good, bad):
            sock.sendall(close_request(1, "never-opened"))
            assert reply(sock, pb.Empty)[0].status == wire.Status.OK
        until(lambda: adopted(server) == 2, "both links on the loop")
        message = pb.CoordOpenRequest(seq_id="big", packed_token_ids=bytes(8 * READ_BYTES), worker_opens=True)
        stream = encode_unary(2, "Open", b"", message.SerializeToString(), wire.OP_UNARY)
        bad.sendall(stream[: 2 * READ_BYTES])
        until(lambda: is_closed(bad), "the link past the budget closed")
        assert server._loop._held == 0
        good.sendall(open_request(2, "small", list(range(1, 30))))
        assert reply(good, pb.CoordOpenResponse)[0].status == wire.Status.OK
    finally:
        server.stop()
        coordinator.stop()


@pytest.mark.parametrize("tail", [b"X" * 200, None], ids=["bad-magic", "too-large"])
def test_bytes_after_a_batched_call_that_are_no_request_close_that_link_alone(served, tail) -> None:
    """A beat (a batched call, answered with its batch) followed in the same write by bytes that
    are no request, or by a request larger than the port takes: that link is closed, and the
    loop goes on serving the others (it failed, and every link with it, parsing that header
    outside its per-link error handling)."""
    coordinator, server = served
    good, bad = connect(server), connect(server)
    for node, sock in (("n1", good), ("n2", bad)):
        sock.sendall(beat(node, 1))
        assert reply(sock, pb.HeartbeatResponse)[0].status == wire.Status.OK
    until(lambda: adopted(server) == 2, "both links on the loop")
    if tail is None:
        big = wire.Frame(wire.OP_UNARY, 3, text="Open", payload_len=server.max_message_bytes + 1)
        tail = big.pack() + b"\0" * 100
    bad.sendall(beat("n2", 2) + tail)
    until(lambda: is_closed(bad), "the link that sent them closed")
    good.sendall(beat("n1", 2))
    assert reply(good, pb.HeartbeatResponse)[0].status == wire.Status.OK
    assert server._loop._held == 0


class HeldFree(pb_grpc.CacheNodeServicer):
    """A node whose Free answers once `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.num_frees = 0

    def Free(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.release.wait(10)
        self.num_frees += 1
        return pb.Empty()


@pytest.fixture
def held_free():
    """A coordinator on a framed port whose one node ("n1") holds its Frees until released."""
    node = HeldFree()
    node_server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_CacheNodeServicer_to_server(node, node_server)
    address = f"127.0.0.1:{node_server.add_insecure_port('127.0.0.1:0')}"
    node_server.start()
    limits = BulkLimits(idle_timeout_s=30, max_inflight_bytes=1 << 20)
    coordinator, server = serve(limits, nodes={"n1": address})
    yield node, coordinator, server
    node.release.set()
    server.stop()
    coordinator.stop()
    node_server.stop(0)


def reopen_waiting(worker: socket.socket, coordinator: Coordinator, prompt: list[int]) -> None:
    """Open "s", close it as an older client (the coordinator sends the Free, which the node
    holds), and send its reopen: that one waits for the Free."""
    worker.sendall(open_request(1, "s", prompt))
    assert reply(worker, pb.CoordOpenResponse)[0].status == wire.Status.OK
    worker.sendall(close_request(2, "s", freed_extents=0))
    assert reply(worker, pb.Empty)[0].status == wire.Status.OK
    assert coordinator.is_in_flight("s")  # its Free held by the node
    worker.sendall(open_request(3, "s", prompt))


def test_a_reopen_that_must_wait_is_answered_from_a_thread_while_the_loop_serves_beats(held_free) -> None:
    """An older client's close has the coordinator send the node Free; a reopen of the id waits
    for it. On the loop that wait would hold every link: the reopen is handed to a thread
    (Offload), its link answered after it, while a node's beats are answered at once."""
    node, coordinator, server = held_free
    prompt = list(range(1, 30))
    with connect(server) as worker, connect(server) as link:
        reopen_waiting(worker, coordinator, prompt)
        worker.sendall(close_request(4, "s"))
        for k in range(5):  # the loop meanwhile: beats answered at once
            start = time.monotonic()
            link.sendall(beat("n1", 10 + k))
            head, answer = reply(link, pb.HeartbeatResponse)
            assert head.request_id == 10 + k and answer.is_registered
            assert time.monotonic() - start < 0.5
        assert server._loop.num_offloaded == 1 and coordinator.is_in_flight("s")
        worker.settimeout(0.2)
        with pytest.raises(TimeoutError):  # the reopen still waits for the Free
            wire.read_reply(worker)
        worker.settimeout(5)
        node.release.set()
        head, opened = reply(worker, pb.CoordOpenResponse)  # after the Free, in order
        assert (head.request_id, head.status) == (3, wire.Status.OK) and opened.node_seq_id == "s"
        assert reply(worker, pb.Empty)[0].request_id == 4
    assert node.num_frees == 1 and coordinator.store.sequences_of_node("n1") == []
    servicer = server.handlers["Open"][0].__self__
    counted = servicer.metrics.registry.get_sample_value(
        "pagedkv_coordinator_rpc_latency_seconds_count", {"method": "Open"}
    )
    assert counted == 2  # the handed-back call counted once, where it was answered
    assert server.num_calls == 9  # 2 opens, 2 closes, 5 beats: the handed-back one once


def test_a_link_that_floods_while_its_call_waits_is_closed_alone(held_free) -> None:
    """What a link sends while its handed-back call waits stays in its buffer, counted against
    the port's budget for requests held: past it the link is closed, the others served."""
    node, coordinator, server = held_free
    with connect(server) as worker, connect(server) as link:
        reopen_waiting(worker, coordinator, list(range(1, 30)))
        until(lambda: server._loop.num_offloaded == 1, "the reopen handed to a thread")
        junk = bytes(64 << 10)
        with contextlib.suppress(OSError):  # (the port closes it on the way)
            for _ in range(64):  # 4 MiB against a 1 MiB budget
                worker.sendall(junk)
        assert is_closed(worker)
        link.sendall(beat("n1", 1))
        assert reply(link, pb.HeartbeatResponse)[1].is_registered
        node.release.set()
        until(lambda: not coordinator.is_in_flight("s"), "the Free and the reopen settled")
        until(lambda: server._loop._held == 0, "no bytes held for the closed link")


def test_beats_that_allow_a_wait_are_held_and_renewed_together(served) -> None:
    """Beats saying they may wait 50 ms (an idle node's) are held, so that beats of several
    links arriving apart are answered in one batch (one store round trip), each well within
    what its sender allowed; a beat allowing 10 ms is answered in its turn."""
    coordinator, server = served
    socks = [connect(server), connect(server)]
    for i, sock in enumerate(socks):  # each link adopted and paced first
        sock.sendall(beat(NODES[i], 1, wait_s=WAIT_S))
        assert reply(sock, pb.HeartbeatResponse)[1].is_registered
    until(lambda: server._loop.num_paced == 2, "both links paced")
    loop = server._loop
    before = loop.num_batches
    start = time.monotonic()
    socks[0].sendall(beat(NODES[0], 2, wait_s=0.05))
    time.sleep(0.01)  # (the second comes a turn or two later)
    socks[1].sendall(beat(NODES[1], 2, wait_s=0.05))
    for sock in socks:
        head, answer = reply(sock, pb.HeartbeatResponse)
        assert head.request_id == 2 and answer.is_registered
    assert loop.num_batches == before + 1  # (answered as they came: two batches)
    assert time.monotonic() - start < 1.0  # (held ~40 ms; a second allows a loaded host)


def test_a_held_beat_is_answered_once_its_link_sends_more(served, monkeypatch) -> None:
    """A held call keeps its link's later requests waiting, so it is answered as soon as the link
    sends one: with holds of up to 30 s, a beat followed by a ping comes back at once."""
    import pagedkv.protos.framed_loop as framed_loop

    monkeypatch.setattr(framed_loop, "MAX_HOLD_S", 30.0)
    coordinator, server = served
    sock = connect(server)
    sock.sendall(beat(NODES[0], 1, wait_s=WAIT_S))
    assert reply(sock, pb.HeartbeatResponse)[1].is_registered
    until(lambda: server._loop.num_paced == 1, "the link paced")
    start = time.monotonic()
    sock.sendall(beat(NODES[0], 2, wait_s=10.0))
    time.sleep(0.05)  # (read and held by now)
    sock.sendall(wire.Frame(wire.OP_PING, 3).pack())
    head, answer = reply(sock, pb.HeartbeatResponse)
    assert head.request_id == 2 and answer.is_registered
    assert wire.read_reply(sock).request_id == 3
    assert time.monotonic() - start < 5.0  # (held 10 s without the ping)
