"""The bulk channel's same-host path (docs/bulk-protocol.md: HELLO, MAP, ATTEND*_SHM) on a
real node server: results bitwise equal to the rpcs and never overwritten by a later
call, every malformed region / header / offset refused clearly with nothing changed,
peers that vanish mid-call or get killed leave no mapping behind on the node, and the
client falls back to TCP when the path cannot be used."""

from __future__ import annotations

import array
import asyncio
import fcntl
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import test_bulk_attend
import torch
from test_bulk_attend import GRPC, Q_HEADS, Node, bitwise, spec_of

from pagedkv.cache_node.serve import listener as node_bulk
from pagedkv.client import AsyncCacheClient, CacheClient, InvalidArgument
from pagedkv.client import shm as client_shm
from pagedkv.client.transport.link import BulkLink
from pagedkv.protos import wire
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.wire import Frame

INVALID = wire.Status.INVALID_ARGUMENT

pytestmark = pytest.mark.skipif(not client_shm.is_supported(), reason="needs memfd and Unix sockets (Linux)")


make, node = test_bulk_attend.make, test_bulk_attend.node  # the same node fixtures


def channel_of(client: CacheClient | AsyncCacheClient) -> BulkLink:
    ch = client.data.bulk
    assert ch is not None
    return ch


def node_mappings() -> int:
    """Regions mapped in this process (the test runs the node in-process)."""
    with open("/proc/self/maps") as f:
        return sum("/memfd:pagedkv-" in line for line in f)


def wait_for(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


# -- results --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_results_bitwise_equal_to_the_rpc_and_never_overwritten(
    make: Callable[..., Node], dtype: str
) -> None:
    node = make(dtype)
    for p in ("shm", "grpc"):
        node.fill(f"{p}0", 5, seed=1)
        node.fill(f"{p}1", 13, seed=2)
    with CacheClient(node.address) as via_shm, CacheClient(node.address, GRPC) as via_grpc:
        kept = []
        for step in range(3):
            q = node.rand(2, Q_HEADS, 8, seed=10 + step)  # GQA: 4 query heads on 2 kv heads
            k, v = node.rand(2, 2, 8, seed=20 + step), node.rand(2, 2, 8, seed=30 + step)
            toks = [70_000 + 2 * step, 70_001 + 2 * step]
            got = via_shm.data.attend(["shm0", "shm1"], 0, q, k, v, toks, return_block_mass=step == 2)
            want = via_grpc.data.attend(["grpc0", "grpc1"], 0, q, k, v, toks, return_block_mass=step == 2)
            assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse)
            assert bitwise(got.block_mass, want.block_mass)
            kept.append((got, want))
        q, k = node.rand(5, Q_HEADS, 8, seed=40), node.rand(5, 2, 8, seed=41)
        got = via_shm.data.attend_prefill_batch(["shm1", "shm0"], 1, [2, 3], q, k, k)
        want = via_grpc.data.attend_prefill_batch(["grpc1", "grpc0"], 1, [2, 3], q, k, k)
        assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse) and got.block_mass is None
        # results a caller keeps are its own: later calls through the same region left them alone
        for got, want in kept:
            assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse)
        channel = channel_of(via_shm)
        assert channel.num_local_calls == 4 and channel.num_idle("unix") == 1
        region = channel._idle["unix"][0].region
        lo, hi = region.data_ptr(), region.data_ptr() + region.numel()
        assert not lo <= got.out.data_ptr() < hi and not lo <= got.lse.data_ptr() < hi
    for i in range(2):
        assert bitwise(
            node.engine.read_kv(f"shm{i}", 0, None)[0], node.engine.read_kv(f"grpc{i}", 0, None)[0]
        )
    node.state()


def test_results_view_the_region_while_no_earlier_ones_are_held() -> None:
    """A call's results are views of its span of the region (nothing copied out)
    when the user holds no earlier call's; held ones are never written over: by
    calls (which then copy theirs out), by a READ_SHM's ring, or by a new region."""
    node = Node(ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float32", block_size=16))
    node.fill("a", 48, seed=1)
    node.fill("ref", 48, seed=1)

    def check(res: Any, q: torch.Tensor) -> None:
        if q.shape[0] == 1:
            want = node.engine.attend_decode(["ref"], 0, q)
        else:
            want = node.engine.attend_prefill_batch(["ref"], 0, [q.shape[0]], q)
        assert bitwise(res.out, want.out) and bitwise(res.lse, want.lse)

    def in_region(t: torch.Tensor) -> bool:
        region = channel_of(client)._idle["unix"][0].region
        return region.data_ptr() <= t.data_ptr() < region.data_ptr() + region.numel()

    try:
        with CacheClient(node.address) as client:
            qs = [node.rand(1, 32, 128, seed=s) for s in range(2)]
            held = client.data.attend(["a"], 0, qs[0])
            conn = channel_of(client)._idle["unix"][0]
            assert conn.num_leased == 1 and in_region(held.out) and in_region(held.lse)
            assert conn.size == client_shm.MIN_REGION_BYTES
            big = node.rand(40, 32, 128, seed=9)  # 640 KiB of q and of out: past the 1 MiB region
            wide = client.data.attend_prefill_batch(["a"], 0, [40], big)  # a new region, no lease in it
            assert conn.size > client_shm.MIN_REGION_BYTES and conn.num_leased == 2 and in_region(wide.out)
            copied = client.data.attend(["a"], 0, qs[1])  # wide is alive: copied out
            assert conn.num_leased == 2 and not in_region(copied.out)
            k, v = client.data.read_kv("a")  # READ_SHM: its ring goes beside the leased span
            assert channel_of(client).num_shm_reads == 1 and channel_of(client).num_local_calls == 3
            want_k, want_v = node.engine.read_kv("ref", 0, None)
            assert bitwise(k, want_k) and bitwise(v, want_v)
            for res, q in ((held, qs[0]), (wide, big), (copied, qs[1])):  # held: in the old region
                check(res, q)
            del held, wide, copied
            check(client.data.attend(["a"], 0, qs[0]), qs[0])  # nothing held: a view again
            assert conn.num_leased == 3
        node.state()
    finally:
        node.server.stop(0)


def test_region_grows_for_a_large_call() -> None:
    node = Node(ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float32", block_size=16))
    try:
        rows = 128  # q 128 x 32 x 128 fp32 = 2 MiB: more than the first 1 MiB region
        q, kv = node.rand(rows, 32, 128, seed=2), node.rand(rows, 8, 128, seed=3)
        toks = list(range(1000, 1000 + rows))
        node.fill("a", 16, seed=1)
        node.fill("b", 16, seed=1)
        with CacheClient(node.address) as via_shm, CacheClient(node.address, GRPC) as via_grpc:
            small = via_shm.data.attend(["a"], 0, q[:1])
            assert channel_of(via_shm)._idle["unix"][0].size == client_shm.MIN_REGION_BYTES
            got = via_shm.data.attend_prefill_batch(["a"], 0, [rows], q, kv, kv, toks)
            want = via_grpc.data.attend_prefill_batch(["b"], 0, [rows], q, kv, kv, toks)
            assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse)
            assert channel_of(via_shm)._idle["unix"][0].size >= 2 * q.numel() * 4
            assert channel_of(via_shm).num_local_calls == 2
            assert bitwise(small.out, node.engine.attend_decode(["b"], 0, q[:1]).out) is False  # b grew
        node.state()
    finally:
        node.server.stop(0)


def test_what_is_kept_between_calls_follows_each_call(node: Node) -> None:
    """The pieces a decode loop reuses from call to call (the encoded ids, the reply's
    result layout, the node's parsed ids) follow every change of batch, ids, shapes
    and block mass: each call's results equal the rpc's."""
    for p in ("shm", "grpc"):
        for i in range(3):
            node.fill(f"{p}{i}", 6 + 3 * i, seed=i)
    with CacheClient(node.address) as via_shm, CacheClient(node.address, GRPC) as via_grpc:
        calls = [([0, 1], False), ([0, 1], True), ([0, 1], False), ([1, 0], False), ([2], False)]
        calls.append(([0, 1, 2], True))
        ids = [0, 1]
        for step, (rows, mass) in enumerate(calls):
            ids[:] = rows  # the same list object, changed in place between calls
            q = node.rand(len(rows), Q_HEADS, 8, seed=50 + step)
            got = via_shm.data.attend([f"shm{i}" for i in ids], 1, q, return_block_mass=mass)
            want = via_grpc.data.attend([f"grpc{i}" for i in ids], 1, q, return_block_mass=mass)
            assert bitwise(got.out, want.out) and bitwise(got.lse, want.lse), step
            assert bitwise(got.block_mass, want.block_mass), step
        assert channel_of(via_shm).num_local_calls == len(calls)
    node.state()


def test_a_call_body_is_never_written_outside_the_region(node: Node) -> None:
    node.fill("a", 5, seed=1)
    with CacheClient(node.address) as client:
        client.data.attend(["a"], 0, node.rand(1, Q_HEADS, 8, seed=2))
        conn = channel_of(client)._idle["unix"][0]
        before = conn.region.clone()
        q = node.rand(1, Q_HEADS, 8, seed=3)
        head = b"\x01" * 100
        length = client_shm.body_length(len(head), [q])
        for at in (conn.size - length + 64, -64, conn.size):
            with pytest.raises(ValueError, match="outside the"):
                client_shm.write_call(conn, at, head, [q])
        with pytest.raises(ValueError, match="not contiguous"):
            client_shm.write_call(conn, 0, head, [node.rand(2, Q_HEADS, 8, seed=4)[:, ::2]])
        assert torch.equal(conn.region, before)  # nothing written by any of them
        assert client_shm.write_call(conn, conn.size - length - wire.pad(length), head, [q]) == length


# -- raw peers: malformed maps, headers and offsets -------------------------------------


def _connect(node: Node) -> socket.socket:
    assert node.server.bulk is not None and node.server.bulk.local_name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect("\0" + node.server.bulk.local_name)
    return sock


def _send_map(sock: socket.socket, size: int, fd: int | None) -> Frame:
    frame = Frame(wire.OP_MAP, 5, end=size).pack()
    fds = [] if fd is None else [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
    sock.sendmsg([frame], fds)
    reply = wire.read_frame(sock)
    assert reply is not None
    return reply


def _memfd(size: int, seals: int) -> int:
    fd = os.memfd_create("pagedkv-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def _ping_ok(sock: socket.socket) -> bool:
    sock.sendall(Frame(wire.OP_PING, 77).pack())
    reply = wire.read_frame(sock)
    return reply is not None and reply.status == wire.STATUS_OK and reply.request_id == 77


def _shm_call(sock: socket.socket, at: int, length: int, out_at: int, out_len: int) -> Frame:
    sock.sendall(
        Frame(wire.OP_ATTEND_SHM, 9, payload_len=wire.SHM_CALL.size).pack()
        + wire.SHM_CALL.pack(at, length, out_at, out_len)
    )
    reply = wire.read_frame(sock)
    assert reply is not None
    return reply


def _call_body(seq_id: str, q: torch.Tensor, layer: int = 1) -> bytes:
    ids = len(seq_id).to_bytes(2, "little") + seq_id.encode()
    head = wire.CALL.pack(layer, 0, 1, 0, 0, len(ids)) + wire.pack_tensor("float32", tuple(q.shape)) + ids
    return head + bytes(wire.pad(len(head))) + q.numpy().tobytes()


def test_bad_regions_and_offsets_are_refused_and_change_nothing(node: Node) -> None:
    node.fill("s", 6, seed=1)
    q = node.rand(1, Q_HEADS, 8, seed=2)
    want = node.engine.attend_decode(["s"], 1, q)
    state = node.state()
    size = 1 << 16
    with _connect(node) as sock:
        # a call before any region, then MAPs the node must refuse
        assert "MAP first" in _shm_call(sock, 0, 64, 0, 64).text
        assert "1 file descriptors" not in (r := _send_map(sock, size, None)).text and r.status == INVALID
        assert "0 file descriptors" in r.text
        unsealed = _memfd(size, 0)
        assert "sealed against shrinking" in _send_map(sock, size, unsealed).text
        os.close(unsealed)
        sealed = _memfd(size, fcntl.F_SEAL_SHRINK)
        assert "the memfd has 65536 bytes, the frame says 131072" in _send_map(sock, 2 * size, sealed).text
        assert "outside [4096," in _send_map(sock, 16, sealed).text
        with tempfile.TemporaryFile() as f:
            f.truncate(size)
            assert "not a sealable memfd" in _send_map(sock, size, f.fileno()).text
        r_fd, w_fd = os.pipe()
        assert "not a sealable memfd" in _send_map(sock, size, r_fd).text
        os.close(r_fd), os.close(w_fd)
        assert _ping_ok(sock)  # every refusal left the connection usable
        # a good region; then headers pointing outside it, misaligned, or at garbage
        assert _send_map(sock, size, sealed).status == wire.STATUS_OK
        region = mmap.mmap(sealed, size)
        os.close(sealed)
        body = _call_body("s", q)
        region[: len(body)] = body
        out_at = 4096
        bad = {
            "body past the end": (
                (0, size + 1, out_at, 4096),
                "the call body [0, 65537) outside the 65536-byte",
            ),
            "body offset past the end": ((size, 64, out_at, 4096), "the call body [65536, 65600) outside"),
            "huge offset": ((2**63, 64, out_at, 4096), "outside the 65536-byte region"),
            "misaligned body": ((8, len(body), out_at, 4096), "not a multiple of 64"),
            "result area past the end": ((0, len(body), size - 8, 4096), "the result area"),
            "body too short": ((0, 40, out_at, 4096), "runs past the 40-byte body"),
            "body too long": ((0, len(body) + 64, out_at, 4096), "body bytes, its sections take"),
        }
        for name, (args, text) in bad.items():
            requests, errors, _ = node.counters()
            reply = _shm_call(sock, *args)
            assert reply.status == INVALID and text in reply.text, (name, reply.text)
            assert reply.extra == "InvalidArgument", name
            assert node.counters()[:2] == (requests, errors + 1), name
            assert node.state() == state, name
        # the engine's own refusal (layer out of range) comes back as over the rpc
        region[: len(body)] = _call_body("s", q, layer=7)
        reply = _shm_call(sock, 0, len(body), out_at, 4096)
        assert reply.status == INVALID and "layer" in reply.text
        # a good call: results placed in the region
        region[: len(body)] = body
        reply = _shm_call(sock, 0, len(body), out_at, 4096)
        assert reply.status == wire.STATUS_OK and reply.payload_len == wire.REPLY_SIZE
        head = bytearray(wire.recv_bytes(sock, wire.REPLY_SIZE, "reply"))
        assert wire.REPLY.unpack_from(head, 0) == (2, wire.PLACED_REGION)
        placed = torch.frombuffer(region, dtype=torch.uint8)[out_at:]
        out_bytes = want.out.numel() * 4
        lse_at = out_bytes + wire.pad(out_bytes)
        assert bitwise(placed[:out_bytes].view(torch.float32).view(want.out.shape), want.out)
        assert bitwise(
            placed[lse_at : lse_at + want.lse.numel() * 4].view(torch.float32), want.lse.reshape(-1)
        )
        del placed
        # a result area too small: the tensors come back inline, as over TCP
        reply = _shm_call(sock, 0, len(body), out_at, 16)
        head = bytearray(wire.recv_bytes(sock, wire.REPLY_SIZE, "reply"))
        assert wire.REPLY.unpack_from(head, 0) == (2, wire.PLACED_INLINE)
        out = wire.recv_bytes(sock, reply.payload_len - wire.REPLY_SIZE, "inline results")
        assert out[: want.out.numel() * 4] == want.out.numpy().tobytes()
        assert _ping_ok(sock)
        # an unknown op closes the connection (its framing is unknown)
        sock.sendall(Frame(99, 1).pack())
        assert wire.read_frame(sock) is not None  # the error reply
        assert wire.read_frame(sock, eof_ok=True) is None
        region.close()
    assert node.counters()[2] == 0
    assert node.state() == state


def test_fds_sent_with_other_ops_are_closed(node: Node) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with _connect(node) as sock:
        assert _ping_ok(sock)
        before = open_fds()
        for _ in range(5):
            fd = _memfd(4096, fcntl.F_SEAL_SHRINK)
            sock.sendmsg(
                [Frame(wire.OP_PING, 77).pack()],
                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
            )
            os.close(fd)
            reply = wire.read_frame(sock)
            assert reply is not None and reply.status == wire.STATUS_OK
        assert wait_for(lambda: open_fds() == before)  # the node closed every descriptor it received


# -- peers that go away ---------------------------------------------------------------


def test_disconnect_mid_call_frees_the_region(node: Node) -> None:
    node.fill("s", 6, seed=1)
    state = node.state()
    before = node_mappings()
    gate, release = threading.Event(), threading.Event()
    real = node.engine.attend_decode

    def slow(*args: object, **kwargs: object) -> object:
        gate.set()
        release.wait(5)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    node.engine.attend_decode = slow  # type: ignore[method-assign]
    sock = _connect(node)
    fd = _memfd(1 << 16, fcntl.F_SEAL_SHRINK)
    assert _send_map(sock, 1 << 16, fd).status == wire.STATUS_OK
    body = _call_body("s", node.rand(1, Q_HEADS, 8, seed=2))
    os.pwrite(fd, body, 0)
    os.close(fd)
    assert node_mappings() == before + 1
    sock.sendall(
        Frame(wire.OP_ATTEND_SHM, 1, payload_len=wire.SHM_CALL.size).pack()
        + wire.SHM_CALL.pack(0, len(body), 4096, 4096)
    )
    assert gate.wait(5)
    sock.close()  # gone while the node computes
    release.set()
    assert wait_for(lambda: node.counters()[2] == 1)  # the reply found no one: dropped
    assert wait_for(lambda: node_mappings() == before)  # and the region unmapped
    node.engine.attend_decode = real  # type: ignore[method-assign]
    assert node.state() == state


KILLED_CLIENT = """
import os, signal, sys, torch
from pagedkv.client import CacheClient

with CacheClient(sys.argv[1]) as c:
    r = c.data.attend(["s"], 1, torch.randn(1, 4, 8))
    assert c.data.bulk.num_local_calls == 1
    print("called", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_killed_client_leaves_no_mapping(node: Node) -> None:
    node.fill("s", 6, seed=1)
    before = node_mappings()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CLIENT, node.address], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL and "called" in proc.stdout, proc.stderr
    assert wait_for(lambda: node_mappings() == before)  # the node unmapped the dead client's region
    with CacheClient(node.address) as c:  # and serves the next client
        assert c.data.attend(["s"], 1, node.rand(1, Q_HEADS, 8, seed=1)).out.shape == (1, Q_HEADS, 8)
        assert channel_of(c).num_local_calls == 1
    node.state()


def test_node_stopped_mid_session_raises_then_falls_back(make: Callable[..., Node]) -> None:
    node = make()
    node.fill("s", 6, seed=1)
    q = node.rand(1, Q_HEADS, 8, seed=1)
    with CacheClient(node.address) as c:
        c.data.attend(["s"], 1, q)
        assert channel_of(c).num_local_calls == 1
        node.server.stop(0)
        with pytest.raises(Exception) as info:  # noqa: PT011 - any transport error naming the node
            c.data.attend(["s"], 1, q, timeout_s=2)
        assert "UNAVAILABLE" in repr(info.value) or "Unavailable" in type(info.value).__name__
        assert channel_of(c).num_idle("unix") == 0  # the dead connection was not kept


# -- concurrency ----------------------------------------------------------------------


def test_threads_each_get_their_own_region(node: Node) -> None:
    for i in range(4):
        node.fill(f"s{i}", 7 + i, seed=i)
    refs = {i: node.engine.attend_decode([f"s{i}"], 1, node.rand(1, Q_HEADS, 8, seed=i)) for i in range(4)}
    failures: list[str] = []
    with CacheClient(node.address) as c:

        def worker(i: int) -> None:
            q = node.rand(1, Q_HEADS, 8, seed=i)
            for _ in range(30):
                r = c.data.attend([f"s{i}"], 1, q)
                if not (bitwise(r.out, refs[i].out) and bitwise(r.lse, refs[i].lse)):
                    failures.append(f"thread {i}")

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert channel_of(c).num_local_calls == 120
    assert failures == []
    node.state()


def test_asyncio_client_takes_the_shared_region(node: Node) -> None:
    node.fill("s", 6, seed=1)
    q = node.rand(2, Q_HEADS, 8, seed=2)
    want = node.engine.attend_prefill_batch(["s"], 1, [2], q)

    async def run() -> int:
        async with AsyncCacheClient(node.address) as c:
            results = await asyncio.gather(*(c.data.attend_prefill_batch(["s"], 1, [2], q) for _ in range(6)))
            assert all(bitwise(r.out, want.out) and bitwise(r.lse, want.lse) for r in results)
            with pytest.raises(InvalidArgument):
                await c.data.attend(["s"], 9, q[:1])
            return channel_of(c).num_local_calls

    assert asyncio.run(run()) == 7
    node.state()


# -- negotiation and fallback ---------------------------------------------------------


def test_falls_back_to_tcp_without_a_usable_same_host_listener(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.fill("s", 6, seed=1)
    q = node.rand(1, Q_HEADS, 8, seed=1)
    assert node.server.bulk is not None
    real_name = node.server.bulk.local_name
    cases = {
        "none advertised": "",
        "another host's (not reachable here)": "pagedkv-bulk-0-" + "0" * 32,
    }
    for name, advertised in cases.items():
        node.server.bulk.local_name = advertised
        with CacheClient(node.address) as c:
            for _ in range(2):
                c.data.attend(["s"], 1, q)
            ch = channel_of(c)
            assert ch.num_calls == 2 and ch.num_local_calls == 0 and ch.local_name == "", name
    node.server.bulk.local_name = real_name
    # a node that will not map regions: refused once, TCP from then on
    monkeypatch.setattr(node_bulk, "map_region", lambda f, fds: (_ for _ in ()).throw(InvalidArgument("no")))
    with CacheClient(node.address) as c:
        for _ in range(2):
            c.data.attend(["s"], 1, q)
        ch = channel_of(c)
        assert ch.num_calls == 2 and ch.num_local_calls == 0 and ch.local_name == ""
    node.state()


def test_node_without_local_listener_advertises_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_bulk, "local_listener", lambda backlog: None)
    node = Node(spec_of("float32"))
    try:
        assert node.server.bulk is not None and node.server.bulk.local_name == ""
        node.fill("s", 3, seed=1)
        with CacheClient(node.address) as c:
            c.data.attend(["s"], 1, node.rand(1, Q_HEADS, 8, seed=1))
            assert channel_of(c).num_calls == 1 and channel_of(c).num_local_calls == 0
    finally:
        node.server.stop(0)


def test_connection_over_the_nodes_cap_falls_back_to_tcp(node: Node) -> None:
    """Each listener has its own cap; a same-host connection the node closes at once
    (over its cap) is found out by the handshake and the call goes over TCP."""
    node.fill("s", 6, seed=1)
    q = node.rand(1, Q_HEADS, 8, seed=1)
    want = node.engine.attend_decode(["s"], 1, q)
    assert node.server.bulk is not None
    node.server.bulk._max_connections = 1
    with CacheClient(node.address) as c:
        ch = channel_of(c)
        assert bitwise(c.data.attend(["s"], 1, q).out, want.out)  # 1 TCP (HELLO) + 1 same-host connection
        assert ch.num_local_calls == 1
        held = ch.take("unix", 5.0)  # the same-host connection is busy elsewhere
        try:
            assert bitwise(c.data.attend(["s"], 1, q).out, want.out)  # a second one is refused: TCP
            assert ch.num_calls == 2 and ch.num_local_calls == 1 and ch.local_name
        finally:
            ch.give("unix", held)
        assert bitwise(c.data.attend(["s"], 1, q).out, want.out)  # the pooled one serves again
        assert ch.num_local_calls == 2
    assert node.counters()[2] == 0
    node.state()
