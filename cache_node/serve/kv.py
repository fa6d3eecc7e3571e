"""KV ranges over the bulk listener: APPEND, READ and READ_SHM.

Bytes move without payload-sized Python objects: an upload is received with
`recv_into` straight into a pooled staging tensor and written into the block pool
by the engine's per-block strided copies (`append_slabs`); a read copies one slab
at a time from the pool into a reused slab-sized staging tensor (`read_kv_into`)
and sends it, or (READ_SHM) gathers it straight into a slot of the client's ring.
The engine changes nothing unless the whole request arrived. Each request is
checked against the connection's credentials (gate.py) from its header, before a
byte of its payload is buffered; an APPEND larger than the pool is refused from
its header too, and its staging buffer counts against the node's receive budget.
"""

from __future__ import annotations

import socket
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...protos import wire
from ...protos.errors import CapacityExceeded, InvalidArgument, PagedKVError
from ...protos.tensors import TORCH_DTYPES, tokens_per_chunk
from ...protos.tickets import RIGHT_READ, RIGHT_WRITE
from ...protos.wire import Frame, ProtocolError
from ..gate import Credentials
from ..shm import Region

if TYPE_CHECKING:
    from .listener import BulkServer


# Default read slab when the client names none: small enough that copying the next
# slab out of the pool overlaps with the peer draining the socket.
READ_SLAB_BYTES = 2 << 20


class _StagingPool:
    """Reused receive buffers: a fresh 256 MiB tensor costs ~65k first-touch page
    faults per upload. Keeps at most `max_bytes` of idle buffers in all."""

    def __init__(self, max_bytes: int) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self._max_bytes = max_bytes

    def take(self, num_bytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= num_bytes]
            if fits:  # the free list is largest first: the last fit is the smallest
                return self._free.pop(fits[-1])[:num_bytes]
        return torch.empty(num_bytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: -b.numel())
            while self._free and sum(b.numel() for b in self._free) > self._max_bytes:
                del self._free[0]  # drop the largest first


class KVOps:
    def __init__(self, server: BulkServer, max_staging_bytes: int) -> None:
        self.server, self.engine = server, server.engine
        self._staging = _StagingPool(max_staging_bytes)

    def _check_append(self, f: Frame) -> int:
        """Tokens in the request, or a domain error (nothing read or changed yet)."""
        s = self.engine.spec
        n = f.end - f.start
        if f.start != 0 or f.end < f.start:
            raise InvalidArgument(f"bulk append: token range [{f.start}, {f.end}) must start at 0")
        if f.dtype != s.dtype:
            raise InvalidArgument(f"kv has dtype {f.dtype!r}, this node serves {s.dtype}")
        got = [2, f.num_layers, n, f.num_kv_heads, f.head_dim]
        want = [2, s.num_layers, n, s.num_kv_heads, s.head_dim]
        if got != want:
            raise InvalidArgument(f"kv has shape {got}, expected {want} (2, layers, n, ...)")
        if n and f.slab_tokens <= 0:
            raise InvalidArgument("bulk append: slab_tokens must be positive")
        if f.payload_len != n * s.bytes_per_token:
            raise InvalidArgument(
                f"kv: {f.payload_len} payload bytes for {n} tokens (expected {n * s.bytes_per_token})"
            )
        need, total = -(-n // s.block_size), self.engine.config.num_blocks
        if need > total:
            raise CapacityExceeded(f"append {n} tokens (more than the whole pool)", need, total)
        return n

    def append(self, conn: socket.socket, f: Frame, creds: Credentials) -> None:
        server = self.server
        try:
            server.gate.require(creds, [f.text], RIGHT_WRITE, "Append")
            n = self._check_append(f)
            server.budget.take(f.payload_len, "append")
        except PagedKVError as exc:
            server.refuse_payload(conn, f, "Append", exc, 8 * max(0, f.end - f.start) + f.payload_len)
            return
        try:
            ids = np.empty(n, dtype="<i8")
            wire.recv_exact(conn, ids.data.cast("B"), "token ids")
            self._append(conn, f, n, ids)
        finally:
            server.budget.give(f.payload_len)

    def _append(self, conn: socket.socket, f: Frame, n: int, ids: np.ndarray) -> None:
        staging = self._staging.take(f.payload_len)
        try:
            wire.recv_exact(conn, wire.byte_view(staging), "kv payload")
            try:
                slabs = self._slabs(staging, n, f.slab_tokens)
                tokens = ids.tolist()
                e = self.engine

                def append() -> None:
                    with self.server.gate.charging([f.text], [n], e.cache_length, e.spec.block_size):
                        e.append_slabs(f.text, tokens, slabs)

                e.awaiting_open(append)
                length = e.sequence_length(f.text)
            except Exception as exc:  # every failure becomes a status; the node keeps serving
                self.server.reply_error(conn, f, exc)
                return
        finally:
            self._staging.give(staging)
        self.server.bump("num_requests")
        conn.sendall(Frame(f.op, f.request_id, f.dtype, end=length).pack())

    def _slabs(
        self, staging: torch.Tensor, n: int, slab_tokens: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(k, v) views of each [2, layers, t, heads, dim] slab of the received payload."""
        s = self.engine.spec
        data = staging.view(TORCH_DTYPES[s.dtype])
        per_token = s.num_layers * s.num_kv_heads * s.head_dim * 2
        slabs, at = [], 0
        for a in range(0, n, slab_tokens):
            t = min(slab_tokens, n - a)
            slab = data[at : at + t * per_token].view(2, s.num_layers, t, s.num_kv_heads, s.head_dim)
            slabs.append((slab[0], slab[1]))
            at += t * per_token
        return slabs

    def _read_stop(self, f: Frame) -> int:
        """The end of a READ* request's range, or a domain error (nothing sent yet)."""
        end = None if f.end == wire.END_OF_SEQUENCE else f.end
        length = self.engine.awaiting_open(lambda: self.engine.cache_length(f.text))
        stop = length if end is None else end
        if not 0 <= f.start <= stop <= length:
            raise InvalidArgument(f"range [{f.start}, {end}) outside sequence {f.text!r} of {length} tokens")
        return stop

    def _read_step(self, f: Frame, n: int, max_tokens: int | None = None) -> int:
        """Tokens per slab: the client's slab_tokens or the node's default, at most
        4 x the default (and max_tokens: a READ_SHM slot)."""
        bpt = self.engine.spec.bytes_per_token
        step = f.slab_tokens or tokens_per_chunk(bpt, READ_SLAB_BYTES)
        step = min(step, n, tokens_per_chunk(bpt, READ_SLAB_BYTES * 4))
        return max(1, step if max_tokens is None else min(step, max_tokens))

    def _read_reply(self, conn: socket.socket, f: Frame, stop: int, step: int, payload_len: int) -> None:
        s = self.engine.spec
        if stop == f.start:
            self.server.bump("num_requests")  # counted before the reply's last bytes leave
        conn.sendall(
            Frame(
                f.op,
                f.request_id,
                s.dtype,
                start=f.start,
                end=stop,
                num_layers=s.num_layers,
                num_kv_heads=s.num_kv_heads,
                head_dim=s.head_dim,
                slab_tokens=step,
                payload_len=payload_len,
            ).pack()
        )

    def read(self, conn: socket.socket, f: Frame, creds: Credentials) -> None:
        s = self.engine.spec
        try:
            self.server.gate.require(creds, [f.text], RIGHT_READ, "ReadKV")
            if f.payload_len:
                raise InvalidArgument("bulk read: the request carries no payload")
            stop = self._read_stop(f)
        except Exception as exc:
            self.server.refuse_payload(conn, f, "ReadKV", exc, f.payload_len)
            return
        n = stop - f.start
        step = self._read_step(f, n)
        self._read_reply(conn, f, stop, step, n * s.bytes_per_token)
        dtype = TORCH_DTYPES[s.dtype]
        staging = self._staging.take(step * s.bytes_per_token)
        try:
            pos = f.start
            while pos < stop:
                t = min(step, stop - pos)
                slab = staging[: t * s.bytes_per_token].view(dtype)
                slab = slab.view(2, s.num_layers, t, s.num_kv_heads, s.head_dim)
                try:  # positions are append-only: the range stays valid unless the sequence is freed
                    self.engine.read_kv_into(f.text, pos, pos + t, slab[0], slab[1])
                except Exception as exc:
                    self.server.bump("num_errors")
                    conn.sendall(wire.error_slab(exc))
                    return
                pos += t
                if pos >= stop:
                    self.server.bump("num_requests")
                conn.sendall(wire.pack_slab(t))
                conn.sendall(wire.byte_view(slab))
        finally:
            self._staging.give(staging)

    def read_shm(self, conn: socket.socket, f: Frame, region: Region | None, creds: Credentials) -> None:
        """A READ whose slabs go through a ring of slots in the region (docs/bulk-protocol.md,
        READ_SHM): each slab is gathered from the pool straight into its slot, the
        socket carries only the SLAB headers and the client's ACKs."""
        head = self.server.fixed_request(conn, f, wire.SHM_READ, "shm read")
        if head is None:
            return
        area_at, slot_bytes, num_slots = head
        s = self.engine.spec
        bpt = s.bytes_per_token
        try:
            self.server.gate.require(creds, [f.text], RIGHT_READ, "ReadKV")
            if region is None:
                raise InvalidArgument("bulk shm read: no region mapped on this connection (MAP first)")
            if area_at % wire.ALIGN or slot_bytes % wire.ALIGN:
                raise InvalidArgument(
                    f"bulk shm read: ring offset {area_at} and slot size {slot_bytes} must be multiples "
                    f"of {wire.ALIGN}"
                )
            if not 1 <= num_slots <= wire.MAX_READ_SLOTS:
                raise InvalidArgument(f"bulk shm read: {num_slots} slots (1..{wire.MAX_READ_SLOTS})")
            region.view(area_at, slot_bytes * num_slots, "the read ring")
            stop = self._read_stop(f)
        except Exception as exc:
            self.server.reply_error(conn, f, exc)
            return
        n = stop - f.start
        if n and slot_bytes < bpt:  # the client grows its region once and asks again
            self.server.bump("num_errors")
            small = InvalidArgument(
                f"bulk shm read: a {slot_bytes}-byte slot is smaller than one token ({bpt})"
            )
            conn.sendall(wire.error_frame(f.op, f.request_id, small, end=bpt)[0].pack())
            return
        step = self._read_step(f, n, slot_bytes // bpt)
        self._read_reply(conn, f, stop, step, 0)
        dtype = TORCH_DTYPES[s.dtype]
        num_slabs = -(-n // step)
        ack = bytearray(wire.READ_ACK.size)
        assert region is not None
        for i in range(num_slabs):
            pos = f.start + i * step
            t = min(step, stop - pos)
            if i >= num_slots:  # the slot is free once the client copied slab i - num_slots out
                self._read_ack(conn, ack, i - num_slots)
            at = area_at + (i % num_slots) * slot_bytes
            slab = region.view(at, t * bpt, "a read slot").view(dtype)
            slab = slab.view(2, s.num_layers, t, s.num_kv_heads, s.head_dim)
            try:  # positions are append-only: the range stays valid unless the sequence is freed
                self.engine.read_kv_into(f.text, pos, pos + t, slab[0], slab[1])
            except Exception as exc:
                del slab
                self.server.bump("num_errors")
                conn.sendall(wire.error_slab(exc))
                # the client acked slabs 0..i-1 that free a slot; those below i - num_slots + 1 were read
                for j in range(max(0, i - num_slots + 1), min(i, max(0, num_slabs - num_slots))):
                    self._read_ack(conn, ack, j)
                return
            del slab
            if i == num_slabs - 1:
                self.server.bump("num_requests")
            conn.sendall(wire.pack_slab(t))

    @staticmethod
    def _read_ack(conn: socket.socket, buf: bytearray, expected: int) -> None:
        wire.recv_exact(conn, memoryview(buf), "a read ack")
        (got,) = wire.READ_ACK.unpack(buf)
        if got != expected:
            raise ProtocolError(f"read ack for slab {got}, expected {expected}")
