"""The socket transports: the bulk protocol (docs/bulk-protocol.md) written once
over a stream socket, with TCP and the node's same-host Unix socket as the two
ways it opens (the redis-py shape: one connection class, `kind` says how it
connects). Tensors go to `sendmsg` and come back through `recv_into`, no
payload-sized Python objects. A failure after the request left raises Unavailable
(an append may or may not have landed then, as with any rpc whose reply was lost).
"""

from __future__ import annotations

import contextlib
import select
import socket

import torch

from ...protos import tensors, wire
from ...protos.errors import CapacityExceeded, InvalidArgument
from ...protos.wire import Frame, ProtocolError
from .. import codec, shm
from ..types import AttentionResult, OpenResult
from .base import KV, TransportUnavailable
from .calls import AppendCall, AttendCall, OpenCall, PrefillCall, ReadCall
from .link import Abandoned, BulkLink, Connection, Exchange


class SocketTransport:
    """The protocol over one kind of connection of a node's BulkLink."""

    name = "socket"
    kind = "tcp"

    def __init__(self, link: BulkLink) -> None:
        self.link = link

    def _usable(self, timeout_s: float) -> None:
        """TransportUnavailable when this kind of connection cannot be had at all."""
        self.link.ensure_port(timeout_s)

    def _counted(self) -> None:
        """A KV transfer answered over this transport."""

    def open(self, call: OpenCall, timeout_s: float) -> OpenResult:
        if call.attention:
            raise TransportUnavailable("the bulk OPEN carries no attention spec: the Open rpc does")
        self._usable(timeout_s)
        link = self.link
        link.require(wire.OP_OPEN, timeout_s)
        try:
            request = wire.encode_open(
                link.next_id(), call.seq_id, call.token_ids, call.salt, call.max_cached_tokens
            )
        except wire.Unencodable as exc:
            raise TransportUnavailable(str(exc)) from exc  # (an id past the frame's text: the rpc carries it)

        def body(conn: Connection) -> OpenResult:
            link.authorize(conn, (), timeout_s)  # (direct mode: the node's token, if it has one)
            conn.sock.sendall(request)
            reply = wire.read_reply(conn.sock, link.head_buffer())
            link.num_opens += 1
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)
            return OpenResult(reply.start, reply.end)

        result: OpenResult = link.run(self.kind, timeout_s, body)
        return result

    def append(self, call: AppendCall, timeout_s: float) -> int:
        self._usable(timeout_s)
        link = self.link
        k, v = call.k, call.v
        link.wants(2 * wire.nbytes(k))
        n = k.shape[1]
        layers, _, heads, dim = k.shape
        # One slab of all n tokens: stack(k, v) is k's bytes then v's.
        frame = Frame(
            wire.OP_APPEND,
            link.next_id(),
            tensors.DTYPE_NAMES[k.dtype],
            start=0,
            end=n,
            num_layers=layers,
            num_kv_heads=heads,
            head_dim=dim,
            slab_tokens=max(n, 1),
            text=call.seq_id,
            payload_len=2 * wire.nbytes(k),
        )

        caps = link.capabilities(timeout_s)
        undrained = frame.payload_len > wire.MAX_DRAIN_BYTES  # refused, the node would not read it
        if undrained and caps.max_append_tokens and n > caps.max_append_tokens:  # (and close at once)
            bs = caps.block_size
            need, total = -(-n // bs), caps.max_append_tokens // bs
            raise CapacityExceeded(f"append {n} tokens (more than the whole pool)", need, total)

        def body(conn: Connection) -> int:
            link.authorize(conn, (call.seq_id,), timeout_s)
            sock = conn.sock
            sock.sendall(frame.pack() + call.token_ids.tobytes())
            # A payload the node will not drain: its refusal from the header may be here
            # already, and the connection about to close.
            if undrained and _readable(sock):
                _refused_early(sock, link)
            try:
                sock.sendall(wire.byte_view(k))
                sock.sendall(wire.byte_view(v))
            except OSError:
                if undrained:  # refused while we sent: its answer says why
                    _refused_early(sock, link)
                raise
            reply = wire.read_reply(sock)
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)
            return reply.end

        length: int = link.run(self.kind, timeout_s, body)
        self._counted()
        return length

    def attend(self, call: AttendCall, timeout_s: float) -> AttentionResult:
        result: AttentionResult = self.start_attend(call, timeout_s).result()
        return result

    def start_attend(self, call: AttendCall, timeout_s: float) -> Exchange:
        self._usable(timeout_s)
        link = self.link
        op = wire.OP_ATTEND_PREFILL_BATCH if call.is_prefill_batch else wire.OP_ATTEND
        head, size = encode_call(call, link)
        frame = Frame(op, link.next_id(), payload_len=size).pack()
        parts = [frame, *wire.call_parts(head, [t for t in (call.q, call.k, call.v) if t is not None])]

        def send(conn: Connection) -> tuple[bytes, AttentionResult] | None:
            link.authorize(conn, call.seq_ids, timeout_s)
            wire.send_parts(conn.sock, parts)
            return _expect_inline(call.q, call.return_block_mass)  # while the node computes

        def receive(conn: Connection, expected: tuple[bytes, AttentionResult] | None) -> AttentionResult:
            sock = conn.sock
            buf = link.reply_buffer()
            reply, ahead = wire.read_frame_ahead(sock, buf)
            link.num_calls += 1
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)
            if expected is not None:
                head, res = expected
                if (
                    ahead >= wire.REPLY_SIZE
                    and reply.payload_len == wire.REPLY_SIZE + wire.nbytes(res.out) + wire.nbytes(res.lse)
                    and buf[wire.FRAME.size : wire.FRAME.size + wire.REPLY_SIZE] == head
                ):
                    wire.recv_exact(sock, wire.byte_view(res.out), "attend result")
                    wire.recv_exact(sock, wire.byte_view(res.lse), "attend result")
                    return res
            return read_result(sock, reply.payload_len, buf, ahead)

        return link.start(self.kind, timeout_s, send, receive)

    def attend_prefill(self, call: PrefillCall, timeout_s: float) -> AttentionResult:
        raise TransportUnavailable("AttendPrefill has no bulk op")

    def start_attend_prefill(self, call: PrefillCall, timeout_s: float) -> Exchange:
        raise TransportUnavailable("AttendPrefill has no bulk op")

    def read_kv(self, call: ReadCall, timeout_s: float) -> KV:
        self._usable(timeout_s)
        link = self.link
        end = call.end
        link.wants(None if end is None else max(0, end - call.start) * link.bytes_per_token)
        frame = Frame(
            wire.OP_READ,
            link.next_id(),
            start=call.start,
            end=wire.END_OF_SEQUENCE if end is None else end,
            text=call.seq_id,
        )

        def body(conn: Connection) -> KV:
            sock = conn.sock
            link.authorize(conn, (call.seq_id,), timeout_s)
            sock.sendall(frame.pack())
            reply = wire.read_reply(sock)
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)
            n = reply.end - reply.start
            shape = (reply.num_layers, n, reply.num_kv_heads, reply.head_dim)
            try:
                out_k, out_v = codec.kv_destination(call.out, shape, tensors.TORCH_DTYPES[reply.dtype])
            except InvalidArgument as exc:
                raise Abandoned(exc) from None
            if reply.payload_len != 2 * wire.nbytes(out_k):
                raise ProtocolError(f"read reply declares {reply.payload_len} bytes for shape {shape}")
            pos = 0
            while pos < n:
                t, status, text, extra = wire.read_slab(sock)
                if status != wire.Status.OK:
                    raise link.error(status, text, extra)
                if not 0 < t <= n - pos:
                    raise ProtocolError(f"slab of {t} tokens at {pos} of {n}")
                for part in (out_k, out_v):
                    for layer in range(reply.num_layers):
                        wire.recv_exact(sock, wire.byte_view(part[layer, pos : pos + t]), "kv payload")
                pos += t
            return out_k, out_v

        result: KV = link.run(self.kind, timeout_s, body)
        self._counted()
        return result

    def ping(self, timeout_s: float) -> None:
        """The listener's no-op round trip (its latency floor)."""
        self._usable(timeout_s)
        link = self.link
        frame = Frame(wire.OP_PING, link.next_id()).pack()

        def body(conn: Connection) -> None:
            conn.sock.sendall(frame)
            reply = wire.read_reply(conn.sock, link.head_buffer())
            if reply.status != wire.Status.OK:
                raise link.error(reply.status, reply.text, reply.extra)

        link.run(self.kind, timeout_s, body)

    def connect(self, timeout_s: float) -> None:
        with contextlib.suppress(TransportUnavailable):  # the calls take the next transport
            self.ping(timeout_s)

    def close(self) -> None:
        self.link.close()


class TcpTransport(SocketTransport):
    name = "tcp"
    kind = "tcp"


class UnixTransport(SocketTransport):
    """The node's same-host listener: the same protocol without the TCP stack."""

    name = "unix"
    kind = "unix"

    def _usable(self, timeout_s: float) -> None:
        self.link.ensure_port(timeout_s)  # (HELLO, which names the listener, is asked over TCP)
        self.link.same_host_name(timeout_s)

    def _counted(self) -> None:
        self.link.num_local_transfers += 1


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _refused_early(sock: socket.socket, link: BulkLink) -> None:
    """Raise the node's answer to a request it refused from its header (Abandoned: the
    connection is closed); return when there is none to read."""
    sock.settimeout(0.5)
    try:
        reply = wire.read_reply(sock)
    except (OSError, ProtocolError):
        return
    if reply.status != wire.Status.OK:
        raise Abandoned(link.error(reply.status, reply.text, reply.extra))
    raise ProtocolError(f"an append answered {reply} before its payload was sent")


def encode_call(call: AttendCall, link: BulkLink) -> tuple[bytes, int]:
    """The CALL body's head and length; TransportUnavailable for a value only the frame
    cannot carry (an id over 64 KiB: gRPC carries it)."""
    try:
        return wire.encode_call_body(
            call.seq_ids,
            call.layer,
            call.q,
            call.k,
            call.v,
            call.token_ids,
            call.num_tokens,
            call.return_block_mass,
            link.ids_memo,
        )
    except wire.Unencodable as exc:
        raise TransportUnavailable(str(exc)) from exc


def _expect_inline(q: torch.Tensor, block_mass: bool) -> tuple[bytes, AttentionResult] | None:
    """The REPLY head an attend with this q most likely gets, and its result tensors
    allocated with their pages touched: made while the node computes, so that after
    the reply only the head is compared and the bytes received."""
    head = None if block_mass or q.numel() == 0 else wire.decode_result_head(q, wire.PLACED_INLINE)
    if head is None:
        return None
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)
    for t in (out, lse):
        t.view(torch.uint8).numpy()[:] = 0  # one memset on this thread (no intra-op threads)
    return head, AttentionResult(out, lse, None)


def read_result(
    sock: socket.socket,
    payload_len: int,
    buf: bytearray,
    ahead: int,
    area: tuple[shm.LocalConnection, int, int] | None = None,
) -> AttentionResult:
    """out, lse (and block_mass) of an ATTEND* reply, received in place, or viewed in
    the shared region when the node placed them there (area: region, out_offset,
    out_len of an ATTEND*_SHM call). buf: FRAME then REPLY, of which `ahead` bytes of
    REPLY came with the frame (wire.read_frame_ahead)."""
    if payload_len < wire.REPLY_SIZE:
        raise ProtocolError(f"attend reply of {payload_len} bytes")
    head = memoryview(buf)[wire.FRAME.size :]
    if ahead < wire.REPLY_SIZE:
        wire.recv_exact(sock, head[ahead:], "an attend reply")
    placement, descs = wire.decode_reply(head)
    if placement == wire.PLACED_REGION:
        if area is None or payload_len != wire.REPLY_SIZE:
            raise ProtocolError(f"a region-placed reply of {payload_len} bytes on this connection")
        return shm.read_placed(*area, head)
    outs = [torch.empty(shape, dtype=dtype) for dtype, shape in descs]
    if payload_len != wire.REPLY_SIZE + sum(map(wire.nbytes, outs)):
        raise ProtocolError(f"attend reply declares {payload_len} bytes for {[tuple(t.shape) for t in outs]}")
    for t in outs:
        if t.numel():
            wire.recv_exact(sock, wire.byte_view(t), "attend result")
    return AttentionResult(outs[0], outs[1], outs[2] if len(outs) == 3 else None)
