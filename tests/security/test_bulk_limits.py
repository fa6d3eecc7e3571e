"""The bulk channel cannot be held or inflated: idle and trickling connections are
closed after the node's timeouts (BULK_TIMEOUT_S here), one peer gets at most
MAX_PER_PEER connections, and requests that declare more than the node will take
are refused from their header, before a byte of payload is read or allocated."""

from __future__ import annotations

import contextlib
import socket
import time
from typing import Any

import pytest
import torch
from hostile import BULK_TIMEOUT_S, MAX_PER_PEER, NUM_BLOCKS, SPEC, Secured, reply, rss_bytes, send

from pagedkv.protos import wire
from pagedkv.protos.errors import CapacityExceeded


def _closed(sock: Any, within_s: float) -> bool:
    """True when the peer closed sock (EOF or reset) within `within_s`."""
    sock.settimeout(within_s)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:
        return True
    return True


def _answers(sock: Any) -> bool:
    try:
        send(sock, wire.Frame(wire.OP_PING, 9))
        return reply(sock).status == wire.Status.OK
    except (wire.ProtocolError, OSError):
        return False


def _other_node(cluster: Secured) -> str:
    """A node the other tests' clients use least (the victim is elsewhere)."""
    v = cluster.victim
    assert v is not None
    return next(a for a in cluster.node_addresses() if a != v.address)


def test_idle_connections_are_capped_per_peer_and_closed(cluster: Secured) -> None:
    address = _other_node(cluster)
    time.sleep(BULK_TIMEOUT_S + 0.5)  # the suite's own pooled connections timed out first
    held: list[Any] = []
    refused = False
    try:
        for _ in range(MAX_PER_PEER + 2):
            try:  # one over the cap is closed at once: its TLS handshake (or first reply) fails
                sock = cluster.bulk_tcp(address)
                held.append(sock)
                send(sock, wire.Frame(wire.OP_PING, 1))  # admitted connections answer
                assert reply(sock).status == wire.Status.OK
            except (wire.ProtocolError, OSError):
                refused = True
                break
        assert refused and len([s for s in held if _answers(s)]) == MAX_PER_PEER, len(held)
        start = time.monotonic()
        assert all(_closed(s, BULK_TIMEOUT_S + 3) for s in held)  # idle: closed by the node
        assert time.monotonic() - start < BULK_TIMEOUT_S + 3
        with cluster.bulk_tcp(address) as fresh:  # and the slots are free again
            send(fresh, wire.Frame(wire.OP_PING, 2))
            assert reply(fresh).status == wire.Status.OK
    finally:
        for s in held:
            with contextlib.suppress(OSError):
                s.close()


def test_a_trickling_request_is_cut_by_its_deadline(cluster: Secured) -> None:
    address = _other_node(cluster)
    head = wire.Frame(wire.OP_PING, 1).pack()
    for connect in (cluster.bulk_tcp, cluster.bulk_unix):
        with connect(address) as sock:
            start = time.monotonic()
            cut = False
            for byte in head:  # one byte every 0.25 s: 54 bytes would take 13 s
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                if _closed(sock, 0.25):
                    cut = True
                    break
            took = time.monotonic() - start
            assert cut and took < 2 * BULK_TIMEOUT_S + 1, (connect.__name__, took)


def test_declared_sizes_are_refused_from_the_header_without_allocating(cluster: Secured) -> None:
    address = _other_node(cluster)
    name = next(
        n for n, a in zip(("node-0", "node-1"), cluster.node_addresses(), strict=True) if a == address
    )
    pid = cluster.cluster.procs[name].pid
    rss_before = rss_bytes(pid)
    big = 64 << 20
    for i in range(MAX_PER_PEER):  # OPENs declaring 64 MiB each, no payload sent
        with cluster.bulk_tcp(address) as sock:
            send(sock, wire.Frame(wire.OP_OPEN, i, end=big // 8, text=f"x{i}", payload_len=big))
            r = reply(sock)
            assert r.status == wire.Status.PERMISSION_DENIED, r
            assert _closed(sock, 2.0)  # refused, not drained: the connection closes
        with cluster.bulk_tcp(address) as sock:  # an ATTEND body from a connection that presented nothing
            send(sock, wire.Frame(wire.OP_ATTEND, i, payload_len=big))
            r = reply(sock)
            assert r.status == wire.Status.UNAUTHENTICATED, r
            assert _closed(sock, 2.0)
    # an APPEND larger than the pool (and than the node drains), from a tenant with a valid
    # ticket for its own sequence
    beta = cluster.clients["beta"]
    seq = next(s for s in (beta.open(f"big-{i}", [3, 4, 5]) for i in range(20)) if _keep(s, address))
    try:
        n = max(NUM_BLOCKS * SPEC.block_size, wire.MAX_DRAIN_BYTES // SPEC.bytes_per_token) + 1
        with cluster.bulk_tcp(address) as sock:
            sock.sendall(wire.encode_auth(1, [seq.route.ticket]))
            assert reply(sock).status == wire.Status.OK
            frame = wire.Frame(
                wire.OP_APPEND,
                2,
                end=n,
                num_layers=SPEC.num_layers,
                num_kv_heads=SPEC.num_kv_heads,
                head_dim=SPEC.head_dim,
                slab_tokens=n,
                text=seq.route.node_seq_id,
                payload_len=n * SPEC.bytes_per_token,
            )
            send(sock, frame)  # the header only: the refusal comes without the payload
            r = reply(sock)
            assert r.status == wire.Status.RESOURCE_EXHAUSTED and "more than the whole pool" in r.text, r
            assert _closed(sock, 2.0)
        # the client library gets that refusal as the node's error, not as a broken connection
        for transports in (("tcp", "grpc"), ("unix", "grpc")):
            with cluster.client("beta", transports=transports, bulk_min_bytes=0) as client:
                mine = client.sequence(seq.seq_id)
                k = torch.zeros(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)
                with pytest.raises(CapacityExceeded, match="more than the whole pool"):
                    mine.append(list(range(n)), k, k)
    finally:
        seq.close()
    grown = rss_bytes(pid) - rss_before
    assert grown < 16 << 20, f"the node grew by {grown} bytes"
    assert cluster.health(address) == "SERVING"


_spare: list[Any] = []


def _keep(seq: Any, address: str) -> bool:
    if seq.route.address == address:
        for other in _spare:
            other.close()
        _spare.clear()
        return True
    _spare.append(seq)
    return False


def test_a_plaintext_peer_gets_nothing_from_a_tls_port(cluster: Secured) -> None:
    address = _other_node(cluster)
    port = cluster.bulk_port(address)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(wire.Frame(wire.OP_HELLO, 1).pack())
        data = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(4096):
                data += chunk
        assert wire.MAGIC not in data  # a TLS alert at most, never a pagedkv frame
