"""The per-step calls over the bulk listener: ATTEND, ATTEND_PREFILL_BATCH and their
same-host twins, whose CALL body and results stay in the client's region.

A CALL body is received into the connection's reused buffer (or viewed in the
region) and the engine computes on views of it: the gRPC handlers' engine calls,
so the same validation and errors. The connection's credentials are checked
before the body is received (it must have presented something) and against every
sequence the body names before the engine runs (gate.py). The reply's out / lse leave with one sendmsg,
or are written in place in the region when the decode kernel can take them there.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ...protos import wire
from ...protos.errors import InvalidArgument, PagedKVError
from ...protos.tensors import DTYPE_NAMES, tensor_at
from ...protos.tickets import RIGHT_READ, RIGHT_WRITE
from ...protos.wire import Frame, ProtocolError
from ..gate import Credentials
from ..shm import Region, write_results

if TYPE_CHECKING:
    from .listener import BulkServer

_IDS = wire.IdsMemo()  # the last CALL's sequence ids, shared by the connections' threads
_METHODS = {wire.OP_ATTEND: "Attend", wire.OP_ATTEND_PREFILL_BATCH: "AttendPrefillBatch"}


class AttendOps:
    def __init__(self, server: BulkServer) -> None:
        self.server, self.engine = server, server.engine

    def call(self, conn: socket.socket, f: Frame, body: CallBuffer, creds: Credentials) -> None:
        """One Attend / AttendPrefillBatch: the whole body is read into the
        connection's reused buffer before anything is checked or changed; the
        engine call is the gRPC handler's, so are its validation and errors."""
        if f.payload_len > wire.MAX_CALL_BYTES:  # cannot be drained in bounded time: close
            raise ProtocolError(f"call body of {f.payload_len} bytes exceeds {wire.MAX_CALL_BYTES}")
        method = _METHODS[f.op]
        server = self.server
        try:  # a connection that presented nothing gets no buffer
            server.gate.require(creds, (), RIGHT_READ, method)
        except PagedKVError as exc:
            server.refuse_payload(conn, f, method, exc, f.payload_len)
            return
        large = f.payload_len > body.KEEP_BYTES
        if large:  # a fresh buffer per call: counted in the node's receive budget
            try:
                server.budget.take(f.payload_len, "call body")
            except PagedKVError as exc:
                server.refuse_payload(conn, f, method, exc, f.payload_len)
                return
        try:
            data = wire.byte_view(body.take(f.payload_len))
            # the connection is blocking: the whole body in one recv (a batch-32 q is 512 KiB)
            wire.recv_exact(conn, data, "call body", socket.MSG_WAITALL)
            self._attend(conn, f, f.op, data, creds)
        finally:
            if large:
                server.budget.give(f.payload_len)

    def _attend(
        self,
        conn: socket.socket,
        f: Frame,
        op: int,
        data: memoryview,
        creds: Credentials,
        region: Region | None = None,
        out_at: int = 0,
        out_len: int = 0,
    ) -> None:
        """The engine call of the CALL body in `data` (op: ATTEND or
        ATTEND_PREFILL_BATCH) and its reply, both through engine.run (on the engine's
        compute thread when it has one: the reply leaves as soon as the results exist).
        region: the connection's shared region, whose [out_at, +out_len) area a
        decode writes out and lse into in place, and the results are copied to."""
        method = _METHODS[op]
        e = self.engine
        gate = self.server.gate
        try:
            call = wire.decode_call(op, data, _IDS)
            gate.require(
                creds, call.seq_ids, RIGHT_READ | RIGHT_WRITE if call.k is not None else RIGHT_READ, method
            )
            area = None if region is None else region.memory(out_at, out_len, "the result area")
            dst = None if area is None or op != wire.OP_ATTEND else _decode_destination(call.q, area)
            # the reply when the decode kernel writes into the region, built while this process's
            # caches are warm (after a long engine call they are cold)
            placed_reply = b"" if dst is None else self._reply_head(f, dst, wire.PLACED_REGION)
        except Exception as exc:
            self.server.refuse(conn, f, method, exc)
            return

        def attend_and_reply() -> None:
            start = time.perf_counter()
            try:
                if op == wire.OP_ATTEND:
                    out = e.attend_decode(
                        call.seq_ids,
                        call.layer,
                        call.q,
                        call.k,
                        call.v,
                        call.token_ids,
                        return_block_mass=call.want_mass,
                        out=dst,
                        appends=call.counts or None,
                    )
                else:
                    out = e.attend_prefill_batch(
                        call.seq_ids, call.layer, call.counts, call.q, call.k, call.v, call.token_ids
                    )
            except BaseException:
                self.server.observe(method, start)
                raise
            seconds = time.perf_counter() - start
            mass = out.block_mass if call.want_mass else None
            if dst is not None and mass is None and _is_at(out.out, dst[0]) and _is_at(out.lse, dst[1]):
                # the decode kernel wrote them into the region: the reply was built ahead
                self.server.bump("num_requests")
                conn.sendall(placed_reply)
            else:
                parts = [t.detach().to("cpu").contiguous() for t in (out.out, out.lse, mass) if t is not None]
                placed = region is not None and write_results(region, out_at, out_len, parts)
                self._reply(conn, f, parts, wire.PLACED_REGION if placed else wire.PLACED_INLINE)
            self.server.observe(method, start, seconds)  # after the reply left: not on the caller's path

        if call.k is not None and call.layer == 0 and call.token_ids:
            # a prefill batch's rows per sequence, or a decode's per-row appends (0/1)
            appends = call.counts if len(call.counts) == len(call.seq_ids) else None
            new_tokens = appends or [1] * len(call.seq_ids)
        else:
            new_tokens = [0] * len(call.seq_ids)

        def attempt() -> None:  # the quota check on this thread, the engine call maybe on another
            with gate.charging(call.seq_ids, new_tokens, e.cache_length, e.spec.block_size):
                e.run(attend_and_reply)

        try:
            e.awaiting_open(attempt)
        except OSError:
            raise  # the reply could not be sent: the connection is gone
        except Exception as exc:  # every engine failure becomes a status; the node keeps serving
            self.server.refuse(conn, f, method, exc)

    def _reply(self, conn: socket.socket, f: Frame, parts: list[torch.Tensor], placement: int) -> None:
        """FRAME + REPLY, then the tensors' bytes unless they were placed in the region."""
        inline = placement == wire.PLACED_INLINE
        self.server.bump("num_requests")
        head = self._reply_head(f, parts, placement)
        wire.send_parts(conn, [head, *(wire.byte_view(t) for t in parts if inline)])

    @staticmethod
    def _reply_head(f: Frame, parts: Sequence[torch.Tensor], placement: int) -> bytes:
        """FRAME + REPLY describing `parts` (their bytes follow unless placed in the region)."""
        descs = [(DTYPE_NAMES[t.dtype], tuple(t.shape)) for t in parts]
        inline = sum(map(wire.nbytes, parts)) if placement == wire.PLACED_INLINE else 0
        return wire.encode_reply(f.op, f.request_id, descs, placement, inline)

    def shm_call(self, conn: socket.socket, f: Frame, region: Region | None, creds: Credentials) -> None:
        """An Attend / AttendPrefillBatch whose body and results are in the region."""
        head = self.server.fixed_request(conn, f, wire.SHM_CALL, "shm call")
        if head is None:
            return
        body_at, body_len, out_at, out_len = head
        try:
            if region is None:
                raise InvalidArgument("bulk shm call: no region mapped on this connection (MAP first)")
            if body_at % wire.ALIGN:
                raise InvalidArgument(
                    f"bulk shm call: body offset {body_at} is not a multiple of {wire.ALIGN}"
                )
            if body_len > wire.MAX_CALL_BYTES:
                raise InvalidArgument(f"bulk shm call: a {body_len}-byte body exceeds {wire.MAX_CALL_BYTES}")
            data = region.memory(body_at, body_len, "the call body")
        except InvalidArgument as exc:
            self.server.reply_error(conn, f, exc)
            return
        self._attend(conn, f, wire.SHM_OPS[f.op], data, creds, region, out_at, out_len)
        del data


class CallBuffer:
    """The reused receive buffer of one connection's ATTEND* bodies: grows to the
    largest body seen (up to KEEP_BYTES; a larger one is allocated per call)."""

    KEEP_BYTES = 16 << 20

    def __init__(self) -> None:
        self._buf = torch.empty(4096, dtype=torch.uint8)

    def take(self, num_bytes: int) -> torch.Tensor:
        if num_bytes > self._buf.numel():
            if num_bytes > self.KEEP_BYTES:
                return torch.empty(num_bytes, dtype=torch.uint8)
            self._buf = torch.empty(max(num_bytes, 2 * self._buf.numel()), dtype=torch.uint8)
        return self._buf[:num_bytes]


def _decode_destination(q: torch.Tensor, area: memoryview) -> tuple[torch.Tensor, torch.Tensor] | None:
    """out [B, Hq, D] (q's dtype) and lse [B, Hq] (float32) as views of the result
    area (bytes), laid out as write_results lays them; None when q is not [B, Hq, D]
    or they do not fit (the engine then allocates, validates and reports as usual)."""
    if q.dim() != 3:
        return None
    out_bytes = q.numel() * q.element_size()
    lse_at = out_bytes + wire.pad(out_bytes)
    if lse_at + 4 * q.shape[0] * q.shape[1] > len(area):
        return None
    out = tensor_at(area, 0, q.dtype, tuple(q.shape))
    return out, tensor_at(area, lse_at, torch.float32, tuple(q.shape[:2]))


def _is_at(t: torch.Tensor, place: torch.Tensor) -> bool:
    """t is the tensor at `place` (same memory, shape and dtype): nothing to copy."""
    return t.data_ptr() == place.data_ptr() and t.shape == place.shape and t.dtype == place.dtype
