"""The coordinator's framed port loop (protos/framed_loop.py) under hostile peers, with real
sockets: garbage after a batched call and after a non-batched one, truncated and oversized
headers, large requests cut off, stalled, pipelined behind a waiting call or followed by more,
and a seeded fuzz of valid frames and mutations over several links at once. After each, three
things hold: the loop keeps serving (a well-behaved link already on the loop gets its beat
answered, the loop's thread is alive, no "framed loop failed" logged), the bytes held for
requests being received come back (`_held == 0` once the hostile links are closed, their slots
released) and nothing is left open on the coordinator. Real parts: a coordinator on the
embedded store, its servicer behind a FramedServer on a free port, raw client sockets.

(The helpers are those of tests/unit/test_framed_loop.py and test_framed_one_way.py, copied:
tests/unit is not on this directory's import path.)"""

from __future__ import annotations

import contextlib
import logging
import random
import select
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pagedkv.coordinator.auth import ClusterAccess, Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.memory_store import MemoryStore
from pagedkv.coordinator.metrics import CoordinatorMetrics
from pagedkv.coordinator.service import FRAMED_METHODS, LOOP_METHODS, CoordinatorServicer
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos import wire
from pagedkv.protos.framed_loop import READ_BYTES
from pagedkv.protos.framed_server import FramedServer
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire.frame import FRAME, MAGIC, VERSION, ProtocolError, frame_at
from pagedkv.protos.wire.limits import BulkLimits
from pagedkv.protos.wire.unary import encode_unary

pytestmark = pytest.mark.timeout(120)
SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_size=4)
EPOCH = 5
NODES = ("n1", "n2")
OK = wire.Status.OK
INVALID = wire.Status.INVALID_ARGUMENT
FRAME_TIMEOUT_S = 0.4
# A stalled request is cut at its deadline, checked every SWEEP_S (0.5 s): within ~1 s here.
LIMITS = BulkLimits(
    max_connections=64,
    max_per_peer=64,
    idle_timeout_s=30,
    frame_timeout_s=FRAME_TIMEOUT_S,
    min_bytes_per_s=64 << 20,  # (a 4 MiB request: 64 ms more)
    max_inflight_bytes=64 << 20,
)
MAX_MESSAGE = 4 << 20  # FramedServer's max_message_bytes
# FRAME's field offsets ("<4sBBBBQQQHHHIHHQ")
AT_VERSION, AT_OP, AT_DTYPE, AT_RID, AT_START, AT_END = 4, 5, 6, 8, 16, 24
AT_TLEN, AT_XLEN, AT_PLEN = 42, 44, 46
assert FRAME.size == 54


# -- helpers (as tests/unit/test_framed_loop.py's) ------------------------------------------------


def serve(limits: BulkLimits, nodes: dict[str, str] | None = None) -> tuple[Coordinator, FramedServer]:
    coordinator = Coordinator(MemoryStore(), CoordinatorConfig(lease_ttl_s=30, access=ClusterAccess()))
    for n, address in (nodes or dict.fromkeys(NODES, "127.0.0.1:1")).items():
        coordinator.register(n, address, SPEC.to_dict(), 64, EPOCH)
    servicer = CoordinatorServicer(coordinator, Tenants(), CoordinatorMetrics(coordinator))
    server = FramedServer(
        servicer,
        pb.DESCRIPTOR.services_by_name["Coordinator"],
        pb,
        FRAMED_METHODS,
        limits=limits,
        one_way=servicer.one_way_handlers(),
        loop_methods=LOOP_METHODS,
        batches=servicer.batches(),
    )
    return coordinator, server.start()


def until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def connect(server: FramedServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def beat(node: str, request_id: int, free: int = 60, wait_s: float = 0.0) -> bytes:
    message = pb.HeartbeatRequest(node_id=node, events_epoch=EPOCH)
    message.load.free_blocks = free
    return encode_unary(request_id, "Heartbeat", b"", message.SerializeToString(), wire.OP_UNARY, wait_s)


def report(node: str, request_id: int, num_events: int = 1, op: int = wire.OP_NOTIFY) -> bytes:
    """An older node's unnumbered report (first_seq 0): applied whatever came before."""
    events = [
        pb.BlockEvent(kind=pb.BlockEvent.STORED, key=bytes([i % 256, i // 256 % 256]) * 8)
        for i in range(num_events)
    ]
    message = pb.ReportEventsRequest(node_id=node, events=events, epoch=EPOCH)
    return encode_unary(request_id, "ReportEvents", b"", message.SerializeToString(), op)


def open_request(request_id: int, seq_id: str, tokens: list[int], worker_opens: bool = True) -> bytes:
    message = pb.CoordOpenRequest(seq_id=seq_id, token_ids=tokens, worker_opens=worker_opens)
    return encode_unary(request_id, "Open", b"", message.SerializeToString(), wire.OP_UNARY)


def big_open(request_id: int, num_tokens: int = 100_000) -> bytes:
    """An Open of a packed prompt larger than READ_BYTES (refused: more blocks than a node holds)."""
    message = pb.CoordOpenRequest(seq_id="big", packed_token_ids=bytes(4 * num_tokens), worker_opens=True)
    return encode_unary(request_id, "Open", b"", message.SerializeToString(), wire.OP_UNARY)


def big_beat(node: str, request_id: int) -> bytes:
    """A beat larger than READ_BYTES (held ids it does not say are complete: ignored)."""
    message = pb.HeartbeatRequest(node_id=node, held_seq_ids=[f"held-{i:06d}" for i in range(8000)])
    return encode_unary(request_id, "Heartbeat", b"", message.SerializeToString(), wire.OP_UNARY)


def close_request(request_id: int, seq_id: str, freed_extents: int = 1) -> bytes:
    message = pb.CoordSeqRequest(seq_id=seq_id, freed_extents=freed_extents)
    return encode_unary(request_id, "Close", b"", message.SerializeToString(), wire.OP_UNARY)


def ping(request_id: int) -> bytes:
    return wire.Frame(wire.OP_PING, request_id).pack()


def header(
    op: int = wire.OP_UNARY,
    request_id: int = 0,
    *,
    text: bytes = b"Heartbeat",
    start: int = 0,
    end: int = 0,
    payload_len: int = 0,
    magic: bytes = MAGIC,
    version: int = VERSION,
    dtype: int = 0,
    tlen: int | None = None,
) -> bytes:
    """A FRAME packed field by field (any value its struct takes), then its text."""
    tlen = len(text) if tlen is None else tlen
    return (
        FRAME.pack(magic, version, op, dtype, 0, request_id, start, end, 0, 0, 0, 0, tlen, 0, payload_len)
        + text
    )


def reply(sock: socket.socket, message: type) -> tuple[wire.Frame, object]:
    head = wire.read_reply(sock)
    body = wire.recv_bytes(sock, head.payload_len, "reply") if head.payload_len else b""
    return head, (message.FromString(body) if head.status == OK else None)


def adopted(server: FramedServer) -> int:
    assert server._loop is not None
    return server._loop.num_links


def frames_of(data: bytes | bytearray) -> list[wire.Frame]:
    """The whole reply frames in what a peer received, in order (a cut-off last one left out);
    the port only ever sends frames (ProtocolError: it sent something else)."""
    out, at = [], 0
    while (parsed := frame_at(data, at)) is not None:
        f, end = parsed
        if len(data) - end < f.payload_len:
            break
        out.append(f)
        at = end + f.payload_len
    return out


def drain(sock: socket.socket, timeout_s: float = 3.0) -> tuple[bytes, bool]:
    """What the port sends until it closes the connection (True) or timeout_s passes (False)."""
    got = bytearray()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(1 << 16)
        except TimeoutError:
            break
        except ConnectionError:
            return bytes(got), True
        if not data:
            return bytes(got), True
        got += data
    return bytes(got), False


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """sendall, False when the port closed the connection meanwhile."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


class Port:
    """A framed port with a well-behaved node link on its loop ("n1"), and the properties every
    hostile input must leave intact (`check`)."""

    def __init__(self, limits: BulkLimits = LIMITS, nodes: dict[str, str] | None = None) -> None:
        self.coordinator, self.server = serve(limits, nodes)
        assert self.server._loop is not None
        self.loop = self.server._loop
        self.socks: list[socket.socket] = []  # the hostile ones, closed by check()
        self.seq_ids: set[str] = set()  # every id a hostile or fuzzed link may have opened
        self.rid = 0
        self.good = connect(self.server)
        self.good_beat()
        until(lambda: adopted(self.server) == 1, "the good link on the loop")

    def stop(self) -> None:
        for sock in [*self.socks, self.good]:
            sock.close()
        self.server.stop()
        self.coordinator.stop()

    def next_rid(self) -> int:
        self.rid += 1
        return self.rid

    def good_beat(self, timeout_s: float = 5.0) -> wire.Frame:
        """Property 1: the good link's beat answered (OK, in order), the loop's thread alive."""
        rid = self.next_rid()
        self.good.settimeout(timeout_s)
        self.good.sendall(beat("n1", rid))
        head, answer = reply(self.good, pb.HeartbeatResponse)
        assert head.request_id == rid, (head.request_id, rid)
        assert head.status == OK, head.text
        assert answer.is_registered
        assert self.loop._thread.is_alive(), "the loop's thread ended"
        return head

    def hostile(self, adopt: bool = True) -> socket.socket:
        """A connection, moved to the loop by a beat of "n2" that was answered (adopt)."""
        sock = connect(self.server)
        self.socks.append(sock)
        if adopt:
            before = self.server._num_adopted
            sock.sendall(beat("n2", 1))
            head, _ = reply(sock, pb.HeartbeatResponse)
            assert head.status == OK, head.text
            until(lambda: self.server._num_adopted > before, "the link on the loop")
        return sock

    def check(self, caplog: pytest.LogCaptureFixture) -> None:
        """Properties 1-3 once every hostile link is closed."""
        for sock in self.socks:
            sock.close()
        self.socks.clear()
        until(lambda: self.loop._held == 0, f"the loop's budget back ({self.loop._held} bytes held)")
        until(
            lambda: len(self.server._conns) == 1 and adopted(self.server) == 1,
            f"slots released ({len(self.server._conns)} connections, {adopted(self.server)} links)",
        )
        self.good_beat()
        # A call read before its link closed still runs (an open held for its `end`, up to
        # MAX_HOLD_S): closed after it, or its close would come first and find nothing.
        until(lambda: not self.loop._batch, "no call held by the loop")
        self.close_all()
        failed = [r for r in caplog.records if "framed loop failed" in r.getMessage()]
        assert not failed, failed[0].exc_text
        bugs = [r for r in caplog.records if r.name == "pagedkv.framed" and r.levelno >= logging.ERROR]
        assert not bugs, [(r.getMessage(), r.exc_text) for r in bugs]

    def close_all(self) -> None:
        """Property 3: every id a test may have opened closed (closes pipelined on the good link),
        then nothing left open on either node."""
        ids = sorted(self.seq_ids)
        for k in range(0, len(ids), 200):
            chunk = ids[k : k + 200]
            first = self.rid + 1
            self.good.sendall(b"".join(close_request(self.next_rid(), s) for s in chunk))
            for i in range(len(chunk)):
                head, _ = reply(self.good, pb.Empty)
                assert head.request_id == first + i and head.status == OK, (head.request_id, head.text)
        self.seq_ids.clear()
        store = self.coordinator.store
        until(
            lambda: store.sequences_of_node("n1") + store.sequences_of_node("n2") == [],
            "every sequence closed",
        )


@pytest.fixture
def port(caplog):
    caplog.set_level(logging.ERROR, logger="pagedkv.framed")
    p = Port()
    yield p
    p.stop()


# -- targeted cases ------------------------------------------------------------------------------

# Leads: a call the loop answers (batched or not), or none (a ping); (bytes of request id 2, its
# reply's message type, or None for one-way).
LEADS = {
    "heartbeat": (lambda _: beat("n2", 2), pb.HeartbeatResponse),
    "held-heartbeat": (lambda _: beat("n2", 2, wait_s=0.05), pb.HeartbeatResponse),
    "open": (lambda seq_id: open_request(2, seq_id, list(range(1, 9))), pb.CoordOpenResponse),
    "close": (lambda _: close_request(2, "never-opened"), pb.Empty),
    "report-notify": (lambda _: report("n2", 2), None),
    "report-unary": (lambda _: report("n2", 2, op=wire.OP_UNARY), pb.ReportEventsResponse),
    "ping": (lambda _: ping(2), pb.Empty),
}

# Tails (request id 3): what the port does with each: "refused" (an error reply for id 3, then the
# connection closed), "dropped" (closed, nothing sent for it), "answered" (an error reply for id 3,
# the link kept: a ping after it is answered).
TAILS = {
    "bad-magic": (b"XXXX" + bytes(FRAME.size) + b"X" * 100, "dropped"),
    "bad-version": (header(request_id=3, version=VERSION + 1), "dropped"),
    "bad-dtype": (header(request_id=3, dtype=200), "dropped"),
    "text-too-long": (header(request_id=3, tlen=5000) + b"x" * 5000, "dropped"),
    "unknown-op": (header(77, 3), "refused"),
    "bulk-op": (header(wire.OP_APPEND, 3), "refused"),
    "ping-with-payload": (header(wire.OP_PING, 3, text=b"", payload_len=5) + b"12345", "refused"),
    "metadata-past-payload": (header(request_id=3, start=50, payload_len=10) + bytes(10), "refused"),
    "over-max-message": (header(request_id=3, text=b"Open", payload_len=MAX_MESSAGE + 1), "refused"),
    "payload-2^64-1": (header(request_id=3, payload_len=2**64 - 1), "refused"),
    "notify-not-one-way": (header(wire.OP_NOTIFY, 3, text=b"Open", payload_len=2) + b"\n\0", "refused"),
    "body-not-protobuf": (header(request_id=3, payload_len=4) + b"\xff\xff\xff\xff", "answered"),
    "metadata-garbage": (header(request_id=3, start=4, payload_len=4) + b"\xff\xff\xff\xff", "answered"),
    "unknown-method": (header(request_id=3, text=b"Bogus", payload_len=2) + b"\n\0", "answered"),
    "unknown-method-large": (
        header(request_id=3, text=b"Bogus", payload_len=READ_BYTES + 10) + bytes(READ_BYTES + 10),
        "answered",
    ),
}


@pytest.mark.parametrize("write", ["same", "separate", "first-call"])
@pytest.mark.parametrize("lead", list(LEADS))
def test_bytes_after_a_call_close_or_answer_that_link_alone(port, caplog, lead, write) -> None:
    """Each hostile tail after each kind of call on a link on the loop, in the call's write or in
    a write of its own; or in the write of a connection's first call (its thread hands the tail
    to the loop with the link): refused or dropped tails close the link (replies that came are
    frames, in request order, the refusal last), answered ones leave it usable; the good link is
    served after each."""
    if write == "first-call" and lead == "ping":
        pytest.skip("a ping moves no connection to the loop")
    make, message = LEADS[lead]
    split = write == "separate"
    for name, (tail, outcome) in TAILS.items():
        sock = port.hostile(adopt=write != "first-call")
        seq_id = f"lead-open-{name}"
        port.seq_ids.add(seq_id)
        if split:
            sock.sendall(make(seq_id))
            if message is not None:
                assert reply(sock, message)[0].request_id == 2
            else:
                time.sleep(0.02)  # (a one-way call: nothing to wait for)
        if not send_quietly(sock, (b"" if split else make(seq_id)) + tail):
            continue  # (closed already: a refusal of the tail's first bytes)
        if outcome == "answered":
            sock.sendall(ping(4))
            if not split and message is not None:
                assert reply(sock, message)[0].request_id == 2, name
            head = wire.read_reply(sock)
            body = wire.recv_bytes(sock, head.payload_len, "reply") if head.payload_len else b""
            assert (head.request_id, head.status) == (3, INVALID), (name, head, body)
            assert wire.read_reply(sock).request_id == 4, name
            assert adopted(port.server) == 2, f"{name}: the link not on the loop"
        else:
            got, closed = drain(sock)
            assert closed, f"{name}: the link that sent it still open"
            ids = [f.request_id for f in frames_of(got)]
            expected = [2, 3] if outcome == "refused" else [2]
            assert ids == sorted(ids) and set(ids) <= set(expected), (name, ids)
            if outcome == "refused":
                assert ids and ids[-1] == 3, (name, ids)
                assert frames_of(got)[-1].status == INVALID, name
        port.good_beat()
        sock.close()
        port.socks.remove(sock)
        until(lambda: len(port.server._conns) == 1, f"{name}: the hostile link released")
        assert port.loop._held == 0, (name, port.loop._held)
    port.check(caplog)


def partial_cases() -> dict[str, bytes]:
    """Requests whose bytes stop short: of the header, of its text, of a small or a large payload."""
    small = beat("n2", 3)
    big = big_open(3)
    return {
        "1-byte": small[:1],
        "header-minus-1": small[: FRAME.size - 1],
        "text-cut": small[: FRAME.size + 3],
        "payload-cut": small[:-2],
        "large-header-only": big[: FRAME.size + 4],
        "large-one-byte-of-payload": big[: FRAME.size + 5],
        "large-one-receive": big[:READ_BYTES],
        "large-two-receives-and-a-bit": big[: 2 * READ_BYTES + 17],
        "large-minus-1": big[:-1],
        "large-just-over-a-receive": header(payload_len=READ_BYTES + 1) + bytes(100),
        "large-1-MiB-header-only": header(text=b"Close", payload_len=1 << 20),
        "at-max-message": header(text=b"Open", payload_len=MAX_MESSAGE) + bytes(1000),
        "at-max-message-with-texts": (
            FRAME.pack(MAGIC, VERSION, wire.OP_UNARY, 0, 0, 3, 0, 0, 0, 0, 0, 0, 4096, 4096, MAX_MESSAGE)
            + b"x" * 8192
            + bytes(10)
        ),
    }


@pytest.mark.parametrize("after_beat", [False, True], ids=["alone", "after-a-beat"])
def test_requests_cut_off_then_closed_or_stalled_give_their_bytes_back(port, caplog, after_beat) -> None:
    """Each partial request on a link of its own (alone, or after a beat in the same write), all
    at once: half the links then closed by their peers, the others stalled past the frame
    timeout (closed by the port); the budget counts each large one while it waits and is all
    back after."""
    cases = partial_cases()
    socks = {}
    for end in ("close", "stall"):
        for name, data in cases.items():
            sock = port.hostile()
            sock.sendall((beat("n2", 2) if after_beat else b"") + data)
            socks[end, name] = sock
    time.sleep(0.1)
    assert port.loop._held > 0  # (the large ones are counted)
    port.good_beat()
    for (end, _), sock in socks.items():
        if end == "close":
            sock.close()
    start = time.monotonic()
    for (end, name), sock in socks.items():
        if end == "stall":
            _, closed = drain(sock, timeout_s=max(0.1, start + 3.0 - time.monotonic()))
            assert closed, f"{name}: a request stalled past its deadline, its link still open"
    port.good_beat()
    port.check(caplog)


def test_a_large_request_is_counted_from_its_header_and_given_back(port, caplog) -> None:
    """A large request's bytes are held from its header on (its whole size), and given back when
    it is answered, when its peer closes mid-way and when it stalls."""
    loop = port.loop
    stream = big_open(3)
    for end in ("answered", "closed", "stalled"):
        sock = port.hostile()
        sock.sendall(stream[: READ_BYTES // 2])
        until(lambda: loop._held == len(stream), f"{end}: the whole request counted from its header")
        port.good_beat()
        if end == "answered":
            sock.sendall(stream[READ_BYTES // 2 :])
            head, _ = reply(sock, pb.CoordOpenResponse)
            assert head.request_id == 3 and head.status == wire.Status.RESOURCE_EXHAUSTED, head.text
        elif end == "closed":
            sock.sendall(stream[READ_BYTES // 2 : len(stream) // 2])
            sock.close()
        else:
            assert drain(sock)[1], "a stalled large request's link still open"
        until(lambda: loop._held == 0, f"{end}: the budget back")
        port.good_beat()
    port.check(caplog)


def test_a_large_request_followed_by_more_in_the_same_write(port, caplog) -> None:
    """Large requests (an open, a beat, a one-way report, a call of a method the port does not
    serve) each followed in the same write by small requests, garbage last: every request
    answered in order, then the link closed; none of the large buffers kept."""
    port.seq_ids.add("after-big")
    for k, large in enumerate(
        [
            big_open(3),
            big_beat("n2", 3),
            report("n2", 3, num_events=4000),
            None,
            big_open(3) + big_beat("n2", 3),
        ]
    ):
        if large is None:
            large = header(request_id=3, text=b"Bogus", payload_len=3 * READ_BYTES) + bytes(3 * READ_BYTES)
        assert len(large) > READ_BYTES
        sock = port.hostile()
        stream = (
            large
            + beat("n2", 4)
            + ping(5)
            + open_request(6, "after-big", list(range(1, 9)))
            + close_request(7, "after-big")
            + report("n2", 8)
            + ping(9)
        )
        sock.sendall(stream)
        want = [4, 5, 6, 7, 9] if k == 2 else [3, 3, 4, 5, 6, 7, 9] if k == 4 else [3, 4, 5, 6, 7, 9]
        got = []
        for _ in want:
            head = wire.read_reply(sock)
            if head.payload_len:
                wire.recv_bytes(sock, head.payload_len, "reply")
            got.append(head.request_id)
        assert got == want, k
        sock.sendall(b"XXXX" + bytes(FRAME.size))  # then garbage: closed
        assert drain(sock)[1], k
        until(lambda: port.loop._held == 0, f"{k}: the budget back")
        port.good_beat()
    port.check(caplog)


@pytest.mark.parametrize(
    "first",
    ["open", "held-beat", "close", "report-notify", "big-open"],
)
@pytest.mark.parametrize("end", ["whole", "cut-and-closed", "cut-and-stalled"])
def test_a_large_request_pipelined_behind_a_waiting_call(port, caplog, first, end) -> None:
    """A call (a batched one waits in the loop's batch; a held beat waits for its hold) and a
    large request right behind it in the same write, whole or cut off: whole, both answered in
    order and the link kept; cut, the link closed by its peer or its deadline; either way the
    budget comes back."""
    lead = {
        "open": open_request(2, "pipelined", list(range(1, 9))),
        "held-beat": beat("n2", 2, wait_s=0.05),
        "close": close_request(2, "pipelined"),
        "report-notify": report("n2", 2),
        "big-open": big_open(2),
    }[first]
    port.seq_ids.add("pipelined")
    large = big_open(3)
    sock = port.hostile()
    cut = len(large) if end == "whole" else len(large) // 2
    sock.sendall(lead + large[:cut])
    if end == "whole":
        sock.sendall(beat("n2", 4))
        ids = [] if first == "report-notify" else [2]
        want = [*ids, 3, 4]
        got = [reply(sock, pb.Empty)[0] for _ in want]  # (heads: the bodies read, not parsed)
        assert [h.request_id for h in got] == want
        assert got[-2].status == wire.Status.RESOURCE_EXHAUSTED, got[-2].text
    elif end == "cut-and-closed":
        time.sleep(0.05)
        sock.close()
    else:
        assert drain(sock)[1], "a stalled large request's link still open"
    port.good_beat()
    port.check(caplog)


def test_hostile_links_all_at_once_while_the_good_one_beats(port, caplog) -> None:
    """Every hostile tail and partial request at once, each on a link of its own (on the loop,
    or still on its thread: its first request already hostile), while the good link beats."""
    streams = [tail for tail, _ in TAILS.values()] + list(partial_cases().values())
    socks = [port.hostile(adopt=i % 3 != 0) for i in range(len(streams))]
    sender = threading.Thread(
        target=lambda: [send_quietly(s, d) for s, d in zip(socks, streams, strict=True)], daemon=True
    )
    sender.start()
    for _ in range(20):
        port.good_beat()
    sender.join(10)
    port.check(caplog)


def test_a_link_that_never_reads_its_replies_is_closed_alone(port, caplog) -> None:
    """A peer that streams calls and reads none of their replies (each larger than its request)
    is closed once MAX_UNSENT bytes of them wait, its own link only; the good link is served."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small window)
    sock.connect(("127.0.0.1", port.server.port))
    port.socks.append(sock)
    sock.sendall(beat("n2", 1))
    assert reply(sock, pb.HeartbeatResponse)[0].status == OK
    calls = (header(request_id=7, text=b"Bogus", payload_len=2) + b"\n\0") * 1000
    sock.settimeout(5)
    start, closed = time.monotonic(), False
    while time.monotonic() - start < 20 and not closed:
        closed = not send_quietly(sock, calls)
    assert closed, "a peer that reads nothing is still served"
    port.good_beat()
    port.check(caplog)


# -- the loop as a connection's own thread would be: deadlines, the budget, replies, batches ----------


def test_a_large_request_whose_header_comes_in_two_pieces_gets_its_payload_time(caplog) -> None:
    """A request's deadline is the frame timeout plus its payload at min_bytes_per_s from its
    first bytes (the thread path arms it so at its header). A 2 MiB open at 1 MiB/s has 2.4 s,
    sent here at ~2 MiB/s over ~1 s: answered, whether its header came whole in the first write
    or in two."""
    caplog.set_level(logging.ERROR, logger="pagedkv.framed")
    port = Port(BulkLimits(idle_timeout_s=30, frame_timeout_s=FRAME_TIMEOUT_S, min_bytes_per_s=1 << 20))
    try:
        stream = big_open(3, num_tokens=500_000)
        results = {}
        for first in (200, 20):  # whole header; the header cut at 20 bytes
            sock = port.hostile()
            sock.sendall(stream[:first])
            time.sleep(0.05)
            start, at = time.monotonic(), first
            ok = True
            while at < len(stream) and ok:
                ok = send_quietly(sock, stream[at : at + (128 << 10)])
                at += 128 << 10
                time.sleep(0.06)
            sock.settimeout(3)
            try:
                head = wire.read_reply(sock)
                results[first] = (wire.Status(head.status).name, round(time.monotonic() - start, 2))
            except (ProtocolError, OSError) as exc:
                results[first] = (f"closed: {exc!r}", round(time.monotonic() - start, 2))
        assert results[200][0] == "RESOURCE_EXHAUSTED", results
        assert results[20][0] == "RESOURCE_EXHAUSTED", results
        port.check(caplog)
    finally:
        port.stop()


def test_the_loop_and_the_threads_share_the_listeners_budget(caplog) -> None:
    """max_inflight_bytes bounds the bytes of large requests being received on the listener: a
    connection still on its thread reserves 3 MiB of a 4 MiB budget (its first request stalls),
    so a link on the loop whose request says 3 MiB more does not get them too (the loop counts
    against the listener's budget, as its docstring says)."""
    caplog.set_level(logging.ERROR, logger="pagedkv.framed")
    limits = BulkLimits(
        idle_timeout_s=30, frame_timeout_s=5, min_bytes_per_s=64 << 20, max_inflight_bytes=4 << 20
    )
    port = Port(limits)
    try:
        on_thread = port.hostile(adopt=False)
        on_thread.sendall(header(request_id=2, text=b"Open", payload_len=3 << 20) + bytes(1000))
        until(lambda: port.server.budget.used == 3 << 20, "the thread's reservation")
        on_loop = port.hostile()
        on_loop.sendall(header(request_id=3, text=b"Open", payload_len=3 << 20) + bytes(1000))
        assert drain(on_loop)[1], "the loop's link past the shared budget closed"
        assert port.server.budget.used == 3 << 20 and port.loop._held == 0
        port.check(caplog)
    finally:
        port.stop()


@pytest.mark.parametrize("lead", ["ping-and-report", "open"])
@pytest.mark.parametrize("where", ["thread", "loop"])
def test_replies_to_calls_before_bytes_that_are_no_request_are_sent(port, caplog, lead, where) -> None:
    """Calls, then bytes that are no request, in one write: the calls' replies are sent before
    the connection is closed, on the loop as on a connection's own thread (which answers each
    before it reads the next); an open placed is one its worker hears of."""
    sock = port.hostile(adopt=where == "loop")
    port.seq_ids.add("before-garbage")
    if lead == "open":
        calls, want = open_request(5, "before-garbage", list(range(1, 9))), [5]
    else:
        calls, want = ping(5) + report("n2", 6, op=wire.OP_UNARY), [5, 6]
    sock.sendall(calls + b"XXXX" + bytes(FRAME.size))
    got, closed = drain(sock)
    assert closed
    assert [f.request_id for f in frames_of(got)] == want
    port.check(caplog)


class HeldFree(pb_grpc.CacheNodeServicer):
    """A node whose Free answers once `release` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def Free(self, request: pb.SeqRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.release.wait(10)
        return pb.Empty()


def test_a_request_pipelined_behind_a_call_answered_off_the_loop_is_not_cut(caplog) -> None:
    """A worker's reopen that must wait for its node's Free (answered from a thread, Offload) and
    its close, whole, in the same write: the close waits its turn, however long the reopen takes
    (the thread path times a request from when it reads it, after the call before it), and both
    are answered in order. The node holds the Free for 1.5 s, well past the frame timeout."""
    caplog.set_level(logging.ERROR, logger="pagedkv.framed")
    node = HeldFree()
    node_server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_CacheNodeServicer_to_server(node, node_server)
    address = f"127.0.0.1:{node_server.add_insecure_port('127.0.0.1:0')}"
    node_server.start()
    port = Port(nodes={"n1": address})
    port.seq_ids.add("s")
    prompt = list(range(1, 30))
    try:
        worker = port.hostile(adopt=False)
        worker.sendall(open_request(1, "s", prompt))
        assert reply(worker, pb.CoordOpenResponse)[0].status == OK
        worker.sendall(close_request(2, "s", freed_extents=0))  # the coordinator sends the Free
        assert reply(worker, pb.Empty)[0].status == OK
        assert port.coordinator.is_in_flight("s")
        threading.Timer(1.5, node.release.set).start()
        worker.sendall(open_request(3, "s", prompt) + close_request(4, "s"))
        worker.settimeout(5)
        try:
            got = [reply(worker, m)[0] for m in (pb.CoordOpenResponse, pb.Empty)]
            answers = [(h.request_id, wire.Status(h.status).name) for h in got]
        except (ProtocolError, OSError) as exc:
            answers = [f"closed: {exc!r}"]
        assert answers == [(3, "OK"), (4, "OK")]
        until(lambda: not port.coordinator.is_in_flight("s"), "the reopen settled")
        port.check(caplog)
    finally:
        node.release.set()
        port.stop()
        node_server.stop(0)


def test_a_bad_beat_read_with_good_ones_fails_alone(port, caplog) -> None:
    """Beats read in one turn are renewed together (one store round trip): one of them that the
    store refuses (a load below 0, an empty node id) is answered with its error, and the beats of
    other nodes read with it renew as they would alone."""
    coordinator, server = port.coordinator, port.server
    negative = pb.HeartbeatRequest(node_id="n2")
    negative.load.free_blocks = -1
    for bad_message in (negative, pb.HeartbeatRequest(node_id="")):
        bad, other = port.hostile(), port.hostile()
        with coordinator.store._lock:  # the loop's next store call waits: the beats pile up
            port.good.sendall(beat("n1", port.next_rid()))
            time.sleep(0.1)
            bad.sendall(encode_unary(7, "Heartbeat", b"", bad_message.SerializeToString(), wire.OP_UNARY))
            other.sendall(beat("n2", 7))
            time.sleep(0.2)
        head = wire.read_reply(port.good)
        if head.payload_len:
            wire.recv_bytes(port.good, head.payload_len, "reply")
        assert head.status == OK, head.text
        bad_head = wire.read_reply(bad)
        assert bad_head.status != OK
        other_head = wire.read_reply(other)
        assert other_head.status == OK, f"a good beat batched with {bad_message}: {other_head.text}"
        assert server._loop.num_batches > 0
    port.check(caplog)


# -- a seeded fuzz -------------------------------------------------------------------------------

FUZZ_SEED = 20240611
FUZZ_S = 15.0  # wall time of the rounds
LINKS_PER_ROUND = 8  # of which PRISTINE send only valid requests
PRISTINE = 2
CHUNKS = [1, 2, 5, 13, 54, 60, 200, 1500, 9000, 70_000]


class Stream:
    """A link's bytes and what it should get back: the request ids of its replies, in order
    (for a pristine stream)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.reply_ids: list[int] = []


def valid_frame(
    rng: random.Random, stream: Stream, rid: int, seq_prefix: str, seq_ids: set[str]
) -> tuple[bytes, str]:
    """One valid request of id `rid` (noting whether a reply comes back), and its kind."""
    kind = rng.choices(
        ["beat", "open", "close", "ping", "report", "report-unary", "unknown", "big"],
        weights=[30, 15, 10, 10, 15, 5, 3, 2],
    )[0]
    replies = True
    if kind == "beat":
        data = beat(rng.choice(NODES), rid, free=rng.randrange(64), wait_s=rng.choice([0.0, 0.01, 0.05]))
    elif kind == "open":
        seq_id = f"{seq_prefix}-{rng.randrange(6)}"
        seq_ids.add(seq_id)
        data = open_request(rid, seq_id, [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 20))])
    elif kind == "close":
        data = close_request(rid, f"{seq_prefix}-{rng.randrange(6)}")
    elif kind == "ping":
        data = ping(rid)
    elif kind == "report":
        data, replies = report(rng.choice(NODES), rid, num_events=rng.randrange(1, 5)), False
    elif kind == "report-unary":
        data = report(rng.choice(NODES), rid, op=wire.OP_UNARY)
    elif kind == "unknown":
        data = header(request_id=rid, text=b"Bogus", payload_len=3) + b"abc"
    else:
        data = rng.choice([big_open(rid, 20_000), big_beat("n2", rid)])
    if replies:
        stream.reply_ids.append(rid)
    return data, kind


def mutate(rng: random.Random, data: bytes, is_open: bool) -> bytes:
    """One frame's bytes changed as an attacker or a broken peer would (an open's body kept: its
    sequence id is one the test knows, to close)."""
    kind = rng.choice(
        ["flip-header", "flip-body", "truncate", "garbage", "oversize", "start", "op", "text-len", "twice"]
    )
    if kind == "flip-body" and is_open:
        kind = "flip-header"
    b = bytearray(data)
    if kind == "flip-header":
        at = rng.randrange(FRAME.size)
        b[at] ^= 1 << rng.randrange(8)
    elif kind == "flip-body" and len(b) > FRAME.size + 12:
        at = rng.randrange(FRAME.size + 12, len(b))  # (past the method's name: any id may change)
        b[at] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del b[rng.randrange(len(b)) :]
    elif kind == "garbage":
        return rng.randbytes(rng.choice([1, 4, 54, 60, 300]))
    elif kind == "oversize":
        size = rng.choice(
            [
                READ_BYTES + 1,
                rng.randrange(READ_BYTES, 2 << 20),
                MAX_MESSAGE,
                MAX_MESSAGE + 1,
                2**32,
                2**64 - 1,
            ]
        )
        struct.pack_into("<Q", b, AT_PLEN, size)
    elif kind == "start":
        struct.pack_into("<Q", b, AT_START, struct.unpack_from("<Q", b, AT_PLEN)[0] + rng.randrange(1, 100))
    elif kind == "op":
        b[AT_OP] = rng.randrange(256)
    elif kind == "text-len":
        struct.pack_into("<H", b, AT_TLEN, rng.choice([0, 1, 4095, 4096, 4097, 65535]))
    else:
        b += data
    return bytes(b)


def build_stream(rng: random.Random, pristine: bool, seq_prefix: str, seq_ids: set[str]) -> Stream:
    stream = Stream()
    rid = 1
    if rng.random() < 0.85 or pristine:  # a first call that moves the link to the loop
        stream.parts.append(beat("n2", rid))
        stream.reply_ids.append(rid)
        rid += 1
    for _ in range(rng.randrange(5, 40)):
        data, kind = valid_frame(rng, stream, rid, seq_prefix, seq_ids)
        rid += 1
        if not pristine and rng.random() < 0.15:
            data = mutate(rng, data, kind == "open")
        stream.parts.append(data)
    return stream


def drive(sock: socket.socket, stream: Stream, seed: int, pristine: bool, received: bytearray) -> str:
    """Send the stream in random-sized writes, reading what comes back meanwhile; then close,
    half-close or stall (left open) as chosen. How it ended."""
    rng = random.Random(seed)
    data = b"".join(stream.parts)
    sock.settimeout(3)
    at = 0

    def take() -> bool:
        """What the port sent so far; False once it closed the connection."""
        while True:
            try:
                if not select.select([sock], [], [], 0)[0]:
                    return True
                chunk = sock.recv(1 << 16)
            except (OSError, ValueError):
                return False
            if not chunk:
                return False
            received.extend(chunk)

    while at < len(data):
        n = rng.choice(CHUNKS)
        if not send_quietly(sock, data[at : at + n]):
            return "closed by the port"
        at += n
        if not take():
            return "closed by the port"
        if rng.random() < 0.05:
            time.sleep(rng.choice([0.001, 0.01, 0.03]))
    if pristine:  # every reply, or the test fails on what is missing
        deadline = time.monotonic() + 5
        while len(frames_of(received)) < len(stream.reply_ids) and time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(1 << 16)
            except OSError:
                break
            if not chunk:
                break
            received.extend(chunk)
        return "pristine"
    end = rng.choice(["close", "close", "shutdown", "stall"])
    if end == "close":
        sock.close()
    elif end == "shutdown":
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)
    return end


def test_a_seeded_fuzz_of_valid_and_mutated_frames_over_many_links(port, caplog) -> None:
    """Rounds of LINKS_PER_ROUND links at once, each a stream of valid requests with mutations
    in (none on PRISTINE of them), sent in random-sized writes while the good link beats: the
    pristine links get every reply in order, what any link gets back is whole frames, the good
    link's beats are all answered; after each round properties 1 and 2, at the end 3."""
    rng = random.Random(FUZZ_SEED)
    start = time.monotonic()
    rounds = 0
    while time.monotonic() - start < FUZZ_S:
        streams = [
            build_stream(rng, i < PRISTINE, f"fz{rounds}-{i}", port.seq_ids) for i in range(LINKS_PER_ROUND)
        ]
        socks = [port.hostile(adopt=False) for _ in streams]
        received = [bytearray() for _ in streams]
        ends: list[str] = [""] * len(streams)
        seeds = [rng.randrange(1 << 30) for _ in streams]

        def run(i: int) -> None:
            ends[i] = drive(socks[i], streams[i], seeds[i], i < PRISTINE, received[i])  # noqa: B023

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(streams))]
        for t in threads:
            t.start()
        latencies = []
        while any(t.is_alive() for t in threads):
            rid = port.next_rid()
            sent = time.monotonic()
            port.good.settimeout(5)
            port.good.sendall(beat("n1", rid))
            head = wire.read_reply(port.good)  # (answered; a hostile beat batched with it may fail it)
            if head.payload_len:
                wire.recv_bytes(port.good, head.payload_len, "reply")
            assert head.request_id == rid, (rounds, head.request_id, rid)
            latencies.append(time.monotonic() - sent)
            time.sleep(0.01)
        for t in threads:
            t.join(10)
        assert max(latencies, default=0) < 2.0, (rounds, max(latencies))
        for i, stream in enumerate(streams):
            try:
                frames = frames_of(received[i])
            except ProtocolError as exc:
                raise AssertionError(
                    f"round {rounds} link {i}: the port sent something not a frame: {exc}"
                ) from None
            if i < PRISTINE:
                assert [f.request_id for f in frames] == stream.reply_ids, (rounds, i, ends[i])
        port.check(caplog)  # properties 1 and 2 (and 3 so far)
        rounds += 1
    assert rounds >= 3
