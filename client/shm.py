"""The client side of the bulk channel's same-host path (protocol:
pagedkv.protos.bulk, ops HELLO, MAP, ATTEND*_SHM, READ_SHM).

A `LocalConnection` is a Unix-socket connection to the node (the abstract name
its HELLO reply gave) with a memfd region that both processes map. A call writes
its CALL body into the region, sends a 32-byte SHM_CALL, and copies the results
out of the region before it returns them: results are fresh tensors the caller
owns, never views a later call could overwrite. The region is sealed against
shrinking before the node maps it and grows (a new memfd, a new MAP) when a call
needs more; it is anonymous memory, freed when both sides have dropped it, so a
client or node that dies leaves nothing behind. A READ_SHM read (`read_ring`)
copies each slab out of its slot of a small ring at the region's start into the
result tensors, one memcpy per layer and k / v, and frees the slot with an ACK.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import math
import mmap
import os
import socket
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..protos import bulk, tensors
from ..protos.bulk import Frame, ProtocolError
from .types import AttentionResult

MEMFD_NAME = "pagedkv-shm"  # shows in /proc/PID/maps as /memfd:pagedkv-shm (deleted)
MIN_REGION_BYTES = 1 << 20
# READ_SHM's ring (protos/bulk.py): the node gathers slab i + 1 into one slot while
# this side copies slab i out of the other. Small and reused: memfd pages have no THP.
READ_SLOTS = 2
READ_SLOT_BYTES = 2 << 20


def is_supported() -> bool:
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and hasattr(socket, "AF_UNIX")


class RegionRefused(Exception):
    """The node would not map the region (its error frame is `frame`): the
    connection is in sync, the same-host path is not usable with this node."""

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
        self._map: mmap.mmap | None = None
        self.region = torch.empty(0, dtype=torch.uint8)

    def ensure(self, num_bytes: int, request_id: int) -> None:
        """A region of at least num_bytes (a new one, MAPped, when the current is
        smaller). Raises RegionRefused, OSError or ProtocolError."""
        if num_bytes <= self.size:
            return
        size = max(MIN_REGION_BYTES, 1 << (num_bytes - 1).bit_length())
        size = min(size, bulk.MAX_REGION_BYTES)
        if size < num_bytes:
            raise RegionRefused(Frame(bulk.OP_MAP, text=f"{num_bytes} bytes exceed the region cap"))
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            new_map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            frame = Frame(bulk.OP_MAP, request_id, end=size).pack()
            fds = array.array("i", [fd])
            self.sock.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        finally:
            os.close(fd)  # the mapping (ours and the node's) keeps the memory
        self.region = torch.empty(0, dtype=torch.uint8)
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
        self._map, self.size = None, 0
        reply = bulk.read_frame(self.sock)
        if reply is None or reply.status != bulk.STATUS_OK:
            new_map.close()
            raise RegionRefused(reply or Frame(bulk.OP_MAP, text="closed"))
        self._map, self.size = new_map, size
        self.region = torch.frombuffer(new_map, dtype=torch.uint8)

    def close(self) -> None:
        self.region, self.size = torch.empty(0, dtype=torch.uint8), 0
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view still held: its finalizer unmaps
                self._map.close()
            self._map = None
        self.sock.close()


def write_call(region: torch.Tensor, head: bytes, parts: Sequence[torch.Tensor]) -> int:
    """Lay a CALL body (head = CALL + descriptors + ids, then each tensor at the
    next ALIGN offset) into the region at 0; returns its length."""
    region[: len(head)].numpy()[:] = np.frombuffer(head, dtype=np.uint8)
    at = len(head)
    for t in parts:
        at += bulk.pad(at)
        nbytes = t.numel() * t.element_size()
        if nbytes:
            copy_bytes(region[at : at + nbytes], t)
        at += nbytes
    return at


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (uint8, src's size in bytes) = src's bytes: one memcpy on this thread.
    torch's copy_ would split a large copy over its intra-op threads, which on a
    small busy host wait for cores the node needs (measured: 20 ms for 1 MiB)."""
    src = src.contiguous()
    dst.numpy()[:] = src.reshape(-1).view(torch.uint8).numpy()


def body_length(head_len: int, parts: Sequence[torch.Tensor]) -> int:
    """Bytes of a CALL body with this head and these tensors (as write_call lays it)."""
    at = head_len
    for t in parts:
        at += bulk.pad(at) + t.numel() * t.element_size()
    return at


def result_bytes(q: torch.Tensor, block_mass: bool) -> int:
    """Room to ask for the results of a call with this q: out is q's shape and
    dtype, lse one float32 per row and head; block_mass has no size known ahead
    (a little room; a larger one comes back inline)."""
    rows_heads = q.numel() // q.shape[-1] if q.dim() and q.shape[-1] else q.numel()
    return q.numel() * q.element_size() + 4 * rows_heads + 3 * bulk.ALIGN + (64 << 10 if block_mass else 0)


def read_placed(region: torch.Tensor, out_at: int, out_len: int, reply_head: bytearray) -> AttentionResult:
    """Copies of the result tensors the node placed at region[out_at, +out_len):
    one allocation and one memcpy for all of them (they share it, as views)."""
    (num, _) = bulk.REPLY.unpack_from(reply_head, 0)
    if not 2 <= num <= 3:
        raise ProtocolError(f"attend reply with {num} tensors")
    spans, at = [], 0
    for i in range(num):
        dtype, shape = bulk.unpack_tensor(reply_head, bulk.REPLY.size + i * bulk.TENSOR.size)
        tdtype = tensors.TORCH_DTYPES[dtype]
        at += bulk.pad(at)
        nbytes = tdtype.itemsize * math.prod(shape)
        spans.append((tdtype, shape, at, nbytes))
        at += nbytes
    if at > out_len:
        raise ProtocolError(f"attend results of {at} bytes overrun the {out_len}-byte area")
    buf = torch.empty(at, dtype=torch.uint8)
    if at:
        buf.numpy()[:] = region[out_at : out_at + at].numpy()
    outs = [buf[a : a + n].view(tdtype).view(shape) for tdtype, shape, a, n in spans]
    return AttentionResult(outs[0], outs[1], outs[2] if num == 3 else None)


def read_ring(
    conn: LocalConnection, reply: Frame, slot_bytes: int, num_slots: int, error: Callable[..., Exception]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k, v [num_layers, n, kv_heads, head_dim] of a READ_SHM whose OK reply
    frame is `reply`: each slab's SLAB header from the socket, its bytes copied out
    of slot i % num_slots of the ring at region[0, num_slots * slot_bytes), then the
    slot freed with an ACK (protos/bulk.py). An error SLAB raises error((status,
    text, extra)); anything inconsistent raises ProtocolError."""
    n = reply.end - reply.start
    layers, heads, dim = reply.num_layers, reply.num_kv_heads, reply.head_dim
    dtype = tensors.TORCH_DTYPES[reply.dtype]
    tok_bytes = heads * dim * dtype.itemsize  # one token of one layer of k (or v)
    step = reply.slab_tokens
    if reply.payload_len or n < 0 or (n and not 0 < step * 2 * layers * tok_bytes <= slot_bytes):
        raise ProtocolError(f"shm read reply: {step}-token slabs of {n} tokens for {slot_bytes}-byte slots")
    if num_slots * slot_bytes > conn.size:
        raise ProtocolError(f"shm read ring of {num_slots} x {slot_bytes} bytes past the region")
    out_k = torch.empty((layers, n, heads, dim), dtype=dtype)
    out_v = torch.empty((layers, n, heads, dim), dtype=dtype)
    ring = conn.region.numpy()
    dst = [t.reshape(-1).view(torch.uint8).numpy().reshape(layers, n * tok_bytes) for t in (out_k, out_v)]
    num_slabs = -(-n // step) if n else 0
    for i in range(num_slabs):
        t, status, text, extra = bulk.read_slab(conn.sock)
        if status != bulk.STATUS_OK:
            raise error((status, text, extra))
        pos = i * step
        if t != min(step, n - pos):
            raise ProtocolError(f"shm read: slab {i} of {t} tokens at {pos} of {n} ({step} per slab)")
        at, nbytes, lo = (i % num_slots) * slot_bytes, t * tok_bytes, pos * tok_bytes
        for part, d in enumerate(dst):  # the slab is [2, layers, t, heads, dim]: one memcpy per row
            for layer in range(layers):
                a = at + (part * layers + layer) * nbytes
                d[layer, lo : lo + nbytes] = ring[a : a + nbytes]
        if i + num_slots < num_slabs:
            conn.sock.sendall(bulk.READ_ACK.pack(i))
    return out_k, out_v
