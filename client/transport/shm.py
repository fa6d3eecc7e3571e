"""The shared-memory transport: a same-host connection's memfd region carries the
per-step calls' tensors (ATTEND*_SHM) and read_kv's slabs (READ_SHM, a small ring
of slots) instead of the socket; opens and appends are left to the Unix socket.
The region itself (mapping, leases, layout) is client/shm.py."""

from __future__ import annotations

from typing import Any

from ...protos import wire
from ...protos.errors import InvalidArgument
from ...protos.wire import Frame, ProtocolError
from .. import shm
from ..types import AttentionResult, OpenResult
from .base import KV, TransportUnavailable
from .calls import AppendCall, AttendCall, OpenCall, ReadCall
from .link import Abandoned, BulkLink, Exchange
from .socket import UnixTransport, encode_call, read_result


class ShmTransport(UnixTransport):
    name = "shm"
    kind = "unix"  # its connections are the Unix socket's, each with its region

    def open(self, call: OpenCall, timeout_s: float) -> OpenResult:
        raise TransportUnavailable("opens take the Unix socket")

    def append(self, call: AppendCall, timeout_s: float) -> int:
        raise TransportUnavailable("appends take the Unix socket")

    def start_attend(self, call: AttendCall, timeout_s: float) -> Exchange:
        self._usable(timeout_s)
        link = self.link
        op = wire.OP_ATTEND_PREFILL_BATCH_SHM if call.is_prefill_batch else wire.OP_ATTEND_SHM
        head, _ = encode_call(call, link)
        parts = [t for t in (call.q, call.k, call.v) if t is not None]
        body_len = shm.body_length(len(head), parts)
        out_len = shm.result_bytes(call.q, call.return_block_mass)
        request_id = link.next_id()
        conn = link.take(self.kind, timeout_s)

        def send(conn: shm.LocalConnection) -> list[Any]:
            link.authorize(conn, call.seq_ids, timeout_s)
            body_at = map_region(link, conn, body_len + wire.pad(body_len) + out_len, request_id)
            out_at = body_at + body_len + wire.pad(body_len)
            shm.write_call(conn, body_at, head, parts)
            request = Frame(op, request_id, payload_len=wire.SHM_CALL.size).pack()
            conn.sock.sendall(request + wire.SHM_CALL.pack(body_at, body_len, out_at, out_len))
            # (a list: receive drops the expected views, and their lease, before the general path)
            return [out_at, shm.expect_placed(conn, out_at, out_len, call.q, call.return_block_mass)]

        def receive(conn: shm.LocalConnection, sent: list[Any]) -> AttentionResult:
            out_at, expected = sent
            sock = conn.sock
            buf = link.reply_buffer()
            reply, ahead = wire.read_frame_ahead(sock, buf)
            link.num_calls += 1
            link.num_local_calls += 1
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)
            if (
                expected is not None
                and ahead >= wire.REPLY_SIZE
                and reply.payload_len == wire.REPLY_SIZE
                and buf[wire.FRAME.size : wire.FRAME.size + wire.REPLY_SIZE] == expected[0]
            ):
                return expected[1]
            expected = sent[1] = None  # another layout: its lease goes with it before the general path
            return read_result(sock, reply.payload_len, buf, ahead, (conn, out_at, out_len))

        return link.start(self.kind, timeout_s, send, receive, conn)

    def read_kv(self, call: ReadCall, timeout_s: float) -> KV:
        """read_kv through a ring in the connection's region (READ_SHM)."""
        self._usable(timeout_s)
        link = self.link
        link.require(wire.OP_READ_SHM, timeout_s)
        end = call.end
        link.wants(None if end is None else max(0, end - call.start) * link.bytes_per_token)

        def body(conn: shm.LocalConnection) -> KV:
            sock = conn.sock
            link.authorize(conn, (call.seq_id,), timeout_s)
            slot = max(shm.READ_SLOT_BYTES, link.read_slot_bytes)
            for _ in range(2):  # a slot smaller than one token: grow once and ask again
                request_id = link.next_id()
                ring_at = map_region(link, conn, shm.READ_SLOTS * slot, request_id)
                frame = Frame(
                    wire.OP_READ_SHM,
                    request_id,
                    start=call.start,
                    end=wire.END_OF_SEQUENCE if end is None else end,
                    text=call.seq_id,
                    payload_len=wire.SHM_READ.size,
                )
                sock.sendall(frame.pack() + wire.SHM_READ.pack(ring_at, slot, shm.READ_SLOTS))
                reply = wire.read_reply(sock)
                if reply.status == wire.Status.OK:
                    try:
                        dst = shm.ring_destination(reply, call.out)
                    except InvalidArgument as exc:
                        raise Abandoned(exc) from None
                    return shm.read_ring(conn, reply, ring_at, slot, shm.READ_SLOTS, link.error, dst)
                if reply.end > slot:  # the node's bytes per token
                    slot = link.read_slot_bytes = reply.end + wire.pad(reply.end)
                    continue
                raise link.error(reply.status, reply.text, reply.extra)
            raise ProtocolError(f"shm read: slot of {slot} bytes refused after growing")

        result: KV = link.run(self.kind, timeout_s, body)
        link.num_local_transfers += 1
        link.num_shm_reads += 1
        return result

    def connect(self, timeout_s: float) -> None:
        """A same-host connection with a region mapped that holds a read's ring beside
        a call's leased results."""
        link = self.link
        room = 2 * shm.READ_SLOTS * shm.READ_SLOT_BYTES
        try:
            self._usable(timeout_s)
            conn = link.take(self.kind, timeout_s)
        except TransportUnavailable:
            return
        try:
            if conn.size < room:
                map_region(link, conn, room, link.next_id())
        except TransportUnavailable:
            return  # (conn closed)
        link.give(self.kind, conn)


def map_region(link: BulkLink, conn: shm.LocalConnection, num_bytes: int, request_id: int) -> int:
    """The offset of num_bytes free in conn's region (grown, and mapped by the node, when
    needed: shm.LocalConnection.free_span); TransportUnavailable, with conn closed and
    nothing of the call sent, when that cannot be done."""
    try:
        return conn.free_span(num_bytes, request_id)
    except shm.RegionRefused as exc:
        link.local_name = ""  # this node will not map our regions: TCP from now on
        conn.close()
        raise TransportUnavailable(f"the node refused the shared region: {exc}") from None
    except (OSError, ProtocolError) as exc:
        conn.close()
        raise TransportUnavailable(f"same-host region not mapped: {exc}") from exc
