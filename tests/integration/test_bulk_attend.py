"""Attend and AttendPrefillBatch over the bulk channel (docs/bulk-protocol.md, ops ATTEND,
ATTEND_PREFILL_BATCH, PING) against the rpcs, on a real node server with its bulk
listener on a free port. Every comparison runs the same call through two clients of
one node: `bulk` (the default config: the channel) and `grpc` (bulk_min_bytes=None:
the rpcs), on sequences with the same contents. Results must be bitwise equal, bad
input must fail with the same error and change nothing, and the connection and the
node must stay usable."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.metrics import NodeMetrics
from pagedkv.cache_node.server import NodeServer, create_server
from pagedkv.client import AsyncCacheClient, CacheClient, ClientConfig, PagedKVError, shm
from pagedkv.client.data import NodeData
from pagedkv.client.transport.link import BulkLink
from pagedkv.protos import wire
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire import Frame

INVALID = wire.Status.INVALID_ARGUMENT

GRPC = ClientConfig(bulk_min_bytes=None)
Q_HEADS = 4  # GQA: 2 query heads per kv head


def spec_of(dtype: str) -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, block_size=4)


class Node:
    def __init__(
        self, spec: ModelSpec, bulk_port: int | None = 0, compute_thread: bool = False, num_blocks: int = 96
    ) -> None:
        self.spec = spec
        self.engine = CacheEngine(
            EngineConfig(
                spec, num_blocks, 8, device="cpu", unknown_seq_grace_s=0.05, compute_thread=compute_thread
            )
        )
        self.metrics = NodeMetrics()
        self.server: NodeServer
        self.server, port = create_server(
            self.engine, "127.0.0.1:0", bulk_port=bulk_port, metrics=self.metrics
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.dtype = getattr(torch, spec.dtype)

    @property
    def bulk_port(self) -> int:
        assert self.server.bulk is not None
        return self.server.bulk.port

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

    def fill(self, seq_id: str, n: int, seed: int) -> None:
        """Open seq_id and append n tokens of KV seeded by `seed`. Token ids are unique to
        the sequence id, so two sequences with the same KV share no cached prefix."""
        g = torch.Generator().manual_seed(seed)
        shape = (self.spec.num_layers, n, self.spec.num_kv_heads, self.spec.head_dim)
        self._num_filled = getattr(self, "_num_filled", 0) + 1
        toks = list(range(self._num_filled * 10_000, self._num_filled * 10_000 + n))
        self.engine.open(seq_id, toks)
        k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.engine.append(seq_id, toks, k.to(self.dtype), v.to(self.dtype))

    def rand(self, *shape: int, seed: int) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(self.dtype)


@pytest.fixture(autouse=True, params=["shm", "tcp"])
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs over both paths of the channel: the same-host shared-memory one
    (the default where it can be used) and TCP (what a client on another host gets)."""
    if request.param == "tcp":
        monkeypatch.setattr(shm, "is_supported", lambda: False)
    return str(request.param)


@pytest.fixture(params=[False, True], ids=["handler-threads", "compute-thread"])
def make(request: pytest.FixtureRequest) -> Iterator[Callable[..., Node]]:
    """Nodes whose engine runs on the calling handler threads, and (`pagedkv node
    --compute-thread on`) on its own compute thread, which also sends the attend replies."""
    nodes: list[Node] = []

    def make_node(dtype: str = "float32", bulk_port: int | None = 0) -> Node:
        nodes.append(Node(spec_of(dtype), bulk_port, compute_thread=request.param))
        return nodes[-1]

    yield make_node
    for n in nodes:
        n.server.stop(0)
        n.engine.close()


@pytest.fixture
def node(make: Callable[..., Node]) -> Node:
    return make()


def bitwise(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equal, or within the last bit: the CPU kernels may round differently when a
    tensor sits at another alignment (fp32: 1e-6 absolute; fp16/bf16: one eps of the
    largest value). In the runs so far every comparison here was bitwise."""
    if bitwise(a, b):
        return True
    if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape:
        return False
    scale = float(b.float().abs().max()) if b.numel() else 0.0
    tol = 1e-6 if a.dtype == torch.float32 else torch.finfo(a.dtype).eps * max(1.0, scale)
    return float((a.float() - b.float()).abs().max()) <= tol


def same_result(a: Any, b: Any) -> bool:
    return close(a.out, b.out) and close(a.lse, b.lse) and close(a.block_mass, b.block_mass)


# -- results identical to the rpcs ---------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_steps_match_the_rpc_bitwise(make: Callable[..., Node], dtype: str, transport: str) -> None:
    node = make(dtype)
    lengths = [5, 9, 12]  # partial last blocks, different widths

    def name(path: str, i: int) -> str:  # ids of 1, 2 and 3 bytes per character
        return f"{path}{('', 'é', '序列')[i]}{i}"

    for path in ("bulk", "grpc"):
        for i, n in enumerate(lengths):
            node.fill(name(path, i), n, seed=i + 1)
    before = node.counters()
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        for step in range(3):  # each step appends one token per sequence at layer 0, then layer 1
            for layer in range(2):
                q = node.rand(3, Q_HEADS, 8, seed=100 + step * 2 + layer)
                k, v = node.rand(3, 2, 8, seed=200 + step), node.rand(3, 2, 8, seed=300 + step)
                toks = [90_000 + step * 3 + i for i in range(3)] if layer == 0 else None
                mass = step == 2
                res = {
                    path: c.data.attend(
                        [name(path, i) for i in range(3)], layer, q, k, v, toks, return_block_mass=mass
                    )
                    for path, c in (("bulk", via_bulk), ("grpc", via_grpc))
                }
                assert res["bulk"].out.shape == (3, Q_HEADS, 8) and res["bulk"].lse.shape == (3, Q_HEADS)
                assert (res["bulk"].block_mass is not None) == mass
                assert same_result(res["bulk"], res["grpc"]), (step, layer)
        # attention only (no k/v), a subset in another order
        q = node.rand(2, Q_HEADS, 8, seed=7)
        a = via_bulk.data.attend([name("bulk", 2), "bulk0"], 1, q, return_block_mass=True)
        b = via_grpc.data.attend([name("grpc", 2), "grpc0"], 1, q, return_block_mass=True)
        assert same_result(a, b)
        channel = via_bulk.data.bulk
        assert channel is not None and channel.num_local_calls == (7 if transport == "shm" else 0)
    assert node.counters()[0] - before[0] == 3 * 2 + 1  # every bulk call took the channel
    for i, n in enumerate(lengths):
        bulk_id, grpc_id = name("bulk", i), name("grpc", i)
        assert node.engine.sequence_length(bulk_id) == node.engine.sequence_length(grpc_id) == n + 3
        kb, vb = node.engine.read_kv(bulk_id, 0, None)
        kg, vg = node.engine.read_kv(grpc_id, 0, None)
        assert bitwise(kb, kg) and bitwise(vb, vg)  # the appended KV landed in the same places
    node.state()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_prefill_batch_matches_the_rpc_bitwise(make: Callable[..., Node], dtype: str, transport: str) -> None:
    node = make(dtype)
    for path in ("bulk", "grpc"):
        node.fill(f"{path}-a", 6, seed=1)
        node.fill(f"{path}-b", 0, seed=2)  # nothing cached yet
        node.fill(f"{path}-c", 11, seed=3)
    counts = [3, 5, 1]
    total = sum(counts)
    before = node.counters()
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        for layer in range(2):
            q = node.rand(total, Q_HEADS, 8, seed=10 + layer)
            k, v = node.rand(total, 2, 8, seed=20 + layer), node.rand(total, 2, 8, seed=30 + layer)
            toks = list(range(50_000, 50_000 + total)) if layer == 0 else None
            res = [
                c.data.attend_prefill_batch([f"{p}-a", f"{p}-b", f"{p}-c"], layer, counts, q, k, v, toks)
                for p, c in (("bulk", via_bulk), ("grpc", via_grpc))
            ]
            assert res[0].out.shape == (total, Q_HEADS, 8) and res[0].block_mass is None
            assert same_result(res[0], res[1]), layer
        # no k/v: q stands for each sequence's last rows
        q = node.rand(4, Q_HEADS, 8, seed=40)
        a = via_bulk.data.attend_prefill_batch(["bulk-c", "bulk-a"], 1, [2, 2], q)
        b = via_grpc.data.attend_prefill_batch(["grpc-c", "grpc-a"], 1, [2, 2], q)
        assert same_result(a, b)
        # the client-level call (split by node) takes the channel too
        r = via_bulk.attend_prefill_batch(["bulk-a"], 1, [2], node.rand(2, Q_HEADS, 8, seed=41))
        assert r.out.shape == (2, Q_HEADS, 8)
        channel = via_bulk.data.bulk
        assert channel is not None and channel.num_local_calls == (4 if transport == "shm" else 0)
    assert node.counters()[0] - before[0] == 4
    for suffix, n in (("a", 9), ("b", 5), ("c", 12)):
        assert (
            node.engine.sequence_length(f"bulk-{suffix}")
            == node.engine.sequence_length(f"grpc-{suffix}")
            == n
        )
        kb, vb = node.engine.read_kv(f"bulk-{suffix}", 0, None)
        kg, vg = node.engine.read_kv(f"grpc-{suffix}", 0, None)
        assert bitwise(kb, kg) and bitwise(vb, vg)
    node.state()


# -- bad input: the rpc's error, nothing changed, connection and node usable --------


def _bad_calls(node: Node) -> dict[str, Callable[[NodeData, str], Any]]:
    """name -> call(data, prefix) that the node must refuse; prefix picks the sequences."""
    r = node.rand
    q1, q2 = r(1, Q_HEADS, 8, seed=1), r(2, Q_HEADS, 8, seed=2)
    kv1, kv2 = r(1, 2, 8, seed=3), r(2, 2, 8, seed=4)
    kv3, q3 = r(3, 2, 8, seed=5), r(3, Q_HEADS, 8, seed=6)
    wrong = torch.float64
    t3 = [1, 2, 3]

    def pre(
        seqs: list[str], layer: int, counts: list[int], q: Any, k: Any = None, v: Any = None, toks: Any = None
    ) -> Callable[[NodeData, str], Any]:
        return lambda d, p: d.attend_prefill_batch(
            [s.replace("P", p) for s in seqs], layer, counts, q, k, v, toks
        )

    return {
        "unknown seq": lambda d, p: d.attend(["nope"], 0, q1),
        "unknown seq in a batch": lambda d, p: d.attend([f"{p}a", "nope"], 0, q2, kv2, kv2, [1, 2]),
        "layer too big": lambda d, p: d.attend([f"{p}a"], 2, q1),
        "negative layer": lambda d, p: d.attend([f"{p}a"], -1, q1),
        "q heads not a multiple": lambda d, p: d.attend([f"{p}a"], 0, r(1, 3, 8, seed=7)),
        "q 2-d": lambda d, p: d.attend([f"{p}a"], 0, r(1, 8, seed=7)),
        "q wrong head dim": lambda d, p: d.attend([f"{p}a"], 0, r(1, Q_HEADS, 6, seed=7)),
        "q rows != batch": lambda d, p: d.attend([f"{p}a"], 0, q2),
        "q wrong dtype": lambda d, p: d.attend([f"{p}a"], 0, q1.to(wrong)),
        "k wrong dtype": lambda d, p: d.attend([f"{p}a"], 0, q1, kv1.to(wrong), kv1.to(wrong), [5]),
        "k without v": lambda d, p: d.attend([f"{p}a"], 0, q1, kv1, None, [5]),
        "v without k": lambda d, p: d.attend([f"{p}a"], 0, q1, None, kv1, [5]),
        "k wrong shape": lambda d, p: d.attend([f"{p}a"], 0, q1, r(1, 1, 8, seed=8), r(1, 1, 8, seed=8), [5]),
        "token ids count": lambda d, p: d.attend([f"{p}a", f"{p}b"], 0, q2, kv2, kv2, [5]),
        "no token ids at layer 0": lambda d, p: d.attend([f"{p}a"], 0, q1, kv1, kv1),
        "token ids at layer 1": lambda d, p: d.attend([f"{p}a"], 1, q1, kv1, kv1, [5]),
        "token ids without kv": lambda d, p: d.attend([f"{p}a"], 0, q1, token_ids=[5]),
        "negative token id": lambda d, p: d.attend([f"{p}a"], 0, q1, kv1, kv1, [-3]),
        "duplicate seq": lambda d, p: d.attend([f"{p}a", f"{p}a"], 0, q2),
        "no seqs": lambda d, p: d.attend([], 0, r(0, Q_HEADS, 8, seed=9)),
        "empty seq id": lambda d, p: d.attend([""], 0, q1),
        "q not a tensor": lambda d, p: d.attend([f"{p}a"], 0, [[1.0]]),
        "prefill: counts vs seqs": pre(["Pa", "Pb"], 0, [3], q3, kv3, kv3, t3),
        "prefill: zero count": pre(["Pa", "Pb"], 0, [3, 0], q3, kv3, kv3, t3),
        "prefill: negative count": pre(["Pa", "Pb"], 0, [4, -1], q3, kv3, kv3, t3),
        "prefill: oversized count": pre(["Pa"], 0, [2**31 - 1], q3, kv3, kv3, t3),
        "prefill: count over int32": pre(["Pa"], 0, [2**40], q3, kv3, kv3, t3),
        "prefill: rows != counts": pre(["Pa"], 0, [2], q3, kv3, kv3, t3),
        "prefill: k rows": pre(["Pa"], 0, [3], q3, kv2, kv2, t3),
        "prefill: token ids count": pre(["Pa"], 0, [3], q3, kv3, kv3, [1, 2]),
        "prefill: more queries than held": pre(["Pa"], 1, [3], q3),
        "prefill: unknown seq": pre(["nope"], 0, [3], q3, kv3, kv3, t3),
        "prefill: wrong layer": pre(["Pa"], 7, [3], q3, kv3, kv3, t3),
        "prefill: wrong dtype": pre(["Pa"], 0, [3], q3.to(wrong), kv3, kv3, t3),
    }


def _error_of(fn: Callable[[], Any]) -> tuple[type, str]:
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with the rpc's exception below
        fn()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bad_input_gets_the_rpc_error_and_changes_nothing(make: Callable[..., Node], dtype: str) -> None:
    node = make(dtype)
    for path in ("bulk", "grpc"):
        node.fill(f"{path}a", 2, seed=1)  # 2 tokens: fewer than the 3 queries of one case
        node.fill(f"{path}b", 6, seed=2)
    with CacheClient(node.address) as via_bulk, CacheClient(node.address, GRPC) as via_grpc:
        for name, call in _bad_calls(node).items():
            state = node.state()
            requests, errors, _ = node.counters()
            want = _error_of(lambda call=call: call(via_grpc.data, "grpc"))
            got = _error_of(lambda call=call: call(via_bulk.data, "bulk"))
            assert got[0] is want[0], (name, got, want)
            assert got[1] == want[1].replace("grpc", "bulk"), name  # messages name their own sequences
            assert node.state() == state, name  # lengths, blocks, integrity: unchanged
            if name not in ("q not a tensor", "prefill: count over int32"):
                assert node.counters()[1] == errors + 1, name  # refused by the node over the channel
            assert node.counters()[0] == requests, name
            # the same pooled connection is still in sync: a good call answers right
            ok = via_bulk.data.attend(["bulkb"], 1, node.rand(1, Q_HEADS, 8, seed=3))
            ref = via_grpc.data.attend(["grpcb"], 1, node.rand(1, Q_HEADS, 8, seed=3))
            assert same_result(ok, ref), name
        channel = via_bulk.data.bulk
        assert channel is not None and channel.num_idle("tcp") == 1  # one pooled connection did it all
    assert node.counters()[2] == 0  # no connection was dropped
    errs = node.metrics.registry.get_sample_value
    assert errs("pagedkv_rpc_errors_total", {"method": "Attend", "code": "INVALID_ARGUMENT"}) >= 15


# -- broken peers, raw sockets -------------------------------------------------------


def _raw(node: Node) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", node.bulk_port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _ping_ok(sock: socket.socket) -> bool:
    sock.sendall(Frame(wire.OP_PING, 77).pack())
    reply = wire.read_frame(sock)
    return reply is not None and reply.status == wire.STATUS_OK and reply.request_id == 77


def _call_body(seq_id: str, q: torch.Tensor) -> bytes:
    ids = len(seq_id).to_bytes(2, "little") + seq_id.encode()
    head = wire.CALL.pack(1, 0, 1, 0, 0, len(ids)) + wire.pack_tensor("float32", tuple(q.shape)) + ids
    return head + bytes(wire.pad(len(head))) + q.numpy().tobytes()


def _wait(cond: Callable[[], bool]) -> bool:
    for _ in range(200):
        if cond():
            return True
        threading.Event().wait(0.01)
    return cond()


def test_raw_frames_errors_truncation_and_disconnects(node: Node) -> None:
    node.fill("s", 6, seed=1)
    q = node.rand(1, Q_HEADS, 8, seed=2)
    with CacheClient(node.address, GRPC) as via_grpc:
        ref = via_grpc.data.attend(["s"], 1, q)
    state = node.state()
    body = _call_body("s", q)
    with _raw(node) as sock:
        assert _ping_ok(sock)
        # a well-formed raw call answers with the rpc's result
        sock.sendall(Frame(wire.OP_ATTEND, 1, payload_len=len(body)).pack() + body)
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == 0
        payload = wire.recv_bytes(sock, reply.payload_len, "reply")
        out = torch.frombuffer(
            bytearray(payload[wire.REPLY_SIZE : wire.REPLY_SIZE + 4 * Q_HEADS * 8]), dtype=torch.float32
        )
        assert torch.equal(out.view(1, Q_HEADS, 8), ref.out)
        # the same call arriving in pieces, with pauses (the node waits for the whole body)
        data = Frame(wire.OP_ATTEND, 1, payload_len=len(body)).pack() + body
        for piece in (data[:70], data[70:-40], data[-40:]):
            sock.sendall(piece)
            time.sleep(0.02)
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == 0
        assert wire.recv_bytes(sock, reply.payload_len, "reply") == payload
        # sections that disagree with the body's length: refused after the body is read, in sync after
        for bad, why in (
            (body + bytes(8), "body bytes, its sections take"),
            (body[: wire.CALL.size + 4], "runs past"),
            (body[:-4], "runs past"),
            (wire.CALL.pack(1, 0, 1, 0, 0, 40) + body[wire.CALL.size :], "bytes after the 1 sequence ids"),
            (wire.CALL.pack(1, 0, 2, 0, 0, 3) + body[wire.CALL.size :], "cannot fit"),
            (wire.CALL.pack(1, 0, 2, 0, 0, 4) + body[wire.CALL.size :], "overrun"),
            (body[:24] + struct.pack("<BB", 99, 3) + body[26:], "bad tensor descriptor"),
            (wire.CALL.pack(1, 0, 1, 2, 0, 3) + body[wire.CALL.size :], "2 append flags for 1 sequences"),
        ):
            sock.sendall(Frame(wire.OP_ATTEND, 2, payload_len=len(bad)).pack() + bad)
            reply = wire.read_frame(sock)
            assert reply is not None and reply.status == INVALID and why in reply.text, (why, reply)
            assert reply.extra == "InvalidArgument" and reply.payload_len == 0
            assert _ping_ok(sock), why
        # a ping with a payload is refused and drained
        sock.sendall(Frame(wire.OP_PING, 3, payload_len=5).pack() + b"12345")
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == INVALID and "no payload" in reply.text
        assert _ping_ok(sock)
    assert node.state() == state
    # oversized: refused and closed (it cannot be drained)
    with _raw(node) as sock:
        sock.sendall(Frame(wire.OP_ATTEND, 4, payload_len=wire.MAX_CALL_BYTES + 1).pack())
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == INVALID and "exceeds" in reply.text
        assert sock.recv(1) == b""  # closed
    # truncated: the peer goes away mid-frame / mid-body / mid-tensor; nothing changes
    dropped = node.counters()[2]
    kv = node.rand(1, 2, 8, seed=9)
    ids = (1).to_bytes(2, "little") + b"s"
    head = wire.CALL.pack(0, wire.FLAG_K | wire.FLAG_V, 1, 0, 1, len(ids))
    head += wire.pack_tensor("float32", tuple(q.shape)) + wire.pack_tensor("float32", (1, 2, 8)) * 2
    head += (123).to_bytes(8, "little") + ids
    append_body = head + bytes(wire.pad(len(head))) + q.numpy().tobytes() + kv.numpy().tobytes() * 2
    frame = Frame(wire.OP_ATTEND, 5, payload_len=len(append_body)).pack()
    for cut in (10, len(frame), len(frame) + 30, len(frame) + len(append_body) - 1):
        with _raw(node) as sock:
            sock.sendall((frame + append_body)[:cut])
        assert _wait(lambda was=dropped: node.counters()[2] > was), cut
        dropped = node.counters()[2]
        assert node.state() == state, cut  # the append at layer 0 never happened
    # the complete request does append (the truncated ones were the only difference)
    with _raw(node) as sock:
        sock.sendall(frame + append_body)
        reply = wire.read_frame(sock)
        assert reply is not None and reply.status == 0
    assert node.engine.sequence_length("s") == 7
    node.state()
    with CacheClient(node.address) as client:  # the node serves on
        client.ping()
        assert client.data.attend(["s"], 1, q).out.shape == (1, Q_HEADS, 8)


# -- concurrency, asyncio, fallback --------------------------------------------------


def test_threads_share_the_channel(node: Node) -> None:
    num_threads, steps = 4, 6
    for i in range(num_threads):
        node.fill(f"t{i}", 5, seed=i + 1)
    node.fill("shared", 9, seed=99)
    q = node.rand(1, Q_HEADS, 8, seed=5)
    with CacheClient(node.address, GRPC) as via_grpc:
        ref = via_grpc.data.attend(["shared"], 0, q)
    errors: list[BaseException] = []
    with CacheClient(node.address) as client:

        def work(i: int) -> None:
            try:
                for step in range(steps):
                    for layer in range(2):
                        kv = node.rand(1, 2, 8, seed=1000 * i + 10 * step + layer)
                        toks = [7_000 + 100 * i + step] if layer == 0 else None
                        client.data.attend([f"t{i}"], layer, q, kv, kv, toks)
                    assert same_result(client.data.attend(["shared"], 0, q), ref)
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(num_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    for i in range(num_threads):
        assert node.engine.sequence_length(f"t{i}") == 5 + steps
        k, v = node.engine.read_kv(f"t{i}", 5, None)
        for step in range(steps):  # each thread's tokens landed in its own sequence, in order
            for layer in range(2):
                want = node.rand(1, 2, 8, seed=1000 * i + 10 * step + layer)[0]
                assert torch.equal(k[layer, step], want) and torch.equal(v[layer, step], want)
    assert node.counters()[2] == 0
    node.state()


def test_asyncio_client_takes_the_channel(node: Node) -> None:
    for path in ("bulk", "grpc"):
        node.fill(f"{path}", 5, seed=1)
    q, kv = node.rand(1, Q_HEADS, 8, seed=2), node.rand(1, 2, 8, seed=3)
    qp, kvp = node.rand(3, Q_HEADS, 8, seed=4), node.rand(3, 2, 8, seed=5)
    before = node.counters()[0]

    async def run(config: ClientConfig, seq: str) -> list[Any]:
        async with AsyncCacheClient(node.address, config) as client:
            a = await client.data.attend([seq], 0, q, kv, kv, [11])
            b = await client.data.attend([seq], 1, q, kv, kv, return_block_mass=True)
            c = await client.data.attend_prefill_batch([seq], 0, [3], qp, kvp, kvp, [12, 13, 14])
            with pytest.raises(PagedKVError, match="out of range"):
                await client.data.attend([seq], 9, q)
            return [a, b, c]

    got, want = asyncio.run(run(ClientConfig(), "bulk")), asyncio.run(run(GRPC, "grpc"))
    assert all(same_result(a, b) for a, b in zip(got, want, strict=True))
    assert node.counters()[0] - before == 3
    node.state()


def test_falls_back_to_grpc_when_the_port_is_off_or_gone(make: Callable[..., Node]) -> None:
    off = make(bulk_port=None)
    on = make()
    for n in (off, on):
        n.fill("s", 6, seed=1)
    q = off.rand(1, Q_HEADS, 8, seed=2)
    with CacheClient(off.address) as client:
        res = client.data.attend(["s"], 0, q)
        assert client.data.bulk is not None and client.data.bulk.port == 0
    assert (
        off.metrics.registry.get_sample_value("pagedkv_rpc_latency_seconds_count", {"method": "Attend"}) == 1
    )
    with CacheClient(on.address) as client:
        assert same_result(client.data.attend(["s"], 0, q), res)  # over the channel
        assert on.counters()[0] == 1
        assert on.server.bulk is not None
        on.server.bulk.stop()  # advertised, but gone: the next call takes the rpc
        assert same_result(client.data.attend(["s"], 0, q), res)
        r = client.data.attend_prefill_batch(["s"], 1, [2], off.rand(2, Q_HEADS, 8, seed=3))
        assert r.out.shape == (2, Q_HEADS, 8)
        bulk_channel = client.data.bulk
        assert isinstance(bulk_channel, BulkLink) and bulk_channel.is_backing_off
    count = on.metrics.registry.get_sample_value
    assert count("pagedkv_rpc_latency_seconds_count", {"method": "Attend"}) == 2  # 1 bulk (recorded) + 1 rpc
    assert count("pagedkv_rpc_latency_seconds_count", {"method": "AttendPrefillBatch"}) == 1
    on.state()


def test_channel_ping(node: Node) -> None:
    with CacheClient(node.address) as client, CacheClient(node.address, GRPC) as via_grpc:
        assert via_grpc.data.bulk_channel() is None  # the config keeps every call on gRPC
        assert client.data.bulk is not None and client.data.bulk.port is None  # not learned yet
        channel = client.data.bulk_channel()
        assert channel is not None and channel.port == node.bulk_port  # learned from Stats
        before = node.counters()[0]
        for _ in range(3):
            client.data.transports.get("tcp").ping(5.0)  # type: ignore[union-attr]
        assert node.counters()[0] == before + 3
