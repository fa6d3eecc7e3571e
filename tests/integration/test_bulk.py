"""The bulk KV channel (docs/bulk-protocol.md) over real sockets: a real node server with
its bulk listener on a free port, the real client, and raw sockets for the
broken peers. Round trips are byte-exact; every bad request gets the gRPC
path's error, changes nothing, leaks no block, and the node keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.serve import kv as node_kv
from pagedkv.cache_node.serve import listener as node_bulk
from pagedkv.cache_node.server import NodeServer, create_server
from pagedkv.client import (
    AsyncCacheClient,
    CacheClient,
    CapacityExceeded,
    ClientConfig,
    InvalidArgument,
    SequenceNotFound,
    shm,
)
from pagedkv.protos import wire
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire import Frame

INVALID = wire.Status.INVALID_ARGUMENT

BULK = ClientConfig(bulk_min_bytes=0)  # every KV transfer takes the bulk channel
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


@pytest.fixture(autouse=True, params=["local", "tcp"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs over both sockets of the channel: the same-host Unix socket
    (the default where the node's listener can be reached) and TCP."""
    if request.param == "tcp":
        monkeypatch.setattr(shm, "is_supported", lambda: False)
    return str(request.param)


class BulkNode:
    def __init__(self, spec: ModelSpec = SPEC, num_blocks: int = 64, bulk_port: int | None = 0) -> None:
        self.engine = CacheEngine(EngineConfig(spec, num_blocks, 8, device="cpu", unknown_seq_grace_s=0.05))
        self.server: NodeServer
        self.server, port = create_server(self.engine, "127.0.0.1:0", bulk_port=bulk_port)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.spec = spec

    @property
    def bulk(self) -> node_bulk.BulkServer:
        assert self.server.bulk is not None
        return self.server.bulk

    def state(self) -> tuple[dict[str, int], dict[str, int]]:
        """Block counts and sequence lengths: what a refused request must leave as it was."""
        self.engine.check_integrity()
        stats = self.engine.stats()
        blocks = {k: stats[k] for k in ("free_blocks", "used_blocks", "cached_blocks") if k in stats}
        lengths = {sid: self.engine.sequence_length(sid) for sid in list(self.engine.manager.seqs)}
        return blocks, lengths


@pytest.fixture
def bulk_node() -> Iterator[BulkNode]:
    node = BulkNode()
    yield node
    node.server.stop(0)


def rand_kv(spec: ModelSpec, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
    dtype = getattr(torch, spec.dtype)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_round_trip_is_byte_exact_for_every_dtype_and_partial_range(dtype: str, transport: str) -> None:
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=4)
    node = BulkNode(spec)
    try:
        with CacheClient(node.address, BULK) as client:
            toks = list(range(1000, 1039))  # 9 full blocks + 3 tokens
            k, v = rand_kv(spec, 39, seed=1)
            with client.open("a", toks[:10]) as seq:
                assert seq.append(toks[:10], k[:, :10], v[:, :10]) == 10
                assert seq.append(toks[10:], k[:, 10:], v[:, 10:]) == 39  # a second append, mid-block
                assert node.bulk.num_requests == 3  # the open and the two appends
                rk, rv = seq.read_kv()
                assert same_bytes(rk, k) and same_bytes(rv, v)
                rk, rv = seq.read_kv(3, 37)  # partial, both ends mid-block
                assert same_bytes(rk, k[:, 3:37]) and same_bytes(rv, v[:, 3:37])
                rk, rv = seq.read_kv(5, 5)
                assert rk.shape == (2, 0, 2, 8) and rv.shape == (2, 0, 2, 8)
                assert node.bulk.num_requests == 6
                # the same bytes over the gRPC path (the contract for small calls)
                with CacheClient(node.address, ClientConfig(bulk_min_bytes=None, chunk_bytes=300)) as grpc_c:
                    gk, gv = grpc_c.sequence("a").read_kv(3, 37)
                assert same_bytes(gk, k[:, 3:37]) and same_bytes(gv, v[:, 3:37])
                assert node.bulk.num_requests == 6
                ch = client.data.bulk
                assert ch is not None and ch.num_local_transfers == (5 if transport == "local" else 0)
            node.engine.check_integrity()
            assert node.engine.stats()["used_blocks"] == 0
    finally:
        node.server.stop(0)


def test_read_in_many_slabs(bulk_node: BulkNode, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_kv, "READ_SLAB_BYTES", 3 * SPEC.bytes_per_token)  # 3-token slabs
    with CacheClient(bulk_node.address, BULK) as client:
        toks = list(range(50))
        k, v = rand_kv(SPEC, 50, seed=2)
        with client.open("s", toks) as seq:
            seq.append(toks, k, v)
            rk, rv = seq.read_kv(1, 50)
            assert same_bytes(rk, k[:, 1:]) and same_bytes(rv, v[:, 1:])


def test_bad_requests_get_clear_errors_and_change_nothing(bulk_node: BulkNode) -> None:
    node = bulk_node
    with CacheClient(node.address, BULK) as client:
        toks = list(range(20))
        k, v = rand_kv(SPEC, 20, seed=3)
        seq = client.open("s", toks)
        seq.append(toks[:8], k[:, :8], v[:, :8])
        before = node.state()
        k2, v2 = rand_kv(SPEC, 4, seed=4)
        with pytest.raises(SequenceNotFound, match="nope"):
            client.data.append("nope", toks[:4], k2, v2)
        with pytest.raises(SequenceNotFound, match="nope"):
            client.data.read_kv("nope")
        with pytest.raises(InvalidArgument, match=r"range \[3, 99\)"):
            seq.read_kv(3, 99)
        with pytest.raises(InvalidArgument, match=r"range \[9, 4\)"):
            seq.read_kv(9, 4)
        with pytest.raises(InvalidArgument, match="dtype 'float16'"):
            seq.append(toks[8:12], k2.half(), v2.half())
        with pytest.raises(InvalidArgument, match="shape"):
            seq.append(toks[8:12], k2[:, :, :1].contiguous(), v2[:, :, :1].contiguous())
        with pytest.raises(InvalidArgument, match="token ids"):
            seq.append(toks[8:11], k2, v2)
        with pytest.raises(InvalidArgument, match="token id -1"):
            seq.append([1, 2, -1, 3], k2, v2)
        big_k, big_v = rand_kv(SPEC, 64 * 4 + 1, seed=5)
        with pytest.raises(CapacityExceeded, match="more than the whole pool"):
            seq.append(list(range(257)), big_k, big_v)
        assert node.state() == before
        assert node.bulk.num_errors >= 8 and node.bulk.num_dropped == 0
        # the same pooled connection still serves good requests
        assert seq.append(toks[8:12], k2, v2) == 12
        rk, _ = seq.read_kv()
        assert same_bytes(rk, torch.cat([k[:, :8], k2], dim=1))
        seq.close()
    assert node.engine.stats()["used_blocks"] == 0
    node.engine.check_integrity()


def _raw(node: BulkNode) -> socket.socket:
    return socket.create_connection(("127.0.0.1", node.bulk.port), timeout=10)


def _append_frame(seq_id: str, n: int) -> Frame:
    s = SPEC
    return Frame(
        wire.OP_APPEND,
        7,
        s.dtype,
        start=0,
        end=n,
        num_layers=s.num_layers,
        num_kv_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        slab_tokens=n,
        text=seq_id,
        payload_len=n * s.bytes_per_token,
    )


def _wait(predicate: object, timeout_s: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.01)):
        if predicate():  # type: ignore[operator]
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


def test_truncated_upload_and_disconnect_mid_read_change_nothing(bulk_node: BulkNode) -> None:
    node = bulk_node
    toks = list(range(40))
    k, v = rand_kv(SPEC, 40, seed=6)
    node.engine.open("s", toks)
    node.engine.append("s", toks[:20], k[:, :20], v[:, :20])
    before = node.state()
    # an upload that stops half-way through its payload
    with _raw(node) as sock:
        ids = np.arange(20, 40, dtype="<i8").tobytes()
        sock.sendall(_append_frame("s", 20).pack() + ids + b"\0" * (10 * SPEC.bytes_per_token))
    _wait(lambda: node.bulk.num_dropped == 1)
    assert node.state() == before
    # a reader that goes away after the first bytes of a large reply
    node.engine.append("s", toks[20:], k[:, 20:], v[:, 20:])
    before = node.state()
    with _raw(node) as sock:
        sock.sendall(Frame(wire.OP_READ, 8, text="s", start=0, end=wire.END_OF_SEQUENCE).pack())
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == 0 and reply.end == 40
        sock.recv(16)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close with RST
    assert node.state() == before
    # garbage instead of a frame: an error reply naming the problem, then the connection closes
    with _raw(node) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == INVALID and "bad magic" in reply.text
        with contextlib.suppress(ConnectionResetError):  # a reset when our garbage was left unread
            assert sock.recv(1) == b""
    # the node still serves, byte-exact
    with CacheClient(node.address, BULK) as client:
        rk, rv = client.data.read_kv("s")
        assert same_bytes(rk, k) and same_bytes(rv, v)
    assert node.state() == before


def test_error_mid_read_reaches_the_client_and_the_connection_stays_usable(
    bulk_node: BulkNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = bulk_node
    monkeypatch.setattr(node_kv, "READ_SLAB_BYTES", 4 * SPEC.bytes_per_token)
    toks = list(range(16))
    k, v = rand_kv(SPEC, 16, seed=7)
    node.engine.open("s", toks)
    node.engine.append("s", toks, k, v)
    real = node.engine.read_kv_into
    calls = []

    def freed_after_first_slab(seq_id: str, *args: object) -> None:
        calls.append(seq_id)
        if len(calls) == 2:
            raise SequenceNotFound(seq_id, "freed while being read")
        real(seq_id, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(node.engine, "read_kv_into", freed_after_first_slab)
    with CacheClient(node.address, BULK) as client:
        with pytest.raises(SequenceNotFound, match="freed while being read"):
            client.data.read_kv("s")
        rk, rv = client.data.read_kv("s", 2, 14)
        assert same_bytes(rk, k[:, 2:14]) and same_bytes(rv, v[:, 2:14])
    assert node.bulk.num_dropped == 0


def test_concurrent_transfers(bulk_node: BulkNode) -> None:
    node = bulk_node
    errors: list[BaseException] = []

    def worker(i: int, client: CacheClient) -> None:
        try:
            toks = list(range(i * 1000, i * 1000 + 30))
            k, v = rand_kv(SPEC, 30, seed=100 + i)
            with client.open(f"c{i}", toks) as seq:
                for r in range(3):
                    seq.append(
                        toks[r * 10 : r * 10 + 10], k[:, r * 10 : r * 10 + 10], v[:, r * 10 : r * 10 + 10]
                    )
                    rk, rv = seq.read_kv()
                    assert same_bytes(rk, k[:, : r * 10 + 10]) and same_bytes(rv, v[:, : r * 10 + 10])
        except BaseException as exc:
            errors.append(exc)

    with CacheClient(node.address, BULK) as client:
        threads = [threading.Thread(target=worker, args=(i, client)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert node.bulk.num_requests == 42  # 6 opens, 36 transfers
    node.engine.check_integrity()
    assert node.engine.stats()["used_blocks"] == 0


def test_falls_back_to_grpc_when_the_bulk_port_is_off_or_gone() -> None:
    off = BulkNode(bulk_port=None)
    on = BulkNode()
    try:
        assert off.server.bulk is None
        for node in (off, on):
            with CacheClient(node.address, BULK) as client:
                toks = list(range(12))
                k, v = rand_kv(SPEC, 12, seed=8)
                with client.open("f", toks) as seq:
                    if node is on:
                        on.bulk.stop()  # advertised, but nobody listens any more
                    assert seq.append(toks, k, v) == 12
                    rk, rv = seq.read_kv()
                    assert same_bytes(rk, k) and same_bytes(rv, v)
                    channel = client.data.bulk
                    assert channel is not None
                    if node is on:  # a failed connect: gRPC for a while, then the port is learned again
                        assert channel.is_backing_off and channel.port is None
                    else:
                        assert channel.port == 0  # advertised as off
        assert on.bulk.num_requests == 1  # the open, before the listener stopped
        assert on.server.metrics.rpc_latency.labels("Append")._sum.get() > 0  # the rpc carried it
    finally:
        off.server.stop(0)
        on.server.stop(0)


def test_async_client_uses_the_bulk_channel(bulk_node: BulkNode) -> None:
    async def run() -> None:
        async with AsyncCacheClient(bulk_node.address, BULK) as client:
            toks = list(range(25))
            k, v = rand_kv(SPEC, 25, seed=9)
            seq = await client.open("as", toks)
            assert await seq.append(toks, k, v) == 25
            rk, rv = await seq.read_kv(2)
            assert same_bytes(rk, k[:, 2:]) and same_bytes(rv, v[:, 2:])
            with pytest.raises(InvalidArgument, match="range"):
                await seq.read_kv(0, 26)
            await seq.close()

    asyncio.run(run())
    assert bulk_node.bulk.num_requests == 3 and bulk_node.bulk.num_errors == 1  # open, append, read
    assert bulk_node.engine.stats()["used_blocks"] == 0


def test_node_stop_closes_the_listener_and_its_connections(bulk_node: BulkNode) -> None:
    with CacheClient(bulk_node.address, BULK) as client:
        toks = list(range(8))
        k, v = rand_kv(SPEC, 8, seed=10)
        client.open("s", toks).append(toks, k, v)  # leaves a pooled connection open
        bulk_node.server.stop(0)
        assert not bulk_node.bulk._conns
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", bulk_node.bulk.port), timeout=2).close()


def test_node_cli_bulk_port_flag() -> None:
    from pagedkv.cache_node.cli import build_parser

    parse = build_parser().parse_args
    assert parse([]).bulk_port == 0  # auto: any free port
    assert parse(["--bulk-port=auto"]).bulk_port == 0
    assert parse(["--bulk-port=off"]).bulk_port is None
    assert parse(["--bulk-port=0"]).bulk_port is None
    assert parse(["--bulk-port=7070"]).bulk_port == 7070
    with pytest.raises(SystemExit):
        parse(["--bulk-port=seven"])


def test_node_lost_mid_transfer_raises_unavailable_naming_the_node() -> None:
    """A peer that answers a read with a header and half a slab, then hangs up; and
    one that hangs up on an append: the client raises Unavailable, not a hang or a
    bare socket error, and does not reuse the broken connection."""
    from pagedkv.client import Unavailable
    from pagedkv.client.transport.calls import append_call, read_call
    from pagedkv.client.transport.link import BulkLink
    from pagedkv.client.transport.socket import TcpTransport

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def fake_node() -> None:
        for _ in range(2):
            conn, _ = listener.accept()
            with conn:
                f = wire.read_frame(conn)
                assert f is not None
                if f.op == wire.OP_READ:
                    conn.sendall(
                        Frame(
                            wire.OP_READ,
                            f.request_id,
                            start=0,
                            end=8,
                            num_layers=2,
                            num_kv_heads=2,
                            head_dim=8,
                            slab_tokens=8,
                            payload_len=8 * SPEC.bytes_per_token,
                        ).pack()
                        + wire.pack_slab(8)
                        + b"\0" * 100
                    )

    thread = threading.Thread(target=fake_node, daemon=True)
    thread.start()
    channel = BulkLink(f"127.0.0.1:{port}", "node fake", 0, lambda timeout_s: (port, SPEC.bytes_per_token))
    channel.local_name = ""  # a TCP-only peer that answers nothing but READ (no HELLO)
    channel.caps = wire.Capabilities(frozenset({wire.OP_READ, wire.OP_APPEND}))
    tcp = TcpTransport(channel)
    try:
        with pytest.raises(Unavailable, match=r"node fake: bulk transfer failed: connection closed after"):
            tcp.read_kv(read_call("s", 0, None, None), timeout_s=5)
        k, v = rand_kv(SPEC, 40000, seed=11)  # larger than the socket buffers: the send itself fails
        with pytest.raises(Unavailable, match="node fake: bulk transfer failed"):
            tcp.append(append_call("s", list(range(40000)), k, v), timeout_s=5)
        assert channel.num_idle("tcp") == 0
    finally:
        channel.close()
        listener.close()
        thread.join(5)


def test_hostile_hello_and_unknown_ops_change_nothing(bulk_node: BulkNode) -> None:
    node = bulk_node
    toks = list(range(16))
    k, v = rand_kv(SPEC, 16, seed=9)
    node.engine.open("s", toks)
    node.engine.append("s", toks, k, v)
    before = node.state()
    # a HELLO that carries junk where no payload belongs: answered or refused, never a crash
    with _raw(node) as sock:
        junk = b"\xff" * 64
        sock.sendall(Frame(wire.OP_HELLO, 3, text="x" * 40, payload_len=len(junk)).pack() + junk)
        reply = wire.read_frame(sock)
        assert reply is not None and reply.request_id == 3
        if reply.status == 0:  # the capabilities, whole and well formed
            caps = wire.Capabilities.decode(sock.recv(reply.payload_len, socket.MSG_WAITALL))
            assert caps.serves(wire.OP_ATTEND)
        else:
            assert reply.status == INVALID and reply.text
    # an op the node does not serve: a clear refusal naming it
    with _raw(node) as sock:
        sock.sendall(Frame(250, 4, text="s").pack())
        reply = wire.read_frame(sock)
        assert reply is not None and reply.request_id == 4 and reply.status != 0 and "250" in reply.text
    assert node.state() == before
    with CacheClient(node.address, BULK) as client:
        rk, rv = client.data.read_kv("s")
        assert same_bytes(rk, k) and same_bytes(rv, v)
    assert node.state() == before
