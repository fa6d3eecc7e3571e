"""Opens and closes answered together on the coordinator's framed loop, as an attacker
sees them: on a plain-TCP framed port (where the loop serves workers; a TLS port keeps a
thread per connection) with tenants, a victim's workers and an attacker's connections send
at the same moments, so their calls meet in the loop's batches (one store round trip per
batch, real Redis). The attacker's forged token, garbage, an oversized request id and closes of the
victim's ids are each answered with their own error and change nothing; every victim call
gets exactly the answer it would get alone, and nothing is left open or in flight."""

from __future__ import annotations

import socket
import time

import pytest

from pagedkv.coordinator.auth import Tenants
from pagedkv.coordinator.core import Coordinator, CoordinatorConfig
from pagedkv.coordinator.redis_store import RedisStore
from pagedkv.coordinator.service import create_server
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import wire
from pagedkv.protos.wire.unary import encode_metadata, encode_unary

pytestmark = pytest.mark.timeout(120)
SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32", "block_size": 4}
TOKENS = {"tok-alpha": "alpha", "tok-beta": "beta"}
ALPHA = encode_metadata([("authorization", "Bearer tok-alpha")])
BETA = encode_metadata([("authorization", "Bearer tok-beta")])
FORGED = encode_metadata([("authorization", "Bearer tok-alpha-x")])
PROMPT = list(range(100, 160))


def frame(request_id: int, method: str, metadata: bytes, message: bytes) -> bytes:
    return encode_unary(request_id, method, metadata, message, wire.OP_UNARY)


def open_msg(seq_id: str) -> bytes:
    return pb.CoordOpenRequest(seq_id=seq_id, token_ids=PROMPT, worker_opens=True).SerializeToString()


def close_msg(seq_id: str) -> bytes:
    return pb.CoordSeqRequest(seq_id=seq_id, freed_extents=1).SerializeToString()


def replies(sock: socket.socket, n: int) -> list[tuple[int, str, bytes]]:
    out = []
    for _ in range(n):
        head = wire.read_reply(sock)
        body = wire.recv_bytes(sock, head.payload_len, "reply") if head.payload_len else b""
        out.append((head.request_id, wire.Status(head.status).name, body))
    return out


@pytest.fixture
def port(redis_url: str):  # type: ignore[no-untyped-def]
    coordinator = Coordinator(RedisStore(redis_url), CoordinatorConfig(lease_ttl_s=30))
    for n in ("n1", "n2"):
        coordinator.register(n, "127.0.0.1:1", SPEC, 10_000, 1)
    server, _ = create_server(coordinator, "127.0.0.1:0", tenants=Tenants(TOKENS), frame_port=0)
    server.start()
    framed = server.companions[0]
    yield coordinator, framed
    server.stop(0)
    coordinator.stop()


def test_an_attackers_calls_in_the_victims_batches_change_nothing_of_the_victims(port) -> None:  # type: ignore[no-untyped-def]
    coordinator, framed = port
    victims = [socket.create_connection(("127.0.0.1", framed.port), timeout=10) for _ in range(4)]
    attackers = [socket.create_connection(("127.0.0.1", framed.port), timeout=10) for _ in range(3)]
    for sock in victims + attackers:  # each on the loop first (a close of nothing)
        sock.sendall(frame(1, "Close", ALPHA if sock in victims else BETA, close_msg("nothing")))
        assert replies(sock, 1)[0][1] == "OK"
    deadline = time.monotonic() + 10
    while framed._loop.num_links < 7:
        assert time.monotonic() < deadline, "links not adopted"
        time.sleep(0.01)
    batches = framed._loop.num_batches
    hostile = [
        (FORGED, "Open", open_msg("v0-1")),  # a forged token: naming the victim's id
        (BETA, "Close", close_msg("v0-1")),  # the victim's id, in the attacker's own scope
        (BETA, "Open", b"\xff\xff\xff garbage"),
        (
            BETA,
            "Open",
            pb.CoordOpenRequest(seq_id="r", token_ids=PROMPT, request_id="r" * 200).SerializeToString(),
        ),
        (BETA, "Close", pb.CoordSeqRequest(seq_id="v1-1", keep_prefix=-5).SerializeToString()),
        (b"\x00\x01", "Close", close_msg("v1-1")),  # metadata that does not parse
        (BETA, "Open", open_msg("beta-own")),  # a legitimate open of its own
    ]
    for rnd in range(5):
        for i, sock in enumerate(victims):  # each victim: open, then (next round) close
            sock.sendall(frame(10 + rnd, "Open", ALPHA, open_msg(f"v{i}-{rnd}")))
        for j, sock in enumerate(attackers):
            metadata, method, message = hostile[(rnd * 3 + j) % len(hostile)]
            sock.sendall(frame(100 + rnd, method, metadata, message))
        got = {i: replies(sock, 1)[0] for i, sock in enumerate(victims)}
        for i, (request_id, status, body) in got.items():
            assert (request_id, status) == (10 + rnd, "OK")
            assert pb.CoordOpenResponse.FromString(body).node_seq_id == f"alpha/v{i}-{rnd}"
        for sock in attackers:
            (request_id, status, _), *_ = replies(sock, 1)
            assert request_id == 100 + rnd and status in (
                "OK",  # a close of an id of its own scope (none: nothing happens), or its own open
                "UNAUTHENTICATED",
                "INVALID_ARGUMENT",
                "FAILED_PRECONDITION",  # its own open again: SequenceExists
            ), status
    assert framed._loop.num_batches > batches
    alive = {r.seq_id for n in ("n1", "n2") for r in coordinator.store.sequences_of_node(n)}
    assert {s for s in alive if s.startswith("alpha/")} == {
        f"alpha/v{i}-{r}" for i in range(4) for r in range(5)
    }
    assert alive - {s for s in alive if s.startswith("alpha/")} <= {"beta/beta-own"}
    for rnd in range(5):  # the victims close everything they opened, in batches too
        for i, sock in enumerate(victims):
            sock.sendall(frame(50 + rnd, "Close", ALPHA, close_msg(f"v{i}-{rnd}")))
        for sock in victims:
            assert replies(sock, 1)[0][1] == "OK"
    left = {r.seq_id for n in ("n1", "n2") for r in coordinator.store.sequences_of_node(n)}
    assert left <= {"beta/beta-own"}
    assert not any(coordinator.is_in_flight(f"alpha/v{i}-{r}") for i in range(4) for r in range(5))
    for sock in victims + attackers:
        sock.close()
