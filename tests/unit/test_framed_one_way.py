"""One-way calls (NOTIFY) on the coordinator's framed port with real sockets: the handler
runs and nothing is sent back; what the server cannot take is answered and the connection
closed; requests streamed back to back are read ahead and still bounded by the port's
deadlines; no receive buffer stays taken. Real parts: a coordinator on the embedded
store, its servicer behind a FramedServer on a free port, raw client sockets. (A node's
link reporting one-way: test_framed_server.py.)"""

from __future__ import annotations

import random
import socket
import time

import pytest

from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.service import FRAMED_METHODS, CoordinatorServicer
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import wire
from pagedkv.protos.framed_server import FramedServer
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire.limits import BulkLimits
from pagedkv.protos.wire.unary import encode_unary

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
EPOCH = 5
KEYS = [bytes([i]) * 16 for i in range(200)]


@pytest.fixture
def served():
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30))
    coordinator.register("n1", "127.0.0.1:1", SPEC.to_dict(), 64, EPOCH)
    servicer = CoordinatorServicer(coordinator, Tenants(), CoordinatorMetrics(coordinator))
    limits = BulkLimits(idle_timeout_s=5, frame_timeout_s=0.4, min_bytes_per_s=1 << 20)
    service = pb.DESCRIPTOR.services_by_name["Coordinator"]
    server = FramedServer(
        servicer, service, pb, FRAMED_METHODS, limits=limits, one_way=servicer.one_way_handlers()
    )
    server.start()
    yield coordinator, server
    server.stop()
    coordinator.stop()
    assert server.budget.used == 0  # every receive buffer given back


def connect(server: FramedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def report(seq: int, key: bytes, epoch: int = EPOCH, request_id: int = 1) -> bytes:
    message = pb.ReportEventsRequest(
        node_id="n1", events=[pb.BlockEvent(kind=pb.BlockEvent.STORED, key=key)], epoch=epoch, first_seq=seq
    )
    return encode_unary(request_id, "ReportEvents", b"", message.SerializeToString(), wire.OP_NOTIFY)


def ping(sock: socket.socket, request_id: int = 99) -> wire.Frame:
    sock.sendall(wire.Frame(wire.OP_PING, request_id).pack())
    return wire.read_reply(sock)


def is_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_one_way_report_runs_its_handler_and_gets_no_reply(served) -> None:
    coordinator, server = served
    with connect(server) as sock:
        sock.sendall(report(1, KEYS[0]))
        head = ping(sock)
        assert (head.op, head.request_id, head.status) == (wire.OP_PING, 99, wire.Status.OK)  # first
        assert server.num_one_way == 1 and server.num_calls == 0
        until(lambda: coordinator.events_acknowledged("n1", EPOCH) == (1, 2), "report applied")
        assert coordinator.store.keys_of("n1") == {KEYS[0]}


def test_a_one_way_reports_error_is_counted_not_answered(served) -> None:
    coordinator, server = served
    refused = coordinator.events.num_refused
    with connect(server) as sock:
        sock.sendall(report(1, KEYS[0], epoch=EPOCH + 2))  # not its registration: NodeNotLive
        sock.sendall(report(3, KEYS[1]))  # a gap (1-2 never came): refused, where to resend is kept
        assert ping(sock).request_id == 99  # nothing else was sent back; still in step
    assert server.num_one_way == 2 and server.num_one_way_failed == 1
    assert coordinator.events.num_refused == refused + 2
    # the one-way handler keeps the rpc's metrics: both calls timed, the refused one counted
    registry = server.handlers["ReportEvents"][0].__self__.metrics.registry
    labels = {"method": "ReportEvents"}
    assert registry.get_sample_value("pagedkv_coordinator_rpc_latency_seconds_count", labels) == 2
    not_found = {**labels, "code": "NOT_FOUND"}
    assert registry.get_sample_value("pagedkv_coordinator_rpc_errors_total", not_found) == 1
    assert coordinator.events_acknowledged("n1", EPOCH) == (0, 1)  # the node's next beat: send from 1


@pytest.mark.parametrize(
    "request_bytes,says",
    [
        (
            encode_unary(4, "Open", b"", pb.CoordOpenRequest(seq_id="s").SerializeToString(), wire.OP_NOTIFY),
            "not taken one-way",
        ),
        (encode_unary(4, "ReportEvents", b"", b"\xff\xff\xff", wire.OP_NOTIFY), "does not parse"),
        (
            wire.Frame(wire.OP_NOTIFY, 4, text="ReportEvents", start=9, payload_len=4).pack() + b"abcd",
            "metadata",
        ),
        (wire.Frame(wire.OP_NOTIFY, 4, text="ReportEvents", payload_len=1 << 30).pack(), "byte request"),
    ],
    ids=["a method not taken one-way", "a body that does not parse", "metadata past the payload", "1 GiB"],
)
def test_a_one_way_call_it_cannot_take_is_answered_then_closed(served, request_bytes, says) -> None:
    coordinator, server = served
    with connect(server) as sock:
        sock.sendall(request_bytes)
        head = wire.read_reply(sock)
        assert (head.op, head.request_id, head.status) == (wire.OP_NOTIFY, 4, wire.Status.INVALID_ARGUMENT)
        assert says in head.text, head.text
        assert is_closed(sock)
    assert server.num_one_way == 0 and coordinator.live_node("n1") is not None
    with connect(server) as fresh:  # the port keeps serving
        assert ping(fresh).status == wire.Status.OK


def test_reports_streamed_back_to_back_are_all_taken_in_order(served) -> None:
    """150 one-way reports and a ping sent in one stream cut at random points: each is
    handled, in order (no gap refused), and the ping answered after them."""
    coordinator, server = served
    stream = b"".join(report(i + 1, KEYS[i], request_id=i + 1) for i in range(150))
    stream += wire.Frame(wire.OP_PING, 500).pack()
    rng = random.Random(3)
    with connect(server) as sock:
        at = 0
        while at < len(stream):
            step = rng.choice([1, 7, 100, 3000, 20000])
            sock.sendall(stream[at : at + step])
            at += step
        assert wire.read_reply(sock).request_id == 500
    assert server.num_one_way == 150 and server.num_one_way_failed == 0
    until(lambda: coordinator.events_acknowledged("n1", EPOCH) == (150, 151), "all applied")
    assert coordinator.events.num_refused == 0
    assert coordinator.store.keys_of("n1") == set(KEYS[:150])


def test_a_request_trickled_behind_a_whole_one_is_cut_off_in_time(served) -> None:
    """A whole report and the first bytes of the next in one send, the rest a byte every
    0.1 s: the second's deadline runs from its first bytes (read ahead with the whole one),
    so the connection is closed within the frame timeout, not when the trickle ends."""
    _, server = served
    second = report(2, KEYS[1])
    with connect(server) as sock:
        start = time.monotonic()
        sock.sendall(report(1, KEYS[0]) + second[:10])
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            for byte in second[10:]:
                time.sleep(0.1)
                sock.sendall(bytes([byte]))
        assert time.monotonic() - start < 3  # (the whole trickle would take 7 s)
    assert server.num_one_way == 1
