"""The client side of the bulk channel's same-host path (protocol:
docs/bulk-protocol.md, ops HELLO, MAP, ATTEND*_SHM, READ_SHM).

A `LocalConnection` is a Unix-socket connection to the node (the abstract name
its HELLO reply gave) with a memfd region that both processes map. A call writes
its CALL body into the region, sends a 32-byte SHM_CALL, and gets its results
placed in the region. It returns them as views of that span, which is then leased
to them: no later call writes there while any of them is alive (a call takes a
span elsewhere, the region being sized for two calls), so nothing is copied out.
Only one span is leased at a time: while the user still holds an earlier call's
results, a call's results are copied out instead. The region is sealed against
shrinking before the node maps it and grows (a new memfd, a new MAP) when a call
needs more; it is anonymous memory, freed when both sides have dropped it, so a
client or node that dies leaves nothing behind; a region replaced or closed
while results view it stays mapped until they are dropped. A READ_SHM read
(`read_ring`) copies each slab out of its slot of a small ring in the region into
the result tensors, one memcpy per layer and k / v, and frees the slot with an ACK.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
import math
import mmap
import os
import socket
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..protos import tensors, wire
from ..protos.errors import PagedKVError
from ..protos.wire import Frame, ProtocolError
from . import codec
from .types import AttentionResult

MEMFD_NAME = "pagedkv-shm"  # shows in /proc/PID/maps as /memfd:pagedkv-shm (deleted)
MIN_REGION_BYTES = 1 << 20
# READ_SHM's ring (docs/bulk-protocol.md): the node gathers slab i + 1 into one slot while
# this side copies slab i out of the other. Small and reused: memfd pages have no THP.
READ_SLOTS = 2
READ_SLOT_BYTES = 2 << 20


def is_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and hasattr(socket, "AF_UNIX")


class RegionRefused(PagedKVError):
    """The node would not map the region (its error frame is `frame`): the
    connection is in sync, the same-host path is not usable with this node."""

    status_name = "UNAVAILABLE"

    def __init__(self, frame: Frame) -> None:
        super().__init__(frame.text)
        self.frame = frame


class LocalConnection:
    """One Unix-socket connection and its region; one request at a time."""

    def __init__(self, name: str, timeout_s: float) -> None:
        """Connects to the abstract socket `name`; OSError when it is not there
        (another host or network namespace, or the node is gone)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout_s)
            self.sock.connect("\0" + name)
        except OSError:
            self.sock.close()
            raise
        self.size = 0
        self.presented: set[bytes] = set()  # tickets this connection carried to the node (AUTH)
        self.has_token = False
        self._map: mmap.mmap | None = None
        self.region = torch.empty(0, dtype=torch.uint8)
        self.address = 0  # of the region's first byte in this process (0: none mapped)
        # the last ATTEND reply's tensor descriptors and the spans they gave (read_placed):
        # a decode loop gets the same shapes back on every call
        self._reply_layout: tuple[bytes, list[tuple[torch.dtype, tuple[int, ...], int]], int] | None = None
        # the span [start, end) of the region whose results the user may still hold,
        # alive while the array under them is (a weak reference to it)
        self._lease: tuple[weakref.ref[np.ndarray], int, int] | None = None
        self.num_leased = 0  # results returned as views of the region (not copied)

    def free_span(self, num_bytes: int, request_id: int) -> int:
        """The offset of num_bytes (ALIGN-aligned) that no results still held view:
        the region's start, or past the leased span; a new region when neither
        fits (sized for two such calls, so the next one finds room beside a lease).
        Raises what ensure raises."""
        lease = self._live_lease()
        if lease is None or num_bytes <= lease[0]:
            self.ensure(num_bytes, request_id)
            return 0
        at = lease[1] + wire.pad(lease[1])
        if at + num_bytes <= self.size:
            return at
        self.ensure(max(self.size + 1, 2 * num_bytes), request_id)  # a new region: no lease in it
        return 0

    def results(self, at: int, num_bytes: int) -> np.ndarray:
        """region[at, at + num_bytes) for results, as uint8: a view, leasing the span
        while it (or any array or tensor made from it) is alive, when no other lease
        is; else a copy (one memcpy on this thread)."""
        if self._live_lease() is None and self._map is not None:
            arr = np.frombuffer(self._map, np.uint8, num_bytes, at)
            self._lease = (weakref.ref(arr), at, at + num_bytes)
            self.num_leased += 1
            return arr
        return self.region.numpy()[at : at + num_bytes].copy()

    def _live_lease(self) -> tuple[int, int] | None:
        if self._lease is None:
            return None
        ref, start, end = self._lease
        if ref() is None:
            self._lease = None
            return None
        return start, end

    def ensure(self, num_bytes: int, request_id: int) -> None:
        """A region of at least num_bytes (a new one, MAPped, when the current is
        smaller). Raises RegionRefused, OSError or ProtocolError."""
        if num_bytes <= self.size:
            return
        size = max(MIN_REGION_BYTES, 1 << (num_bytes - 1).bit_length())
        size = min(size, wire.MAX_REGION_BYTES)
        if size < num_bytes:
            raise RegionRefused(Frame(wire.OP_MAP, text=f"{num_bytes} bytes exceed the region cap"))
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            new_map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            frame = Frame(wire.OP_MAP, request_id, end=size).pack()
            fds = array.array("i", [fd])
            self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        finally:
            os.close(fd)  # the mapping (ours and the node's) keeps the memory
        self.region, self._lease, self.address = torch.empty(0, dtype=torch.uint8), None, 0
        if self._map is not None:
            with contextlib.suppress(BufferError):  # results still viewing it: unmapped when dropped
                self._map.close()
        self._map, self.size = None, 0
        reply = wire.read_frame(self.sock)
        if reply is None or reply.status != wire.STATUS_OK:
            new_map.close()
            raise RegionRefused(reply or Frame(wire.OP_MAP, text="closed"))
        self._map, self.size = new_map, size
        self.region = torch.frombuffer(new_map, dtype=torch.uint8)
        self.address = self.region.data_ptr()

    def close(self) -> None:
        self.region, self.size, self._lease, self.address = torch.empty(0, dtype=torch.uint8), 0, None, 0
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: its finalizer unmaps
                self._map.close()
            self._map = None
        self.sock.close()


def write_call(conn: LocalConnection, body_at: int, head: bytes, parts: Sequence[torch.Tensor]) -> int:
    """Lay a CALL body (head = CALL + descriptors + ids, then each tensor at the
    next ALIGN offset) into conn's region at body_at (ALIGN-aligned); returns its
    length. ValueError (nothing written) when it would not fit in the region; the
    tensors must be contiguous CPU tensors (tensors.as_torch). One memmove per
    tensor on this thread: torch's copy_ would split a large copy over intra-op
    threads that wait for cores the node needs, and raw addresses skip the torch /
    numpy views a sliced assignment makes per tensor."""
    length = body_length(len(head), parts)
    if conn.address == 0 or body_at < 0 or body_at + length > conn.size:
        raise ValueError(f"a {length}-byte call body at {body_at} outside the {conn.size}-byte region")
    for t in parts:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"a {t.device} tensor {tuple(t.shape)} is not contiguous CPU memory")
    base = conn.address + body_at
    ctypes.memmove(base, head, len(head))
    at = len(head)
    for t in parts:
        at += wire.pad(at)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            ctypes.memmove(base + at, t.data_ptr(), nbytes)
        at += nbytes
    return at


def body_length(head_len: int, parts: Sequence[torch.Tensor]) -> int:
    """Bytes of a CALL body with this head and these tensors (as write_call lays it)."""
    at = head_len
    for t in parts:
        at += wire.pad(at) + t.numel() * t.element_size()
    return at


def result_bytes(q: torch.Tensor, block_mass: bool) -> int:
    """Room to ask for the results of a call with this q: out is q's shape and
    dtype, lse one float32 per row and head; block_mass has no size known ahead
    (a little room; a larger one comes back inline)."""
    rows_heads = q.numel() // q.shape[-1] if q.dim() and q.shape[-1] else q.numel()
    return q.numel() * q.element_size() + 4 * rows_heads + 3 * wire.ALIGN + (64 << 10 if block_mass else 0)


def expect_placed(
    conn: LocalConnection, out_at: int, out_len: int, q: torch.Tensor, block_mass: bool
) -> tuple[bytes, AttentionResult] | None:
    """The reply head a call with this q most likely gets (out in q's shape and dtype,
    lse float32 per row and head, placed in the region) and its results already
    viewed in the region, leased: built while the node computes, so that after the
    reply only its head is compared (after a long engine call this process's caches
    are cold, and building the views then costs more than the compare). None when it
    cannot be known ahead (block mass, an earlier result still leased: the results
    are then copied out after the reply) or does not fit."""
    if block_mass or conn._live_lease() is not None:
        return None
    head = wire.decode_result_head(q, wire.PLACED_REGION)
    lse_shape = tuple(q.shape[:-1])
    out_bytes = q.numel() * q.element_size()
    lse_at = out_bytes + wire.pad(out_bytes)
    end = lse_at + 4 * math.prod(lse_shape)
    if head is None or end > out_len:
        return None
    buf = conn.results(out_at, end)
    out = tensors.tensor_at(buf, 0, q.dtype, tuple(q.shape))
    return head, AttentionResult(out, tensors.tensor_at(buf, lse_at, torch.float32, lse_shape), None)


def read_placed(conn: LocalConnection, out_at: int, out_len: int, reply_head: memoryview) -> AttentionResult:
    """The result tensors the node placed at region[out_at, +out_len), as views of
    conn.results: the leased span itself, or one copy of it (they share it). The
    descriptors' layout is kept from the last reply (a decode loop's are the same
    every call) and worked out again when they differ."""
    descs = bytes(reply_head)
    layout = conn._reply_layout
    if layout is None or layout[0] != descs:
        layout = conn._reply_layout = (descs, *_placed_spans(reply_head))
    _, spans, end = layout
    if end > out_len:
        raise ProtocolError(f"attend results of {end} bytes overrun the {out_len}-byte area")
    buf = conn.results(out_at, end)
    outs = [tensors.tensor_at(buf, a, tdtype, shape) for tdtype, shape, a in spans]
    return AttentionResult(outs[0], outs[1], outs[2] if len(outs) == 3 else None)


def _placed_spans(reply_head: memoryview) -> tuple[list[tuple[torch.dtype, tuple[int, ...], int]], int]:
    """(dtype, shape, offset) of each result an ATTEND reply describes, laid out as
    the node's write_results lays them, and the bytes they take; ProtocolError when
    the descriptors are malformed."""
    _, descs = wire.decode_reply(reply_head)
    spans, at = [], 0
    for tdtype, shape in descs:
        at += wire.pad(at)
        spans.append((tdtype, shape, at))
        at += tdtype.itemsize * math.prod(shape)
    return spans, at


def ring_destination(reply: Frame, out: codec.KVOut | None) -> codec.KVOut:
    """Where the READ_SHM whose OK reply frame this is lands (codec.kv_destination);
    ProtocolError for a reply with a negative range."""
    shape = (reply.num_layers, reply.end - reply.start, reply.num_kv_heads, reply.head_dim)
    if min(shape) < 0:
        raise ProtocolError(f"shm read reply: shape {shape}")
    return codec.kv_destination(out, shape, tensors.TORCH_DTYPES[reply.dtype])


def read_ring(
    conn: LocalConnection,
    reply: Frame,
    ring_at: int,
    slot_bytes: int,
    num_slots: int,
    error: Callable[..., Exception],
    dst: codec.KVOut,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k, v [num_layers, n, kv_heads, head_dim] of a READ_SHM whose OK reply
    frame is `reply`: each slab's SLAB header from the socket, its bytes copied out
    of slot i % num_slots of the ring at region[ring_at, + num_slots * slot_bytes), then the
    slot freed with an ACK (docs/bulk-protocol.md). An error SLAB raises error((status,
    text, extra)); anything inconsistent raises ProtocolError."""
    n = reply.end - reply.start
    layers, heads, dim = reply.num_layers, reply.num_kv_heads, reply.head_dim
    dtype = tensors.TORCH_DTYPES[reply.dtype]
    tok_bytes = heads * dim * dtype.itemsize  # one token of one layer of k (or v)
    step = reply.slab_tokens
    if reply.payload_len or n < 0 or (n and not 0 < step * 2 * layers * tok_bytes <= slot_bytes):
        raise ProtocolError(f"shm read reply: {step}-token slabs of {n} tokens for {slot_bytes}-byte slots")
    if ring_at + num_slots * slot_bytes > conn.size:
        raise ProtocolError(f"shm read ring of {num_slots} x {slot_bytes} bytes past the region")
    out_k, out_v = dst  # ring_destination's: [layers, n, heads, dim] in the reply's dtype
    ring = conn.region.numpy()
    rows = [t.reshape(-1).view(torch.uint8).numpy().reshape(layers, n * tok_bytes) for t in dst]
    num_slabs = -(-n // step) if n else 0
    for i in range(num_slabs):
        t, status, text, extra = wire.read_slab(conn.sock)
        if status != wire.STATUS_OK:
            raise error(status, text, extra)
        pos = i * step
        if t != min(step, n - pos):
            raise ProtocolError(f"shm read: slab {i} of {t} tokens at {pos} of {n} ({step} per slab)")
        at, nbytes, lo = ring_at + (i % num_slots) * slot_bytes, t * tok_bytes, pos * tok_bytes
        for part, d in enumerate(rows):  # the slab is [2, layers, t, heads, dim]: one memcpy per row
            for layer in range(layers):
                a = at + (part * layers + layer) * nbytes
                d[layer, lo : lo + nbytes] = ring[a : a + nbytes]
        if i + num_slots < num_slabs:
            conn.sock.sendall(wire.READ_ACK.pack(i))
    return out_k, out_v
