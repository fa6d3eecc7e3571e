"""READ_SHM (docs/bulk-protocol.md): read_kv through a small ring of slots in the client's
shared region, on a real node server. Byte-exact against the engine for ranges
crossing slab and block boundaries and larger than the region, every bad request
refused clearly with nothing changed and the connection usable, a sequence freed
mid-read a clean error, a reader that vanishes or is killed mid-read leaves no
mapping behind, and a node without READ_SHM gets the Unix-socket READ."""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from test_bulk_attend import bitwise
from test_shm import channel_of, node_mappings, wait_for

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.server import NodeServer, create_server
from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, InvalidArgument, SequenceNotFound
from pagedkv.client import shm as client_shm
from pagedkv.protos import wire
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire import Frame

INVALID = wire.Status.INVALID_ARGUMENT

pytestmark = pytest.mark.skipif(not client_shm.is_supported(), reason="needs memfd and Unix sockets (Linux)")

BULK = ClientConfig(bulk_min_bytes=0)  # every read_kv takes the bulk channel


def spec_of(dtype: str, heads: int = 2, dim: int = 8, block_size: int = 4) -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=heads, head_dim=dim, dtype=dtype, block_size=block_size)


class Node:
    def __init__(self, spec: ModelSpec, num_blocks: int = 96) -> None:
        self.spec = spec
        self.engine = CacheEngine(EngineConfig(spec, num_blocks, 8, device="cpu", unknown_seq_grace_s=0.05))
        self.server: NodeServer
        self.server, port = create_server(self.engine, "127.0.0.1:0", bulk_port=0)
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self._num_filled = 0

    def counters(self) -> tuple[int, int, int]:
        b = self.server.bulk
        assert b is not None
        return b.num_requests, b.num_errors, b.num_dropped

    def state(self) -> tuple[dict[str, int], dict[str, int]]:
        """Integrity checked; block counts and sequence lengths (what a refusal must keep)."""
        self.engine.check_integrity()
        stats = self.engine.stats()
        blocks = {k: v for k, v in stats.items() if k.endswith("_blocks")}
        lengths = {sid: self.engine.sequence_length(sid) for sid in list(self.engine.manager.seqs)}
        return blocks, lengths

    def fill(self, seq_id: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        s = self.spec
        shape = (s.num_layers, n, s.num_kv_heads, s.head_dim)
        self._num_filled += 1
        toks = list(range(self._num_filled * 100_000, self._num_filled * 100_000 + n))
        k = torch.randn(shape, generator=g).to(getattr(torch, s.dtype))
        v = torch.randn(shape, generator=g).to(getattr(torch, s.dtype))
        self.engine.open(seq_id, toks)
        self.engine.append(seq_id, toks, k, v)
        return k, v


@pytest.fixture
def make() -> Iterator[Callable[..., Node]]:
    nodes: list[Node] = []

    def make_node(spec: ModelSpec | None = None, num_blocks: int = 96) -> Node:
        nodes.append(Node(spec or spec_of("float32"), num_blocks))
        return nodes[-1]

    yield make_node
    for n in nodes:
        n.server.stop(0)


@pytest.fixture
def node(make: Callable[..., Node]) -> Node:
    return make()


def small_slots(monkeypatch: pytest.MonkeyPatch, spec: ModelSpec, tokens: int) -> int:
    """Client slots of about `tokens` tokens (a multiple of ALIGN bytes): many slabs, the ring reused."""
    size = tokens * spec.bytes_per_token
    size += wire.pad(size)
    monkeypatch.setattr(client_shm, "READ_SLOT_BYTES", size)
    return size // spec.bytes_per_token


# -- results --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reads_are_byte_exact_against_the_engine(
    make: Callable[..., Node], dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = make(spec_of(dtype))
    per_slab = small_slots(monkeypatch, node.spec, 3)  # slabs of 3 (fp32) or 6 tokens, blocks of 4
    assert per_slab not in (0, 4)
    k, v = node.fill("s", 39, seed=1)  # 9 full blocks + 3 tokens
    node.fill("other", 7, seed=2)
    state = node.state()
    with CacheClient(node.address, BULK) as client:
        ch = channel_of(client)
        ranges = [(0, None), (3, 37), (5, 5), (0, 1), (38, 39), (4, 8), (1, 39), (0, 0), (39, None)]
        for i, (a, b) in enumerate(ranges):
            rk, rv = client.data.read_kv("s", a, b)
            ek, ev = node.engine.read_kv("s", a, b)
            assert bitwise(rk, ek) and bitwise(rv, ev), (a, b)
            assert bitwise(rk, k[:, a:b]) and bitwise(rv, v[:, a:b])
            assert ch.num_shm_reads == i + 1
        assert node.counters() == (len(ranges), 0, 0)
        assert ch.read_slot_bytes == 0  # the slots held a token: nothing grown
    assert node.state() == state


def test_a_range_larger_than_the_region_reuses_the_ring(make: Callable[..., Node]) -> None:
    spec = spec_of("float32", heads=4, dim=64, block_size=16)  # 4 KiB per token
    n = 2100  # 8.2 MiB: slabs of 512 tokens (2 MiB) through a 2 x 2 MiB ring
    node = make(spec, num_blocks=n // 16 + 8)
    k, v = node.fill("big", n, seed=3)
    with CacheClient(node.address, BULK) as client:
        ch = channel_of(client)
        rk, rv = client.data.read_kv("big")
        assert bitwise(rk, k) and bitwise(rv, v)
        conn = ch._idle["unix"][0]
        assert conn.size < n * spec.bytes_per_token  # the region stayed small
        assert conn.size >= client_shm.READ_SLOTS * client_shm.READ_SLOT_BYTES
        rk, rv = client.data.read_kv("big", 511, 1537)  # slab boundaries of the node's block size
        assert bitwise(rk, k[:, 511:1537]) and bitwise(rv, v[:, 511:1537])
        assert ch.num_shm_reads == 2
    node.state()


def test_a_slot_smaller_than_a_token_grows_once(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_shm, "READ_SLOT_BYTES", 64)  # a token is 256 bytes
    k, v = node.fill("s", 10, seed=4)
    with CacheClient(node.address, BULK) as client:
        ch = channel_of(client)
        rk, rv = client.data.read_kv("s", 1, 9)
        assert bitwise(rk, k[:, 1:9]) and bitwise(rv, v[:, 1:9])
        assert ch.read_slot_bytes == node.spec.bytes_per_token and ch.num_shm_reads == 1
        assert node.counters() == (1, 1, 0)  # the refused first try, then the read
        rk, rv = client.data.read_kv("s")
        assert bitwise(rk, k) and bitwise(rv, v)
        assert node.counters() == (2, 1, 0)  # no second refusal


# -- errors ------------------------------------------------------------------------------


def test_bad_reads_get_the_rpc_error_and_the_connection_stays_usable(node: Node) -> None:
    k, v = node.fill("s", 10, seed=5)
    state = node.state()
    with CacheClient(node.address, BULK) as client:
        ch = channel_of(client)
        with pytest.raises(SequenceNotFound):
            client.data.read_kv("nope")
        with pytest.raises(InvalidArgument, match="outside sequence"):
            client.data.read_kv("s", 4, 11)
        with pytest.raises(InvalidArgument, match="outside sequence"):
            client.data.read_kv("s", 6, 5)
        with pytest.raises(InvalidArgument, match="outside sequence"):
            client.data.read_kv("s", 11, None)
        rk, rv = client.data.read_kv("s", 2, 7)
        assert bitwise(rk, k[:, 2:7]) and bitwise(rv, v[:, 2:7])
        assert ch.num_idle("unix") == 1  # one connection served all of them
        assert ch.num_shm_reads == 1
        assert node.counters() == (1, 4, 0)
    assert node.state() == state


def _connect(node: Node) -> socket.socket:
    assert node.server.bulk is not None and node.server.bulk.local_name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + node.server.bulk.local_name)
    return sock


def _map(sock: socket.socket, size: int) -> int:
    fd = os.memfd_create("pagedkv-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    sock.sendmsg(
        [Frame(wire.OP_MAP, 5, end=size).pack()],
        [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
    )
    reply = wire.read_frame(sock)
    assert reply is not None and reply.status == wire.STATUS_OK
    return fd


def _read_shm(
    sock: socket.socket, seq: str, start: int, end: int, at: int, slot: int, slots: int, extra: bytes = b""
) -> Frame:
    head = wire.SHM_READ.pack(at, slot, slots) + extra
    sock.sendall(
        Frame(wire.OP_READ_SHM, 9, start=start, end=end, text=seq, payload_len=len(head)).pack() + head
    )
    reply = wire.read_frame(sock)
    assert reply is not None
    return reply


def _ping_ok(sock: socket.socket) -> bool:
    sock.sendall(Frame(wire.OP_PING, 77).pack())
    reply = wire.read_frame(sock)
    return reply is not None and reply.status == wire.STATUS_OK and reply.request_id == 77


def test_raw_ring_protocol_and_bad_rings(node: Node) -> None:
    k, v = node.fill("s", 10, seed=6)
    bpt = node.spec.bytes_per_token  # 256
    state = node.state()
    before = node_mappings()
    with _connect(node) as sock:
        reply = _read_shm(sock, "s", 0, 4, 0, 1024, 2)
        assert reply.status == INVALID and "no region mapped" in reply.text
        assert _ping_ok(sock)
        fd = _map(sock, 1 << 16)
        refused = {
            "outside the 65536-byte region": (0, 1 << 15, 3),
            "multiples of 64": (32, 1024, 2),
            "slot size 1000 must be": (0, 1000, 2),
            "0 slots": (0, 1024, 0),
            "65 slots": (0, 64, 65),
        }
        for text, (at, slot, slots) in refused.items():
            reply = _read_shm(sock, "s", 0, 4, at, slot, slots)
            assert reply.status == INVALID and text in reply.text, (text, reply)
            assert _ping_ok(sock)
        reply = _read_shm(sock, "s", 0, 4, 0, 128, 2)  # a slot smaller than one token
        assert reply.status == INVALID and reply.end == bpt and "smaller than one token" in reply.text
        reply = _read_shm(sock, "gone", 0, 4, 0, 1024, 2)
        assert reply.status == wire.Status.NOT_FOUND and reply.extra == 'SequenceNotFound {"seq_id": "gone"}'
        reply = _read_shm(sock, "s", 0, 4, 0, 1024, 2, extra=b"\0" * 8)  # a 32-byte request
        assert reply.status == INVALID and "32-byte request" in reply.text
        assert _ping_ok(sock)
        # a valid read by hand: slots of 3 tokens, slab i in slot i % 2, ACK when a slot is needed again
        reply = _read_shm(sock, "s", 1, 10, 4096, 3 * bpt, 2)
        assert reply.status == wire.STATUS_OK and (reply.start, reply.end, reply.slab_tokens) == (1, 10, 3)
        assert reply.payload_len == 0
        for i in range(3):
            t, status, _, _ = wire.read_slab(sock)
            assert (t, status) == (3, 0)
            slab = os.pread(fd, t * bpt, 4096 + (i % 2) * 3 * bpt)
            got = torch.frombuffer(bytearray(slab), dtype=torch.float32).view(2, 2, t, 2, 8)
            a = 1 + 3 * i
            assert torch.equal(got[0], k[:, a : a + t]) and torch.equal(got[1], v[:, a : a + t])
            if i + 2 < 3:
                sock.sendall(wire.READ_ACK.pack(i))
        assert _ping_ok(sock)
        # an ACK for the wrong slab breaks the framing: the connection closes, the region goes
        assert _read_shm(sock, "s", 0, 10, 0, bpt, 2).status == wire.STATUS_OK
        wire.read_slab(sock)
        sock.sendall(wire.READ_ACK.pack(7))
        assert wait_for(lambda: node.counters()[2] == 1)
        os.close(fd)
    assert wait_for(lambda: node_mappings() == before)
    with socket.create_connection(("127.0.0.1", node.server.bulk.port), timeout=5) as tcp:  # type: ignore[union-attr]
        reply = _read_shm(tcp, "s", 0, 4, 0, 1024, 2)  # not on TCP: unknown op, closed
        assert reply.status == INVALID and "unknown op" in reply.text
        with contextlib.suppress(ConnectionResetError):  # a reset when our payload was left unread
            assert tcp.recv(1) == b""
    assert node.state() == state
    with CacheClient(node.address, BULK) as client:  # the node still serves
        rk, rv = client.data.read_kv("s")
        assert bitwise(rk, k) and bitwise(rv, v) and channel_of(client).num_shm_reads == 1


@pytest.mark.parametrize("fail_at", [0, 1, 2, 3, 6])
def test_sequence_freed_mid_read_is_a_clean_error(
    node: Node, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    small_slots(monkeypatch, node.spec, 2)  # 2-token slabs: 10 tokens are 5 slabs, 6 are 3 slabs
    node.fill("s", 10, seed=7)
    k, v = node.fill("t", 6, seed=8)
    real = node.engine.read_kv_into
    calls: list[str] = []

    def freed_mid_read(seq_id: str, *args: object) -> None:
        calls.append(seq_id)
        if seq_id == "s" and len(calls) == fail_at + 1:
            node.engine.free("s")  # freed by another client while this read runs
        real(seq_id, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(node.engine, "read_kv_into", freed_mid_read)
    with CacheClient(node.address, BULK) as client:
        if fail_at < 5:
            with pytest.raises(SequenceNotFound):
                client.data.read_kv("s")
        else:  # never reached: the read completes
            assert client.data.read_kv("s")[0].shape == (2, 10, 2, 8)
        ch = channel_of(client)
        assert ch.num_idle("unix") == 1  # the connection stayed in sync and went back to the pool
        rk, rv = client.data.read_kv("t")  # on the same connection
        assert bitwise(rk, k) and bitwise(rv, v)
        assert ch.num_idle("unix") == 1
    assert node.counters()[2] == 0
    node.state()


def test_reader_gone_mid_read_leaves_no_mapping(node: Node) -> None:
    k, v = node.fill("s", 40, seed=9)
    state = node.state()
    before = node_mappings()
    sock = _connect(node)
    fd = _map(sock, 1 << 16)
    os.close(fd)
    reply = _read_shm(sock, "s", 0, 40, 0, 4 * node.spec.bytes_per_token, 2)
    assert reply.status == wire.STATUS_OK
    wire.read_slab(sock)
    sock.close()  # the node waits for an ACK that never comes
    assert wait_for(lambda: node.counters()[2] == 1)
    assert wait_for(lambda: node_mappings() == before)
    assert node.state() == state


KILLED_READER = """
import os, signal, sys
from pagedkv.client import CacheClient, ClientConfig
from pagedkv.client import shm
from pagedkv.protos import wire

shm.READ_SLOT_BYTES = 4 * 256
real, calls = wire.read_slab, []
def read_slab(sock):
    calls.append(1)
    if len(calls) == 3:
        print("killed mid-read", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return real(sock)
wire.read_slab = read_slab
with CacheClient(sys.argv[1], ClientConfig(bulk_min_bytes=0)) as c:
    c.data.read_kv("s")
"""


def test_killed_reader_leaves_no_mapping(node: Node) -> None:
    k, v = node.fill("s", 40, seed=10)
    state = node.state()
    before = node_mappings()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_READER, node.address], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL and "killed mid-read" in proc.stdout, proc.stderr
    assert wait_for(lambda: node_mappings() == before)
    assert wait_for(lambda: node.counters()[2] == 1)
    with CacheClient(node.address, BULK) as client:
        rk, rv = client.data.read_kv("s")
        assert bitwise(rk, k) and bitwise(rv, v) and channel_of(client).num_shm_reads == 1
    assert node.state() == state


def test_concurrent_reads_from_two_clients(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    small_slots(monkeypatch, node.spec, 3)
    kv = {f"s{i}": node.fill(f"s{i}", 20 + 7 * i, seed=20 + i) for i in range(4)}
    state = node.state()
    errors: list[BaseException] = []

    def reader(client: CacheClient, seed: int) -> None:
        try:
            for r in range(8):
                seq = f"s{(seed + r) % 4}"
                a = (seed + r) % 5
                rk, rv = client.data.read_kv(seq, a, None)
                assert bitwise(rk, kv[seq][0][:, a:]) and bitwise(rv, kv[seq][1][:, a:])
        except BaseException as exc:
            errors.append(exc)

    with CacheClient(node.address, BULK) as c1, CacheClient(node.address, BULK) as c2:
        threads = [threading.Thread(target=reader, args=(c, i)) for i, c in enumerate((c1, c2, c1, c2))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert channel_of(c1).num_shm_reads == 16 and channel_of(c2).num_shm_reads == 16
    assert node.counters() == (32, 0, 0)
    assert node.state() == state


def test_node_without_read_shm_gets_the_unix_socket_read(node: Node) -> None:
    server = node.server.bulk
    assert server is not None

    server.ops = server.ops - {wire.OP_READ_SHM}  # its HELLO says so
    k, v = node.fill("s", 12, seed=11)
    with CacheClient(node.address, BULK) as client:
        ch = channel_of(client)
        for _ in range(2):
            rk, rv = client.data.read_kv("s", 2, None)
            assert bitwise(rk, k[:, 2:]) and bitwise(rv, v[:, 2:])
        assert not ch.capabilities(5.0).serves(wire.OP_READ_SHM)
        assert ch.num_shm_reads == 0 and ch.num_local_transfers == 2
    node.state()


def test_asyncio_client_reads_through_the_region(node: Node) -> None:
    k, v = node.fill("s", 21, seed=12)

    async def run() -> tuple[torch.Tensor, torch.Tensor, int]:
        async with AsyncCacheClient(node.address, BULK) as client:
            rk, rv = await client.data.read_kv("s", 3, None)
            ch = client.data.bulk
            assert ch is not None
            return rk, rv, ch.num_shm_reads

    rk, rv, num = asyncio.run(run())
    assert bitwise(rk, k[:, 3:]) and bitwise(rv, v[:, 3:]) and num == 1
    node.state()
