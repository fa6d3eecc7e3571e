"""The node's bulk listener: large Append / ReadKV ranges, and the per-step
Attend / AttendPrefillBatch calls, over raw TCP.

The protocol is docs/bulk-protocol.md, its codec protos/wire/. This side owns the sockets:
one thread accepts, one thread serves each connection (at most
`max_connections`; a connection over the limit is closed at once and the
client falls back to gRPC). Requests on a connection run one at a time.

Bytes move without payload-sized Python objects: an upload is received with
`recv_into` straight into a pooled staging tensor and written into the block
pool by the engine's per-block strided copies (`append_slabs`); a read copies
one slab at a time from the pool into a reused slab-sized staging tensor
(`read_kv_into`) and sends it with `sendall`.

Validation and errors are the gRPC path's: the header is checked against the
node's ModelSpec before the payload is read, engine errors are mapped by
protos.status.status_for, and the engine changes nothing unless the whole
request arrived. An ATTEND* body is received into the connection's reused
buffer and the engine computes on views of it (the gRPC handlers' engine calls,
so the same validation and errors); the reply's out / lse leave with one
sendmsg. A bad request gets its error after its payload is drained
(the connection stays usable); a truncated request or a client that goes away
mid-transfer closes the connection and changes nothing.

Same-host clients (cache_node/shm.py) reach the same server through an abstract
Unix socket named in the HELLO reply: the same ops, served by the same loop, plus
MAP (the client's memfd region), ATTEND*_SHM, whose body and results stay in
that region (no payload through the socket), and READ_SHM, which gathers each
slab of a read from the pool straight into a slot of a small ring in the region.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..protos import wire
from ..protos.errors import CapacityExceeded, InvalidArgument, PagedKVError
from ..protos.tensors import DTYPE_NAMES, TORCH_DTYPES, tensor_at, tokens_per_chunk
from ..protos.wire import Frame, ProtocolError, Status
from .engine import CacheEngine
from .metrics import NodeMetrics
from .shm import Region, local_listener, map_region, write_results

logger = logging.getLogger("pagedkv.cache_node.bulk")
DRAIN_BYTES = 4 << 20  # scratch for discarding the payload of a refused request
# Default read slab when the client names none: small enough that copying the next
# slab out of the pool overlaps with the peer draining the socket (2 MiB measured
# 1.5-1.8 GB/s for a 256 MiB read here, 8-32 MiB 1.1-1.7).
READ_SLAB_BYTES = 2 << 20
# A Unix socket's default send buffer (~200 KiB) makes a read's sendall of a slab wait
# until the client took nearly all of it; with room for two slabs the node copies the
# next one out of the pool while the client drains this one (TCP autotunes to this).
LOCAL_SNDBUF_BYTES = 4 << 20
# Ops only a same-host (Unix socket) connection carries: they name its region.
LOCAL_OPS = frozenset({wire.OP_MAP, wire.OP_ATTEND_SHM, wire.OP_ATTEND_PREFILL_BATCH_SHM, wire.OP_READ_SHM})
_IDS = wire.IdsMemo()  # the last CALL's sequence ids, shared by the connections' threads


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


class BulkServer:
    """The bulk listener of one node. `start()` binds nothing (the constructor
    does: `port` is known before start); `stop()` closes the listener and every
    connection and joins their threads. Counters: requests served, requests
    refused with an error reply, connections dropped mid-request (HELLO and a
    successful MAP set a connection up and are not counted)."""

    def __init__(
        self,
        engine: CacheEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int = 16,
        max_staging_bytes: int = 1 << 30,
        metrics: NodeMetrics | None = None,
        local: bool = True,
    ) -> None:
        self.engine = engine
        self.metrics = metrics  # the per-step calls are recorded under their rpc's name
        self._latency = {  # the labelled histograms, looked up once (labels() locks and validates)
            m: metrics.rpc_latency.labels(m) for m in ("Attend", "AttendPrefillBatch") if metrics is not None
        }
        self._sock = socket.create_server((host, port), family=_family(host), backlog=max_connections)
        self.port: int = self._sock.getsockname()[1]
        # The same-host listener (HELLO names it; "" = none): off with local=False or off Linux.
        listener = local_listener(max_connections) if local else None
        self._local_sock: socket.socket | None = None if listener is None else listener[0]
        self.local_name = "" if listener is None else listener[1]
        # What HELLO advertises and the loop serves (a test may narrow it to play a smaller node).
        self.ops = frozenset(wire.OP_NAMES) - (frozenset() if listener else LOCAL_OPS)
        self._max_connections = max_connections
        self._staging = _StagingPool(max_staging_bytes)
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._lock = threading.Lock()
        self._accepters: list[threading.Thread] = []
        self._is_stopping = False
        self.num_requests = 0
        self.num_errors = 0
        self.num_dropped = 0

    def start(self) -> BulkServer:
        for sock in (self._sock, self._local_sock):
            if sock is not None:
                t = threading.Thread(
                    target=self._accept_loop, args=(sock,), name="pagedkv-bulk-accept", daemon=True
                )
                self._accepters.append(t)
                t.start()
        return self

    def stop(self) -> None:
        """Close the listener and every connection (a transfer in progress fails
        on the client as Unavailable and changes nothing on the node)."""
        with self._lock:
            self._is_stopping = True
            conns = list(self._conns.items())
        for sock in (self._sock, self._local_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
                sock.close()
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(5)
        for t in self._accepters:
            t.join(5)

    # -- connections ------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        is_local = listener.family == socket.AF_UNIX
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # listener closed
            if is_local:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF_BYTES)
            else:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                # each listener has its own cap: a same-host client also keeps a TCP connection
                num_same_kind = sum(c.family == listener.family for c in self._conns)
                if self._is_stopping or num_same_kind >= self._max_connections:
                    conn.close()  # the client falls back to gRPC
                    continue
                thread = threading.Thread(
                    target=self._serve, args=(conn, is_local), name="pagedkv-bulk", daemon=True
                )
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket, is_local: bool = False) -> None:
        """One connection's requests, in order. A local (Unix socket) connection
        may also carry MAP and ATTEND*_SHM; its region is unmapped when it ends."""
        head, body = bytearray(wire.FRAME.size), _CallBuffer()
        fds: list[int] | None = [] if is_local else None
        region: Region | None = None
        try:
            while (frame := wire.read_frame(conn, eof_ok=True, buf=head, fds=fds)) is not None:
                if frame.op not in self.ops or (frame.op in LOCAL_OPS and fds is None):
                    self._reply_error(conn, frame, InvalidArgument(f"bulk: unknown op {frame.op}"))
                    return  # its payload's framing is unknown: close
                if frame.op in (wire.OP_ATTEND, wire.OP_ATTEND_PREFILL_BATCH):
                    self._call(conn, frame, body)
                elif frame.op == wire.OP_PING:
                    self._ping(conn, frame)
                elif frame.op == wire.OP_HELLO:
                    self._hello(conn, frame)
                elif frame.op == wire.OP_MAP:
                    assert fds is not None
                    region = self._map(conn, frame, fds, region)
                elif frame.op in wire.SHM_OPS:
                    self._shm_call(conn, frame, region)
                elif frame.op == wire.OP_READ_SHM:
                    self._read_shm(conn, frame, region)
                elif frame.op == wire.OP_APPEND:
                    self._append(conn, frame)
                elif frame.op == wire.OP_READ:
                    self._read(conn, frame)
                else:
                    self._open(conn, frame)
                _close_fds(fds)  # descriptors sent with another op than MAP
        except ProtocolError as exc:
            self._bump("num_dropped")
            logger.info("bulk connection dropped: %s", exc)
            with contextlib.suppress(OSError):  # tell the peer why, if it still listens
                error = Frame(0, status=Status.INVALID_ARGUMENT, text=f"bulk protocol error: {exc}")
                conn.sendall(error.pack())
        except OSError as exc:  # reset, broken pipe, stop()
            self._bump("num_dropped")
            logger.info("bulk connection lost: %s", exc)
        except Exception:  # a bug: log it, drop this connection, keep serving others
            self._bump("num_dropped")
            logger.exception("bulk connection failed")
        finally:
            _close_fds(fds)
            if region is not None:
                region.close()
            conn.close()
            with self._lock:
                self._conns.pop(conn, None)

    def _reply_error(self, conn: socket.socket, frame: Frame, exc: Exception) -> str:
        """Send exc as the reply's status; returns the status code's name."""
        if not isinstance(exc, PagedKVError):
            logger.error("bulk %s failed", frame.op, exc_info=exc)
        self._bump("num_errors")
        reply, name = wire.error_frame(frame.op, frame.request_id, exc)
        conn.sendall(reply.pack())
        return name

    def _bump(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def _drain(self, conn: socket.socket, num_bytes: int) -> None:
        scratch = bytearray(min(DRAIN_BYTES, max(num_bytes, 1)))
        view = memoryview(scratch)
        while num_bytes > 0:
            chunk = view[: min(len(view), num_bytes)]
            wire.recv_exact(conn, chunk, "a refused payload")
            num_bytes -= len(chunk)

    # -- ATTEND, ATTEND_PREFILL_BATCH, PING ----------------------------------------

    def _ping(self, conn: socket.socket, f: Frame) -> None:
        if f.payload_len:
            self._drain(conn, f.payload_len)
            self._reply_error(conn, f, InvalidArgument("bulk ping: the request carries no payload"))
            return
        self._bump("num_requests")
        conn.sendall(Frame(f.op, f.request_id).pack())

    def _hello(self, conn: socket.socket, f: Frame) -> None:
        if f.payload_len:
            self._drain(conn, f.payload_len)
            self._reply_error(conn, f, InvalidArgument("bulk hello: the request carries no payload"))
            return
        caps = wire.Capabilities(self.ops, self.local_name).encode()
        conn.sendall(Frame(f.op, f.request_id, payload_len=len(caps)).pack() + caps)  # set-up: not counted

    def _call(self, conn: socket.socket, f: Frame, body: _CallBuffer) -> None:
        """One Attend / AttendPrefillBatch: the whole body is read into the
        connection's reused buffer before anything is checked or changed; the
        engine call is the gRPC handler's, so are its validation and errors."""
        if f.payload_len > wire.MAX_CALL_BYTES:  # cannot be drained in bounded time: close
            raise ProtocolError(f"call body of {f.payload_len} bytes exceeds {wire.MAX_CALL_BYTES}")
        data = wire.byte_view(body.take(f.payload_len))
        # the connection is blocking: the whole body in one recv (a batch-32 q is 512 KiB)
        wire.recv_exact(conn, data, "call body", socket.MSG_WAITALL)
        self._attend(conn, f, f.op, data)

    def _attend(
        self, conn: socket.socket, f: Frame, op: int, data: memoryview, region: Region | None = None,
        out_at: int = 0, out_len: int = 0,
    ) -> None:  # fmt: skip
        """The engine call of the CALL body in `data` (op: ATTEND or
        ATTEND_PREFILL_BATCH) and its reply, both through engine.run (on the engine's
        compute thread when it has one: the reply leaves as soon as the results exist).
        region: the connection's shared region, whose [out_at, +out_len) area a
        decode writes out and lse into in place, and the results are copied to."""
        method = "Attend" if op == wire.OP_ATTEND else "AttendPrefillBatch"
        e = self.engine
        try:
            call = wire.decode_call(op, data, _IDS)
            area = None if region is None else region.memory(out_at, out_len, "the result area")
            dst = None if area is None or op != wire.OP_ATTEND else _decode_destination(call.q, area)
            # the reply when the decode kernel writes into the region, built while this process's
            # caches are warm (after a long engine call they are cold: ~50 µs for these few lines)
            placed_reply = b"" if dst is None else self._reply_head(f, dst, wire.PLACED_REGION)
        except Exception as exc:
            self._refuse(conn, f, method, exc)
            return

        def attend_and_reply() -> None:
            start = time.perf_counter()
            try:
                if op == wire.OP_ATTEND:
                    out = e.attend_decode(
                        call.seq_ids, call.layer, call.q, call.k, call.v, call.token_ids,
                        return_block_mass=call.want_mass, out=dst,
                    )  # fmt: skip
                else:
                    out = e.attend_prefill_batch(
                        call.seq_ids, call.layer, call.counts, call.q, call.k, call.v, call.token_ids
                    )
            except BaseException:
                self._observe(method, start)
                raise
            seconds = time.perf_counter() - start
            mass = out.block_mass if call.want_mass else None
            if dst is not None and mass is None and _is_at(out.out, dst[0]) and _is_at(out.lse, dst[1]):
                # the decode kernel wrote them into the region: the reply was built ahead
                self._bump("num_requests")
                conn.sendall(placed_reply)
            else:
                parts = [t.detach().to("cpu").contiguous() for t in (out.out, out.lse, mass) if t is not None]
                placed = region is not None and write_results(region, out_at, out_len, parts)
                self._reply(conn, f, parts, wire.PLACED_REGION if placed else wire.PLACED_INLINE)
            self._observe(method, start, seconds)  # after the reply left: not on the caller's path

        try:
            e.awaiting_open(lambda: e.run(attend_and_reply))
        except OSError:
            raise  # the reply could not be sent: the connection is gone
        except Exception as exc:  # every engine failure becomes a status; the node keeps serving
            self._refuse(conn, f, method, exc)

    def _refuse(self, conn: socket.socket, f: Frame, method: str, exc: Exception) -> None:
        """The error reply of a refused call, counted under its rpc's name."""
        code = self._reply_error(conn, f, exc)
        if self.metrics is not None:
            self.metrics.rpc_errors.labels(method, code).inc()

    def _observe(self, method: str, start: float, seconds: float | None = None) -> None:
        """The handler latency metric: the engine call's seconds (from `start` when not given)."""
        if self.metrics is not None:
            self._latency[method].observe(time.perf_counter() - start if seconds is None else seconds)

    def _reply(self, conn: socket.socket, f: Frame, parts: list[torch.Tensor], placement: int) -> None:
        """FRAME + REPLY, then the tensors' bytes unless they were placed in the region."""
        inline = placement == wire.PLACED_INLINE
        self._bump("num_requests")
        head = self._reply_head(f, parts, placement)
        wire.send_parts(conn, [head, *(wire.byte_view(t) for t in parts if inline)])

    @staticmethod
    def _reply_head(f: Frame, parts: Sequence[torch.Tensor], placement: int) -> bytes:
        """FRAME + REPLY describing `parts` (their bytes follow unless placed in the region)."""
        descs = [(DTYPE_NAMES[t.dtype], tuple(t.shape)) for t in parts]
        inline = sum(map(wire.nbytes, parts)) if placement == wire.PLACED_INLINE else 0
        return wire.encode_reply(f.op, f.request_id, descs, placement, inline)

    # -- same host: MAP, ATTEND*_SHM ----------------------------------------------

    def _map(self, conn: socket.socket, f: Frame, fds: list[int], old: Region | None) -> Region | None:
        """The connection's region after a MAP: the new one, or none after an error
        (the old one is unmapped either way)."""
        if old is not None:
            old.close()
        try:
            if f.payload_len:
                self._drain(conn, f.payload_len)
                raise InvalidArgument("bulk map: the request carries no payload")
            region = map_region(f, fds)
        except Exception as exc:
            self._reply_error(conn, f, exc)
            return None
        finally:
            _close_fds(fds)  # the mapping keeps the memory; the descriptor is not needed
        conn.sendall(Frame(f.op, f.request_id, end=region.size).pack())  # set-up: not counted
        return region

    def _fixed_request(
        self, conn: socket.socket, f: Frame, layout: struct.Struct, what: str
    ) -> tuple[int, ...] | None:
        """The request's fixed-size payload, unpacked; None after refusing one of another
        size (drained, error reply: the connection stays in sync). A payload too large to
        drain is a ProtocolError (the connection closes)."""
        if f.payload_len != layout.size:
            if f.payload_len > wire.MAX_CALL_BYTES:
                raise ProtocolError(f"{what} of {f.payload_len} bytes (expected {layout.size})")
            self._drain(conn, f.payload_len)
            self._reply_error(conn, f, InvalidArgument(f"bulk {what}: {f.payload_len}-byte request"))
            return None
        head = bytearray(layout.size)
        wire.recv_exact(conn, memoryview(head), what)
        return layout.unpack(head)

    def _shm_call(self, conn: socket.socket, f: Frame, region: Region | None) -> None:
        """An Attend / AttendPrefillBatch whose body and results are in the region."""
        head = self._fixed_request(conn, f, wire.SHM_CALL, "shm call")
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
            self._reply_error(conn, f, exc)
            return
        self._attend(conn, f, wire.SHM_OPS[f.op], data, region, out_at, out_len)
        del data

    # -- APPEND -----------------------------------------------------------------

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

    def _append(self, conn: socket.socket, f: Frame) -> None:
        try:
            n = self._check_append(f)
        except PagedKVError as exc:
            self._drain(conn, 8 * max(0, f.end - f.start) + f.payload_len)
            self._reply_error(conn, f, exc)
            return
        ids = np.empty(n, dtype="<i8")
        wire.recv_exact(conn, ids.data.cast("B"), "token ids")
        staging = self._staging.take(f.payload_len)
        try:
            wire.recv_exact(conn, wire.byte_view(staging), "kv payload")
            try:
                slabs = self._slabs(staging, n, f.slab_tokens)
                tokens = ids.tolist()
                self.engine.awaiting_open(lambda: self.engine.append_slabs(f.text, tokens, slabs))
                length = self.engine.sequence_length(f.text)
            except Exception as exc:  # every failure becomes a status; the node keeps serving
                self._reply_error(conn, f, exc)
                return
        finally:
            self._staging.give(staging)
        self._bump("num_requests")
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

    # -- OPEN -------------------------------------------------------------------

    def _open(self, conn: socket.socket, f: Frame) -> None:
        """The Open rpc over the channel (docs/bulk-protocol.md, OPEN): the whole request is
        read before the engine opens anything, and the engine's open is the rpc's, so
        are its validation and errors. Recorded under the rpc's name in the metrics:
        an Open is an Open whichever path carried it."""
        if f.payload_len > wire.MAX_CALL_BYTES:  # cannot be drained in bounded time: close
            raise ProtocolError(f"open request of {f.payload_len} bytes exceeds {wire.MAX_CALL_BYTES}")
        is_whole = 8 * f.end <= f.payload_len
        payload = bytearray(f.payload_len if is_whole else 0)
        if is_whole:
            wire.recv_exact(conn, memoryview(payload), "open payload", socket.MSG_WAITALL)
        else:
            self._drain(conn, f.payload_len)
        started = time.perf_counter()
        try:
            req = wire.decode_open(f, payload if is_whole else bytes(f.payload_len))
            res = self.engine.open(req.seq_id, req.token_ids, req.salt, req.max_cached_tokens)
        except Exception as exc:  # every failure becomes a status; the node keeps serving
            self._refuse(conn, f, "Open", exc)
            return
        finally:
            if self.metrics is not None:
                self.metrics.rpc_latency.labels("Open").observe(time.perf_counter() - started)
        self._bump("num_requests")
        conn.sendall(
            Frame(f.op, f.request_id, start=res.num_cached_tokens, end=res.num_host_hit_tokens).pack()
        )

    # -- READ -------------------------------------------------------------------

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
            self._bump("num_requests")  # counted before the reply's last bytes leave
        conn.sendall(
            Frame(f.op, f.request_id, s.dtype, start=f.start, end=stop, num_layers=s.num_layers,
                  num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, slab_tokens=step,
                  payload_len=payload_len).pack()
        )  # fmt: skip

    def _read(self, conn: socket.socket, f: Frame) -> None:
        s = self.engine.spec
        try:
            if f.payload_len:
                raise InvalidArgument("bulk read: the request carries no payload")
            stop = self._read_stop(f)
        except Exception as exc:
            self._drain(conn, f.payload_len)
            self._reply_error(conn, f, exc)
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
                    self._bump("num_errors")
                    conn.sendall(wire.error_slab(exc))
                    return
                pos += t
                if pos >= stop:
                    self._bump("num_requests")
                conn.sendall(wire.pack_slab(t))
                conn.sendall(wire.byte_view(slab))
        finally:
            self._staging.give(staging)

    def _read_shm(self, conn: socket.socket, f: Frame, region: Region | None) -> None:
        """A READ whose slabs go through a ring of slots in the region (docs/bulk-protocol.md,
        READ_SHM): each slab is gathered from the pool straight into its slot, the
        socket carries only the SLAB headers and the client's ACKs."""
        head = self._fixed_request(conn, f, wire.SHM_READ, "shm read")
        if head is None:
            return
        area_at, slot_bytes, num_slots = head
        s = self.engine.spec
        bpt = s.bytes_per_token
        try:
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
            self._reply_error(conn, f, exc)
            return
        n = stop - f.start
        if n and slot_bytes < bpt:  # the client grows its region once and asks again
            self._bump("num_errors")
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
                self._bump("num_errors")
                conn.sendall(wire.error_slab(exc))
                # the client acked slabs 0..i-1 that free a slot; those below i - num_slots + 1 were read
                for j in range(max(0, i - num_slots + 1), min(i, max(0, num_slabs - num_slots))):
                    self._read_ack(conn, ack, j)
                return
            del slab
            if i == num_slabs - 1:
                self._bump("num_requests")
            conn.sendall(wire.pack_slab(t))

    @staticmethod
    def _read_ack(conn: socket.socket, buf: bytearray, expected: int) -> None:
        wire.recv_exact(conn, memoryview(buf), "a read ack")
        (got,) = wire.READ_ACK.unpack(buf)
        if got != expected:
            raise ProtocolError(f"read ack for slab {got}, expected {expected}")


class _CallBuffer:
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


def _close_fds(fds: list[int] | None) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bulk_host(address: str) -> str:
    """The host part of a gRPC listen address ("0.0.0.0:50051", "[::]:0", "localhost:0")."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]") or "0.0.0.0"
