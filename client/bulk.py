"""The client side of the bulk channel (protocol: docs/bulk-protocol.md).

Per-step data calls (Attend, AttendPrefillBatch; `attend`) take the channel at
any size: one sendmsg of the request header and the tensors' memory, the reply
received into reused header buffers and the result tensors. Something the frame
cannot carry (an id over 64 KiB, a count outside int32, a body over gRPC's
message cap) raises BulkUnavailable before anything is sent, so the rpc handles
it and reports it as it always did.

NodeData sends a KV range of at least `ClientConfig.bulk_min_bytes` over the
node's raw TCP port instead of the Append / ReadKV rpcs: the tensors' own
memory goes to `sendall` and comes back through `recv_into`, with no
payload-sized bytes objects. The port is learned once per node (its Stats
reply) and cached; when it is 0, or a connection cannot be opened, the caller
falls back to gRPC (`BulkUnavailable`). A failure after the request was sent
raises Unavailable: an append may or may not have landed then, as with any
rpc whose reply was lost.

Connections are pooled per node (one request at a time on each), so
concurrent transfers from several threads each get their own. The deadline
applies to each socket operation (a transfer that stops progressing for
`timeout_s` fails), not to the whole transfer.

Same host: the per-step calls prefer the node's shared-memory path
(client/shm.py) when the node names a same-host listener (HELLO, asked once per
learned port) and this process can reach it: the tensors go through a memfd
region instead of the loopback stack. When it cannot be reached or used the
channel remembers that and the calls take TCP; results and errors are the same.
read_kv on the same host prefers READ_SHM (the slabs through a small ring in that
region, client/shm.py `read_ring`), then the Unix socket's READ (a node without
READ_SHM), then TCP; append takes the Unix socket.

A direct-mode Open (`open`, OPEN) takes the channel too, by append's path: every
request pays one before its first token. A node without OPEN says "unknown op"
once; the channel remembers it and the caller opens over the rpc from then on.
"""

from __future__ import annotations

import itertools
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..protos import tensors, wire
from ..protos.errors import InvalidArgument, PagedKVError, Unavailable
from ..protos.wire import Frame, ProtocolError
from . import codec, shm
from .types import AttentionResult, OpenResult

MAX_POOLED = 4  # idle connections kept per node
CONNECT_TIMEOUT_S = 2.0
# After a failed connect the node's bulk port is left alone (gRPC carries the
# transfers) for this long, then learned again: a firewalled port costs one short
# connect timeout per interval, not one per call; a restarted node's new port is found.
RETRY_AFTER_S = 30.0


class BulkUnavailable(PagedKVError):
    """The bulk channel cannot be used for this call (off, or no connection):
    nothing was sent, so the caller falls back to gRPC."""

    status_name = "UNAVAILABLE"


def _as_cpu(t: Any, what: str) -> torch.Tensor:
    """tensors.as_torch, without its three new tensors when t is already a contiguous
    CPU tensor of a wire dtype that needs no grad (a decode step's q, k, v): only
    its memory is read."""
    if (
        type(t) is torch.Tensor
        and t.is_cpu
        and not t.requires_grad
        and t.dtype in tensors.DTYPE_NAMES
        and t.is_contiguous()
    ):
        return t
    return tensors.as_torch(t, what)


def _host(address: str) -> str:
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


class _Abandoned(Exception):
    """Raised inside a body that refuses a reply whose bytes are still arriving (a read
    into an `out` of another shape): the connection is closed, then `error` raised."""

    def __init__(self, error: PagedKVError) -> None:
        super().__init__(str(error))
        self.error = error


class BulkChannel:
    """Bulk transfers to one node at `address` (its gRPC host:port; the bulk
    port is given by `port`, learned from the node's Stats)."""

    def __init__(self, address: str, where: str = "") -> None:
        self.host = _host(address)
        self.where = where
        self.port: int | None = None  # None: not learned yet; 0: the node has it off
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._retry_at = 0.0  # time.monotonic() before which the channel is not tried
        self._local = threading.local()  # reused header buffers, one set per calling thread
        self._ids_memo = wire.IdsMemo()  # the last batch's encoded sequence ids
        self.num_calls = 0  # attend calls answered over the channel (OK or a node error)
        self.num_local_calls = 0  # of which over the same-host shared-memory path
        self.num_local_transfers = 0  # append / read_kv over the same-host Unix socket
        self.caps: wire.Capabilities | None = None  # the node's HELLO reply (None: not asked yet)
        # The node's same-host listener: None = not asked yet, "" = none or unusable here.
        self.local_name: str | None = None
        self.is_local_enabled = shm.is_supported()  # False: every call over TCP (benchmarks, tests)
        self._idle_local: list[shm.LocalConnection] = []
        self.is_read_shm = True  # False: read_kv over the Unix socket (benchmarks, tests)
        self.read_slot_bytes = 0  # a READ_SHM slot the node asked for (a token over shm.READ_SLOT_BYTES)
        self.num_shm_reads = 0  # read_kv through the shared region (counted in num_local_transfers too)
        self.num_opens = 0  # opens answered over the channel (OK or a node error)

    @property
    def is_backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    # -- connections ------------------------------------------------------------

    def _take(self, timeout_s: float) -> socket.socket:
        with self._lock:
            while self._idle:
                sock = self._idle.pop()
                if _is_alive(sock):
                    _set_timeout(sock, timeout_s)
                    return sock
                sock.close()
        if not self.port:
            raise BulkUnavailable("the node's bulk port is off")
        where = (self.host, self.port)
        try:
            sock = socket.create_connection(where, timeout=min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as exc:
            self._retry_at, self.port = time.monotonic() + RETRY_AFTER_S, None  # re-learn it later
            self.local_name, self.caps = None, None
            raise BulkUnavailable(f"cannot connect to {where[0]}:{where[1]}: {exc}") from exc
        sock.settimeout(timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _give(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < MAX_POOLED:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            local, self._idle_local = self._idle_local, []
        for sock in idle:
            sock.close()
        for conn in local:
            conn.close()

    # -- the same-host path -----------------------------------------------------

    def _take_local(self, timeout_s: float) -> shm.LocalConnection:
        """A pooled or new connection to the node's same-host listener;
        BulkUnavailable (nothing sent) when there is none or it cannot be reached."""
        with self._lock:
            while self._idle_local:
                conn = self._idle_local.pop()
                if _is_alive(conn.sock):
                    _set_timeout(conn.sock, timeout_s)
                    return conn
                conn.close()
        if self.local_name is None:
            self.local_name = self.capabilities(timeout_s).local_name
        if not self.local_name:
            raise BulkUnavailable("the node has no same-host listener reachable from here")
        try:
            conn = shm.LocalConnection(self.local_name, min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as exc:  # another host or network namespace, or the node went away
            self.local_name = ""
            raise BulkUnavailable(f"cannot reach the node's same-host listener: {exc}") from exc
        try:  # a node at its connection cap closes a new one at once: find out (HELLO, not counted)
            wire.hello(conn.sock, next(self._ids))
        except (OSError, PagedKVError) as exc:
            conn.close()
            raise BulkUnavailable(f"the node's same-host listener refused a connection: {exc}") from exc
        conn.sock.settimeout(timeout_s)
        return conn

    def capabilities(self, timeout_s: float) -> wire.Capabilities:
        """What the node's bulk listener serves (its HELLO reply, asked once per learned
        port); no ops at all when the listener cannot be asked (gRPC carries everything)."""
        if self.caps is None:
            try:
                self.caps = self._run(timeout_s, lambda sock: wire.hello(sock, next(self._ids)))
            except PagedKVError:
                return wire.Capabilities()  # asked again with the next call
        assert self.caps is not None
        return self.caps

    def _give_local(self, conn: shm.LocalConnection) -> None:
        with self._lock:
            if len(self._idle_local) < MAX_POOLED:
                self._idle_local.append(conn)
                return
        conn.close()

    def _attend_local(
        self, op: int, request_id: int, head: bytes, q: torch.Tensor, parts: list[torch.Tensor], mass: bool,
        timeout_s: float,
    ) -> AttentionResult:  # fmt: skip
        """One ATTEND* (op) over the shared-memory path; head: the TCP request's
        FRAME + CALL head. BulkUnavailable when the path cannot be used (nothing
        of this call sent)."""
        conn = self._take_local(timeout_s)
        body_head = head[wire.FRAME.size :]
        body_len = shm.body_length(len(body_head), parts)
        out_len = shm.result_bytes(q, mass)

        def body(sock: socket.socket) -> AttentionResult:
            body_at = self._map_region(conn, body_len + wire.pad(body_len) + out_len, request_id)
            out_at = body_at + body_len + wire.pad(body_len)
            shm.write_call(conn, body_at, body_head, parts)
            shm_op = wire.OP_ATTEND_SHM if op == wire.OP_ATTEND else wire.OP_ATTEND_PREFILL_BATCH_SHM
            request = Frame(shm_op, request_id, payload_len=wire.SHM_CALL.size).pack()
            sock.sendall(request + wire.SHM_CALL.pack(body_at, body_len, out_at, out_len))
            expected = shm.expect_placed(conn, out_at, out_len, q, mass)  # while the node computes
            buf = self._local_reply()
            reply, ahead = wire.read_frame_ahead(sock, buf)
            self.num_calls += 1
            self.num_local_calls += 1
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)
            if (
                expected is not None
                and ahead >= wire.REPLY_SIZE
                and reply.payload_len == wire.REPLY_SIZE
                and buf[wire.FRAME.size : wire.FRAME.size + wire.REPLY_SIZE] == expected[0]
            ):
                return expected[1]
            expected = None  # another layout: its lease goes with it before the general path
            return _read_result(sock, reply.payload_len, buf, ahead, (conn, out_at, out_len))

        give = lambda: self._give_local(conn)  # noqa: E731
        result: AttentionResult = self._on(conn.sock, body, give, conn.close, "bulk transfer (same host)")
        return result

    def _map_region(self, conn: shm.LocalConnection, num_bytes: int, request_id: int) -> int:
        """The offset of num_bytes free in conn's region (grown, and mapped by the node,
        when needed: shm.LocalConnection.free_span); BulkUnavailable, with conn closed
        and nothing of the call sent, when that cannot be done."""
        try:
            return conn.free_span(num_bytes, request_id)
        except shm.RegionRefused as exc:
            self.local_name = ""  # this node will not map our regions: TCP from now on
            conn.close()
            raise BulkUnavailable(f"the node refused the shared region: {exc}") from None
        except (OSError, ProtocolError) as exc:
            conn.close()
            raise BulkUnavailable(f"same-host region not mapped: {exc}") from exc

    def _read_shm(
        self, seq_id: str, start: int, end: int | None, timeout_s: float, out: codec.KVOut | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """read_kv through a ring in the connection's region (READ_SHM); BulkUnavailable
        (nothing read) when the path cannot be used: the caller takes the Unix socket."""
        conn = self._take_local(timeout_s)

        def body(sock: socket.socket) -> tuple[torch.Tensor, torch.Tensor]:
            slot = max(shm.READ_SLOT_BYTES, self.read_slot_bytes)
            for _ in range(2):  # a slot smaller than one token: grow once and ask again
                request_id = next(self._ids)
                ring_at = self._map_region(conn, shm.READ_SLOTS * slot, request_id)
                frame = Frame(
                    wire.OP_READ_SHM, request_id, start=start,
                    end=wire.END_OF_SEQUENCE if end is None else end, text=seq_id,
                    payload_len=wire.SHM_READ.size,
                )  # fmt: skip
                sock.sendall(frame.pack() + wire.SHM_READ.pack(ring_at, slot, shm.READ_SLOTS))
                reply = wire.read_frame(sock)
                assert reply is not None
                if reply.status == wire.STATUS_OK:
                    try:
                        dst = shm.ring_destination(reply, out)
                    except InvalidArgument as exc:
                        raise _Abandoned(exc) from None
                    return shm.read_ring(conn, reply, ring_at, slot, shm.READ_SLOTS, self._error, dst)
                if reply.end > slot:  # the node's bytes per token
                    slot = self.read_slot_bytes = reply.end + wire.pad(reply.end)
                    continue
                raise self._error(reply)
            raise ProtocolError(f"shm read: slot of {slot} bytes refused after growing")

        give = lambda: self._give_local(conn)  # noqa: E731
        path = "bulk read (same host, shared memory)"
        result: tuple[torch.Tensor, torch.Tensor] = self._on(conn.sock, body, give, conn.close, path)
        return result

    def _run_local(self, timeout_s: float, body: Any) -> Any:
        """body(sock) on a same-host connection (as _run does on TCP);
        BulkUnavailable when there is none."""
        conn = self._take_local(timeout_s)
        give = lambda: self._give_local(conn)  # noqa: E731
        return self._on(conn.sock, body, give, conn.close, "bulk transfer (same host)")

    def ping_local(self, timeout_s: float) -> None:
        """The same-host path's no-op round trip (its floor); BulkUnavailable without one."""
        conn = self._take_local(timeout_s)
        try:
            conn.sock.sendall(Frame(wire.OP_PING, next(self._ids)).pack())
            reply = wire.read_frame(conn.sock, buf=self._local_head())
            if reply is None or reply.status != wire.STATUS_OK:
                raise ProtocolError(f"same-host ping failed: {reply}")
        except BaseException:
            conn.close()
            raise
        self._give_local(conn)

    def _error(self, f: Frame | tuple[int, str, str]) -> PagedKVError:
        status, text, extra = (f.status, f.text, f.extra) if isinstance(f, Frame) else f
        return wire.error_of(status, text, extra, self.where)

    def _run(self, timeout_s: float, body: Any) -> Any:
        """body(sock) on a pooled connection; a broken transfer closes it and
        raises Unavailable naming the node."""
        sock = self._take(timeout_s)
        return self._on(sock, body, lambda: self._give(sock), sock.close, "bulk transfer")

    def _on(
        self, sock: socket.socket, body: Any, give: Callable[[], None], close: Callable[[], None], path: str
    ) -> Any:
        """body(sock) on a taken connection: given back after a reply (an error reply
        included: the connection is in sync), closed when the transfer broke
        (raised as Unavailable naming the node and `path`) or on anything else."""
        try:
            result = body(sock)
        except _Abandoned as exc:
            close()
            raise exc.error from None
        except BulkUnavailable:  # (a region refused: nothing of the call sent, conn closed)
            close()
            raise
        except (OSError, ProtocolError) as exc:
            close()
            what = "timed out (DEADLINE_EXCEEDED)" if isinstance(exc, TimeoutError) else "failed"
            raise Unavailable(f"{self.where}: {path} {what}: {exc}") from exc
        except PagedKVError:
            give()
            raise
        except BaseException:
            close()
            raise
        give()
        return result

    # -- transfers --------------------------------------------------------------

    def append(self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float) -> int:
        """Append k, v [num_layers, n, kv_heads, head_dim] with their n token ids;
        returns the sequence's new length. Validates like the gRPC path."""
        k, v = tensors.as_torch(k, "k"), tensors.as_torch(v, "v")
        if k.shape != v.shape or k.dtype != v.dtype:
            raise InvalidArgument(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} differ")
        if k.dim() != 4:
            raise InvalidArgument(
                f"k must be [num_layers, n, kv_heads, head_dim], got shape {tuple(k.shape)}"
            )
        tokens = codec.token_list(token_ids)
        n = k.shape[1]
        if len(tokens) != n:
            raise InvalidArgument(f"{n} tokens of K/V for {len(tokens)} token ids")
        try:
            ids = np.asarray(tokens, dtype="<i8")
        except OverflowError as exc:
            raise InvalidArgument(f"append to {seq_id!r}: a token id is not an int in [0, 2**63)") from exc
        layers, _, heads, dim = k.shape
        # One slab of all n tokens: stack(k, v) is k's bytes then v's (docs/bulk-protocol.md).
        frame = Frame(
            wire.OP_APPEND, next(self._ids), tensors.DTYPE_NAMES[k.dtype], start=0, end=n,
            num_layers=layers, num_kv_heads=heads, head_dim=dim, slab_tokens=max(n, 1), text=seq_id,
            payload_len=2 * k.numel() * k.element_size(),
        )  # fmt: skip

        def body(sock: socket.socket) -> int:
            sock.sendall(frame.pack() + ids.tobytes())
            sock.sendall(wire.byte_view(k))
            sock.sendall(wire.byte_view(v))
            reply = wire.read_frame(sock)
            assert reply is not None
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)
            return reply.end

        if self.is_local_enabled and self.local_name != "":
            try:  # same host: the Unix socket, as read_kv
                length: int = self._run_local(timeout_s, body)
                self.num_local_transfers += 1
                return length
            except BulkUnavailable:
                pass  # TCP
        result: int = self._run(timeout_s, body)
        return result

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        salt: bytes,
        max_cached_tokens: int | None,
        timeout_s: float,
    ) -> OpenResult:
        """The Open rpc over the channel (OPEN): same result and errors. Takes the
        same-host Unix socket when there is one, as append does. BulkUnavailable
        (nothing opened) for what the frame cannot carry, and when the node has no
        OPEN (it said so once: remembered), so the rpc takes the call."""
        if not self.capabilities(timeout_s).serves(wire.OP_OPEN):
            raise BulkUnavailable("the node's bulk listener serves no OPEN")
        request = _open_request(next(self._ids), seq_id, token_ids, salt, max_cached_tokens)

        def body(sock: socket.socket) -> OpenResult:
            sock.sendall(request)
            reply = wire.read_frame(sock, buf=self._local_head())
            assert reply is not None
            self.num_opens += 1
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)
            return OpenResult(reply.start, reply.end)

        if self.is_local_enabled and self.local_name != "":
            try:  # same host: the Unix socket (no TCP stack)
                local: OpenResult = self._run_local(timeout_s, body)
                return local
            except BulkUnavailable:
                pass  # TCP
        result: OpenResult = self._run(timeout_s, body)
        return result

    def read_kv(
        self, seq_id: str, start: int, end: int | None, timeout_s: float, out: codec.KVOut | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end) (end None: to the sequence's end),
        each [num_layers, n, kv_heads, head_dim], received in place: into `out`
        (checked by codec.check_kv_out) when given."""
        if start < 0 or (end is not None and end < 0):
            raise InvalidArgument(f"range [{start}, {end}) outside the sequence {seq_id!r}")
        frame = Frame(
            wire.OP_READ, next(self._ids), start=start,
            end=wire.END_OF_SEQUENCE if end is None else end, text=seq_id,
        )  # fmt: skip

        def body(sock: socket.socket) -> tuple[torch.Tensor, torch.Tensor]:
            sock.sendall(frame.pack())
            reply = wire.read_frame(sock)
            assert reply is not None
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)
            n = reply.end - reply.start
            shape = (reply.num_layers, n, reply.num_kv_heads, reply.head_dim)
            try:
                out_k, out_v = codec.kv_destination(out, shape, tensors.TORCH_DTYPES[reply.dtype])
            except InvalidArgument as exc:
                raise _Abandoned(exc) from None
            if reply.payload_len != 2 * out_k.numel() * out_k.element_size():
                raise ProtocolError(f"read reply declares {reply.payload_len} bytes for shape {shape}")
            pos = 0
            while pos < n:
                t, status, text, extra = wire.read_slab(sock)
                if status != wire.STATUS_OK:
                    raise self._error((status, text, extra))
                if not 0 < t <= n - pos:
                    raise ProtocolError(f"slab of {t} tokens at {pos} of {n}")
                for part in (out_k, out_v):
                    for layer in range(reply.num_layers):
                        wire.recv_exact(sock, wire.byte_view(part[layer, pos : pos + t]), "kv payload")
                pos += t
            return out_k, out_v

        is_ring = self.is_read_shm and self.capabilities(timeout_s).serves(wire.OP_READ_SHM)
        if self.is_local_enabled and self.local_name != "" and is_ring:
            try:  # same host: through the shared region (two copies instead of three)
                ring = self._read_shm(seq_id, start, end, timeout_s, out)
                self.num_local_transfers += 1
                self.num_shm_reads += 1
                return ring
            except BulkUnavailable:
                pass  # the Unix socket, or TCP
        if self.is_local_enabled and self.local_name != "":
            try:  # same host: the Unix socket (TCP's loopback stack is the load-sensitive part)
                local: tuple[torch.Tensor, torch.Tensor] = self._run_local(timeout_s, body)
                self.num_local_transfers += 1
                return local
            except BulkUnavailable:
                pass  # TCP
        result: tuple[torch.Tensor, torch.Tensor] = self._run(timeout_s, body)
        return result

    # -- per-step data calls ------------------------------------------------------

    def connect(self, timeout_s: float) -> None:
        """Open, ahead of the first data call, the connections it will take: a pooled
        TCP connection (checked with a PING) and, on the node's host, a same-host
        connection with its shared region mapped. A path that cannot be opened is left
        as a call would find it (the call then takes the next path)."""
        try:
            self.ping(timeout_s)
        except (BulkUnavailable, PagedKVError):
            return  # the calls go to gRPC, as they would have
        if not self.is_local_enabled or self.local_name == "":
            return
        room = 2 * shm.READ_SLOTS * shm.READ_SLOT_BYTES  # a read's ring beside a call's leased results
        try:
            conn = self._take_local(timeout_s)
            if conn.size < room:
                self._map_region(conn, room, next(self._ids))  # (closes conn on failure)
        except BulkUnavailable:
            return
        self._give_local(conn)

    def ping(self, timeout_s: float) -> None:
        """The channel's no-op round trip (its latency floor)."""
        frame = Frame(wire.OP_PING, next(self._ids)).pack()

        def body(sock: socket.socket) -> None:
            sock.sendall(frame)
            reply = wire.read_frame(sock, buf=self._local_head())
            assert reply is not None
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)

        self._run(timeout_s, body)

    def attend(
        self,
        op: int,
        seq_ids: Sequence[str],
        layer: int,
        q: Any,
        k: Any,
        v: Any,
        token_ids: codec.TokenIds | None,
        num_tokens: Sequence[int] = (),
        *,
        return_block_mass: bool = False,
        timeout_s: float,
    ) -> AttentionResult:
        """An Attend (op OP_ATTEND) or AttendPrefillBatch (OP_ATTEND_PREFILL_BATCH)
        over the channel: same arguments, result and errors as the rpc. Raises
        BulkUnavailable (nothing sent) for what the frame cannot carry, so the
        rpc reports it as it always did."""
        q = _as_cpu(q, "q")
        k = None if k is None else _as_cpu(k, "k")
        v = None if v is None else _as_cpu(v, "v")
        request_id = next(self._ids)
        head = _call_head(
            op, request_id, seq_ids, layer, q, k, v, token_ids, num_tokens, return_block_mass, self._ids_memo
        )
        if self.is_local_enabled and self.local_name != "":
            tensors_in = [t for t in (q, k, v) if t is not None]
            try:
                return self._attend_local(op, request_id, head, q, tensors_in, return_block_mass, timeout_s)
            except BulkUnavailable:
                pass  # TCP
        parts: list[bytes | memoryview] = [head]
        at = len(head) - wire.FRAME.size
        for t in (q, k, v):
            if t is not None:
                parts.append(bytes(wire.pad(at)))
                parts.append(wire.byte_view(t))
                at += wire.pad(at) + t.numel() * t.element_size()

        def body(sock: socket.socket) -> AttentionResult:
            wire.send_parts(sock, parts)
            expected = _expect_inline(q, return_block_mass)  # while the node computes
            buf = self._local_reply()
            reply, ahead = wire.read_frame_ahead(sock, buf)
            self.num_calls += 1
            if reply.status != wire.STATUS_OK:
                raise self._error(reply)
            if expected is not None:
                head, res = expected
                if (
                    ahead >= wire.REPLY_SIZE
                    and reply.payload_len == wire.REPLY_SIZE + _nbytes(res.out) + _nbytes(res.lse)
                    and buf[wire.FRAME.size : wire.FRAME.size + wire.REPLY_SIZE] == head
                ):
                    wire.recv_exact(sock, wire.byte_view(res.out), "attend result")
                    wire.recv_exact(sock, wire.byte_view(res.lse), "attend result")
                    return res
            return _read_result(sock, reply.payload_len, buf, ahead)

        result: AttentionResult = self._run(timeout_s, body)
        return result

    def _local_head(self) -> bytearray:
        buf: bytearray | None = getattr(self._local, "head", None)
        if buf is None:
            buf = self._local.head = bytearray(wire.FRAME.size)
        return buf

    def _local_reply(self) -> bytearray:
        """This thread's buffer for an attend reply's FRAME and REPLY (one recv)."""
        buf: bytearray | None = getattr(self._local, "reply", None)
        if buf is None:
            buf = self._local.reply = bytearray(wire.FRAME.size + wire.REPLY_SIZE)
        return buf


def _call_head(
    op: int,
    request_id: int,
    seq_ids: Sequence[str],
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    token_ids: codec.TokenIds | None,
    num_tokens: Sequence[int],
    mass: bool,
    ids_memo: wire.IdsMemo,
) -> bytes:
    """FRAME + the CALL body's head (wire.encode_call_body); BulkUnavailable for a
    value the frame cannot carry (the rpc takes it)."""
    try:
        tokens = None if token_ids is None else np.asarray(codec.token_list(token_ids), dtype="<i8")
        body, size = wire.encode_call_body(seq_ids, layer, q, k, v, tokens, num_tokens, mass, ids_memo)
    except (wire.Unencodable, OverflowError, TypeError, ValueError) as exc:
        raise BulkUnavailable(f"not expressible on the bulk channel: {exc}") from exc
    return Frame(op, request_id, payload_len=size).pack() + body


def _open_request(
    request_id: int, seq_id: str, token_ids: codec.TokenIds, salt: bytes, max_cached_tokens: int | None
) -> bytes:
    """An OPEN (wire.encode_open); BulkUnavailable for a value the frame cannot carry or
    the rpc's message would judge itself (an id that is not a plain int, a limit outside
    int64), so the rpc reports it as it always did."""
    limit = max_cached_tokens
    if limit is not None and (type(limit) is not int or not 0 <= limit < 2**63):
        raise BulkUnavailable(f"max_cached_tokens {limit!r} is not expressible on the bulk channel")
    if not isinstance(seq_id, str) or not isinstance(salt, bytes):
        raise BulkUnavailable("a sequence id that is not a str, or a salt that is not bytes")
    try:
        return wire.encode_open(request_id, seq_id, _token_ids(token_ids), salt, limit)
    except wire.Unencodable as exc:
        raise BulkUnavailable(str(exc)) from exc


def _token_ids(token_ids: codec.TokenIds) -> np.ndarray:
    """The prompt's ids as int64 little-endian bytes; BulkUnavailable unless they are
    plain ints in int64's range (a list of them, or an integer array or tensor): the
    rpc path judges anything else (a bool, a float, an out-of-range id) in its own
    words. A negative id is carried: the node refuses it, as it does the rpc's."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True)
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or token_ids.dtype.kind not in "iu":
            raise BulkUnavailable(f"token ids of dtype {token_ids.dtype}, {token_ids.ndim} dims")
        if token_ids.dtype.kind == "u" and token_ids.size and int(token_ids.max()) >= 2**63:
            raise BulkUnavailable("a token id over int64's range")
        return token_ids.astype("<i8", copy=False)
    ids = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
    if not set(map(type, ids)) <= {int}:  # a bool or a numpy scalar: the rpc's message judges it
        raise BulkUnavailable("token ids that are not all ints")
    try:
        return np.asarray(ids, dtype="<i8")
    except OverflowError as exc:
        raise BulkUnavailable(f"a token id over int64's range: {exc}") from exc


def _expect_inline(q: torch.Tensor, block_mass: bool) -> tuple[bytes, AttentionResult] | None:
    """The REPLY head an attend with this q most likely gets over TCP, and its result
    tensors allocated with their pages touched: made while the node computes, so after
    the reply only the head is compared and the bytes received (a fresh 512 KiB result
    faults in its pages, and after a long engine call every step runs on cold caches)."""
    head = None if block_mass or q.numel() == 0 else wire.decode_result_head(q, wire.PLACED_INLINE)
    if head is None:
        return None
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32)
    for t in (out, lse):
        t.view(torch.uint8).numpy()[:] = 0  # one memset on this thread (no intra-op threads)
    return head, AttentionResult(out, lse, None)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _read_result(
    sock: socket.socket,
    payload_len: int,
    buf: bytearray,
    ahead: int,
    area: tuple[shm.LocalConnection, int, int] | None = None,
) -> AttentionResult:
    """out, lse (and block_mass) of an ATTEND* reply, received in place, or viewed
    in the shared region when the node placed them there (area: region,
    out_offset, out_len of an ATTEND*_SHM call). buf: FRAME then REPLY, of which
    `ahead` bytes of REPLY came with the frame (wire.read_frame_ahead)."""
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
    num = len(outs)
    if payload_len != wire.REPLY_SIZE + sum(t.numel() * t.element_size() for t in outs):
        raise ProtocolError(f"attend reply declares {payload_len} bytes for {[tuple(t.shape) for t in outs]}")
    for t in outs:
        if t.numel():
            wire.recv_exact(sock, wire.byte_view(t), "attend result")
    return AttentionResult(outs[0], outs[1], outs[2] if num == 3 else None)


def _is_alive(sock: socket.socket) -> bool:
    """False when the node closed this idle connection (restart, stop), or when it is
    readable at all (EOF, or bytes on an idle connection: out of sync). One poll
    (a peek would need the socket set non-blocking and back: three syscalls)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):  # closed
        return False


def _set_timeout(sock: socket.socket, timeout_s: float) -> None:
    """settimeout, skipped when it already has this one (each call is an fcntl)."""
    if sock.gettimeout() != timeout_s:
        sock.settimeout(timeout_s)
