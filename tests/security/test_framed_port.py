"""The coordinator's framed port (UNARY frames) as an attacker sees it: the secured
cluster's coordinator serves it over TLS beside gRPC; the attacker (tenant beta) has
the CA, its own token and the codec. Every hostile request gets an error reply naming
what was wrong, or its connection closed; nothing is opened or freed that the same
request over gRPC would not; the victim's sequence stays intact (the fixture checks)."""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import time
from collections import Counter

import pytest
from hostile import TOKENS, Secured, rss_bytes

from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import wire
from pagedkv.protos.errors import SequenceNotFound
from pagedkv.protos.tickets import RIGHT_NODE, TICKET_KEY, ClusterKeys, Minter
from pagedkv.protos.wire.unary import PAIR, encode_metadata, encode_unary

FUZZ_CASES = 600
BETA = encode_metadata([("authorization", f"Bearer {TOKENS['beta']}")])


def framed_port(s: Secured) -> int:
    client = s.clients["beta"]
    client.open("fp-probe", list(range(9_000, 9_040))).close()
    port = client.routing.framed.port if client.routing.framed is not None else 0
    assert port, "the coordinator advertised no framed port"
    return port


def connect(s: Secured, tls: bool = True) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", framed_port(s)), timeout=10)
    if not tls:
        return sock
    ctx = ssl.create_default_context(cafile=s.client_tls.ca_file)
    return ctx.wrap_socket(sock, server_hostname="127.0.0.1")


def call(
    sock: socket.socket, method: str, message: bytes, metadata: bytes = BETA
) -> tuple[wire.Frame, bytes]:
    sock.sendall(encode_unary(7, method, metadata, message))
    head = wire.read_reply(sock)
    return head, wire.recv_bytes(sock, head.payload_len, "reply") if head.payload_len else b""


def open_request(seq_id: str) -> bytes:
    return pb.CoordOpenRequest(seq_id=seq_id, token_ids=list(range(20_000, 20_040))).SerializeToString()


def is_closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def test_the_clients_opens_and_closes_take_the_framed_port(cluster: Secured) -> None:
    framed_port(cluster)  # (a client's first open learns the port)
    framed = cluster.clients["beta"].routing.framed
    assert framed is not None
    before = framed.num_calls
    for i in range(3):
        cluster.clients["beta"].open(f"fp-{i}", list(range(30_000, 30_040))).close()
    assert framed.num_calls - before == 6 and framed.num_fallbacks == 0


def test_a_call_without_a_token_is_refused_and_the_connection_stays_usable(cluster: Secured) -> None:
    with connect(cluster) as sock:
        head, _ = call(sock, "Open", open_request("fp-anon"), metadata=b"")
        assert head.status == wire.Status.UNAUTHENTICATED and "authorization" in head.text
        head, body = call(sock, "Open", open_request("fp-after"))
        assert head.status == wire.Status.OK, head.text
        assert pb.CoordOpenResponse.FromString(body).node_seq_id.endswith("fp-after")
        head, _ = call(sock, "Close", pb.CoordSeqRequest(seq_id="fp-after").SerializeToString())
        assert head.status == wire.Status.OK, head.text


@pytest.mark.parametrize(
    "method,message,expect",
    [
        ("Register", pb.RegisterRequest(node_id="evil").SerializeToString(), "no method 'Register'"),
        ("Stats", b"", "no method 'Stats'"),
        ("Open", b"\xff\xff\xff\xff", "does not parse"),
    ],
    ids=["a node's Register", "an unserved rpc", "a body that does not parse"],
)
def test_a_bad_request_gets_an_error_naming_it(
    cluster: Secured, method: str, message: bytes, expect: str
) -> None:
    with connect(cluster) as sock:
        head, _ = call(sock, method, message)
        assert head.status == wire.Status.INVALID_ARGUMENT and expect in head.text, head.text
        sock.sendall(wire.Frame(wire.OP_PING, 2).pack())  # still in sync
        assert wire.read_reply(sock).status == wire.Status.OK


def test_metadata_that_runs_past_itself_is_refused(cluster: Secured) -> None:
    meta = PAIR.pack(13, 60_000) + b"authorization"
    with connect(cluster) as sock:
        head, _ = call(sock, "Open", open_request("fp-meta"), metadata=meta)
        assert head.status == wire.Status.INVALID_ARGUMENT and "runs past" in head.text


def test_another_tenants_sequence_cannot_be_closed_through_it(cluster: Secured) -> None:
    """beta's "victim" is beta's own id (none: a close of it is a no-op, as over gRPC);
    alpha's sequence of that name is untouched (the fixture reads its KV back)."""
    with connect(cluster) as sock:
        head, _ = call(sock, "Close", pb.CoordSeqRequest(seq_id="victim").SerializeToString())
    assert head.status == wire.Status.OK, head.text
    victim = cluster.victim
    assert victim is not None
    assert cluster.clients["alpha"].sequence("victim").route.node_seq_id == victim.node_seq_id


@pytest.mark.parametrize("method", ["Heartbeat", "ReportEvents"])
def test_a_nodes_calls_need_the_nodes_credential(cluster: Secured, method: str) -> None:
    node_id = "node-0"
    message = (
        pb.HeartbeatRequest(node_id=node_id)
        if method == "Heartbeat"
        else pb.ReportEventsRequest(node_id=node_id, events=[pb.BlockEvent(kind=2, key=b"k" * 16)])
    )
    with connect(cluster) as sock:
        head, _ = call(sock, method, message.SerializeToString())
    assert head.status == wire.Status.UNAUTHENTICATED and "cluster credential" in head.text, head.text


@pytest.mark.parametrize(
    "frame,payload",
    [
        (wire.Frame(wire.OP_UNARY, 1, text="Open", start=64, payload_len=8), b"x" * 8),
        (wire.Frame(wire.OP_UNARY, 1, text="Open", payload_len=1 << 30), b""),
        (wire.Frame(wire.OP_ATTEND, 1, payload_len=16), b"y" * 16),
        (wire.Frame(wire.OP_NOTIFY, 1, text="Open", payload_len=8), b"x" * 8),
        (wire.Frame(wire.OP_NOTIFY, 1, text="ReportEvents", payload_len=1 << 30), b""),
        (wire.Frame(wire.OP_NOTIFY, 1, text="ReportEvents", payload_len=3), b"\xff\xff\xff"),
    ],
    ids=[
        "metadata past the payload",
        "a 1 GiB request",
        "a node's op",
        "a one-way Open",
        "a 1 GiB one-way report",
        "a one-way report that does not parse",
    ],
)
def test_a_request_that_cannot_be_read_is_answered_then_closed(
    cluster: Secured, frame: wire.Frame, payload: bytes
) -> None:
    pid = cluster.cluster.procs["coordinator"].pid
    rss = rss_bytes(pid)
    with connect(cluster) as sock:
        sock.sendall(frame.pack() + payload)
        head = wire.read_reply(sock)
        assert head.status == wire.Status.INVALID_ARGUMENT and head.text, head
        assert is_closed(sock)
    assert rss_bytes(pid) - rss < 64 << 20  # nothing the size of the claimed payload was taken


def test_bad_framing_closes_the_connection(cluster: Secured) -> None:
    with connect(cluster) as sock:
        sock.sendall(b"HTTP/1.1 GET /\r\n" + b"\0" * 64)
        assert is_closed(sock)


def test_a_plaintext_peer_gets_nothing(cluster: Secured) -> None:
    with connect(cluster, tls=False) as sock:
        sock.sendall(encode_unary(1, "Open", BETA, open_request("fp-plain")))
        try:
            data = sock.recv(64)
        except ConnectionError:
            data = b""
    assert not data.startswith(wire.MAGIC)
    with pytest.raises(SequenceNotFound):
        cluster.clients["beta"].sequence("fp-plain")  # nothing opened


def test_random_unary_frames_get_errors_not_failures(cluster: Secured) -> None:
    """Seeded random calls on one connection: served methods with random, truncated or
    mutated bodies and metadata. Every reply is a status a handler gives on purpose (never
    INTERNAL or UNKNOWN) and the connection stays in step; the coordinator keeps serving."""
    r = random.Random(41)
    good = {
        "Open": open_request("fz-open"),
        "Close": pb.CoordSeqRequest(seq_id="fz-open").SerializeToString(),
        "Heartbeat": pb.HeartbeatRequest(node_id="node-0").SerializeToString(),
        "ReportEvents": pb.ReportEventsRequest(node_id="node-1").SerializeToString(),
    }
    metas = [BETA, b"", encode_metadata([("authorization", "Bearer forged")]), PAIR.pack(3, 2) + b"abcde"]
    statuses: Counter[str] = Counter()
    with connect(cluster) as sock:
        for _ in range(FUZZ_CASES):
            method = r.choice([*good, "Open", "Close", r.choice(["", "open", "Open\x00", "Stats"])])
            body = good.get(method, b"")
            kind = r.random()
            if kind < 0.3:
                body = body[: r.randrange(len(body) + 1)]
            elif kind < 0.6 and body:
                pos = r.randrange(len(body))
                body = body[:pos] + bytes([r.randrange(256)]) + body[pos + 1 :]
            elif kind < 0.7:
                body = r.randbytes(r.randrange(64))
            head, _ = call(sock, method, body, metadata=r.choice(metas))
            name = wire.Status(head.status).name
            statuses[name] += 1
            assert name not in ("INTERNAL", "UNKNOWN"), (method, body, head.text)
        sock.sendall(wire.Frame(wire.OP_PING, 3).pack())
        assert wire.read_reply(sock).status == wire.Status.OK
    assert statuses["INVALID_ARGUMENT"] and statuses["UNAUTHENTICATED"], statuses
    with contextlib.suppress(Exception):
        cluster.clients["beta"].routing._call("Close", pb.CoordSeqRequest(seq_id="fz-open"), None)


@pytest.mark.parametrize(
    "credential,expect",
    [
        ("forged", wire.Status.UNAUTHENTICATED),
        ("another node's", wire.Status.PERMISSION_DENIED),
        ("a worker's token", wire.Status.UNAUTHENTICATED),
    ],
)
def test_a_forged_or_misused_credential_is_refused_on_a_nodes_calls(
    cluster: Secured, credential: str, expect: wire.Status
) -> None:
    """A node ticket signed with another secret, node-1's genuine ticket named for node-0, a
    tenant's bearer token: each refused before the handler touches node-0's lease or index."""
    forger = ClusterKeys([b"a secret the attacker made up ...................."])
    metadata = {
        "forged": encode_metadata([(TICKET_KEY, Minter(forger, ttl_s=60).get(RIGHT_NODE, "node-0"))]),
        "another node's": encode_metadata(
            [(TICKET_KEY, Minter(cluster.keys, ttl_s=60).get(RIGHT_NODE, "node-1"))]
        ),
        "a worker's token": BETA,
    }[credential]
    with connect(cluster) as sock:
        for message in (
            pb.HeartbeatRequest(node_id="node-0"),
            pb.ReportEventsRequest(node_id="node-0", events=[pb.BlockEvent(kind=3, key=b"k" * 16)]),
        ):
            head, _ = call(
                sock, type(message).__name__.removesuffix("Request"), message.SerializeToString(), metadata
            )
            assert head.status == expect, head.text
    assert cluster.cluster.stats().nodes  # both nodes still registered (the fixture checks them)


@pytest.mark.parametrize(
    "fields,status,says",
    [
        ({"first_seq": 1, "base_seq": 1}, wire.Status.INVALID_ARGUMENT, "base_seq"),
        ({"first_seq": 2**64 - 1}, wire.Status.INVALID_ARGUMENT, "first_seq"),
        ({"first_seq": 1, "epoch": 2**63}, wire.Status.INVALID_ARGUMENT, "epoch"),
        ({"first_seq": 1, "epoch": 0}, wire.Status.INVALID_ARGUMENT, "epoch"),
        ({"first_seq": 1, "key": b"abc"}, wire.Status.INVALID_ARGUMENT, "event 0: a 3-byte key"),
        ({"first_seq": 1, "epoch": 1}, wire.Status.NOT_FOUND, "register again"),  # not its epoch
    ],
    ids=[
        "base past first",
        "seq past 2^63",
        "epoch past 2^63",
        "no epoch",
        "a short key",
        "another registration",
    ],
)
def test_a_nodes_malformed_numbered_reports_are_refused_and_change_nothing(
    cluster: Secured, fields: dict, status: wire.Status, says: str
) -> None:
    """With node-0's own credential (a buggy node): refused by name before anything is queued;
    the index still answers the victim's prompt and node-0 stays live."""
    metadata = encode_metadata([(TICKET_KEY, Minter(cluster.keys, ttl_s=60).get(RIGHT_NODE, "node-0"))])
    fields = {"epoch": 1, **fields}
    key = fields.pop("key", bytes(16))
    message = pb.ReportEventsRequest(
        node_id="node-0", events=[pb.BlockEvent(kind=pb.BlockEvent.REMOVED, key=key)], **fields
    )
    with connect(cluster) as sock:
        head, _ = call(sock, "ReportEvents", message.SerializeToString(), metadata)
    assert head.status == status and says in head.text, head.text
    assert cluster.clients["alpha"].lookup(list(range(50_000, 50_100))) == 96
    assert "node-0" in {n.node_id for n in cluster.cluster.stats().nodes}


@pytest.mark.parametrize("credential", ["forged", "another node's", "none"])
def test_one_way_reports_without_the_nodes_credential_change_nothing(
    cluster: Secured, credential: str
) -> None:
    """A stream of one-way reports for the node holding blocks, under its live epoch,
    removing them: no reply comes (the connection stays in step: the ping after them
    answers first), none is applied: the credential is checked as on a call."""
    from pagedkv.coordinator.redis_store import RedisStore

    store = RedisStore(cluster.cluster.redis_url)
    try:
        held = {n.node_id: store.keys_of(n.node_id) for n in store.live_nodes()}
        target, other = sorted(held, key=lambda n: -len(held[n]))[:2]
        node = store.live_node(target)
        assert node is not None and held[target]
        epoch, applied, keys = node.epoch, store.applied_seq(target, node.epoch), held[target]
        forger = ClusterKeys([b"a secret the attacker made up ...................."])
        metadata = {
            "forged": encode_metadata([(TICKET_KEY, Minter(forger, ttl_s=60).get(RIGHT_NODE, target))]),
            "another node's": encode_metadata(
                [(TICKET_KEY, Minter(cluster.keys, ttl_s=60).get(RIGHT_NODE, other))]
            ),
            "none": b"",
        }[credential]
        with connect(cluster) as sock:
            for i, key in enumerate(sorted(keys)[:50]):
                message = pb.ReportEventsRequest(
                    node_id=target,
                    events=[pb.BlockEvent(kind=pb.BlockEvent.REMOVED, key=key)],
                    epoch=epoch,
                    first_seq=applied + i + 1,
                )
                body = message.SerializeToString()
                sock.sendall(encode_unary(i, "ReportEvents", metadata, body, wire.OP_NOTIFY))
            sock.sendall(wire.Frame(wire.OP_PING, 999).pack())
            head = wire.read_reply(sock)
            assert (head.op, head.request_id, head.status) == (wire.OP_PING, 999, wire.Status.OK)
        time.sleep(0.1)  # (a report taken would be applied within milliseconds)
        assert store.applied_seq(target, epoch) == applied and store.keys_of(target) == keys
    finally:
        store.close()
    assert cluster.clients["alpha"].lookup(list(range(50_000, 50_100))) == 96
    assert {"node-0", "node-1"} <= {n.node_id for n in cluster.cluster.stats().nodes}
