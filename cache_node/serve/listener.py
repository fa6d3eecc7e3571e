"""The node's bulk listener (protocol: docs/bulk-protocol.md, codec: protos/wire/):
its sockets, one thread per connection, and the dispatch of each request to the
ops that serve it (attend.py: ATTEND*, kv.py: APPEND, READ*; HELLO, PING, MAP,
AUTH and OPEN here).

One thread accepts on each listener (TCP, over TLS when the node has a
certificate, and the same-host abstract Unix socket named in the HELLO reply),
one thread serves each connection (limits.py: per listener, per peer, idle and
per-request timeouts, a node-wide budget for receive buffers). Requests on a
connection run one at a time. Each connection has its credentials (gate.py):
the tickets and token its client presented with AUTH; every request is checked
against them from its header, before its payload is buffered or the engine sees
it, as the gRPC path checks a call's metadata. Validation and errors are the gRPC
path's: the engine's calls, its errors mapped by protos/status.py. A bad request
gets its error after its payload is drained (the connection stays usable) when
that is small; a refused large one, a truncated request or a client that goes
away mid-transfer closes the connection and changes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from typing import Any

from ...protos import wire
from ...protos.errors import InvalidArgument, PagedKVError
from ...protos.tls import TlsConfig
from ...protos.wire import Frame, ProtocolError, Status
from ...protos.wire.limits import BulkLimits, ByteBudget, PeerCounter, Refused, TimedConn
from ..engine import CacheEngine
from ..gate import Credentials, Gate
from ..metrics import NodeMetrics
from ..shm import Region, local_listener, map_region
from .attend import AttendOps, CallBuffer
from .kv import KVOps

logger = logging.getLogger("pagedkv.cache_node.bulk")
DRAIN_BYTES = 4 << 20  # scratch for discarding the payload of a refused request
# A Unix socket's default send buffer (~200 KiB) makes a read's sendall of a slab wait
# until the client took nearly all of it; room for two slabs lets the node copy the
# next one out of the pool while the client drains this one (TCP autotunes to this).
LOCAL_SNDBUF_BYTES = 4 << 20
# Ops only a same-host (Unix socket) connection carries: they name its region.
LOCAL_OPS = frozenset({wire.OP_MAP, wire.OP_ATTEND_SHM, wire.OP_ATTEND_PREFILL_BATCH_SHM, wire.OP_READ_SHM})


class _Conn:
    """A served connection: its socket (TLS-wrapped once the handshake is done), its
    thread, its kind and the peer it counts against."""

    __slots__ = ("family", "peer", "sock", "thread")

    def __init__(self, sock: socket.socket, family: int, peer: object) -> None:
        self.sock, self.family, self.peer = sock, family, peer
        self.thread: threading.Thread | None = None


class BulkServer:
    """The bulk listener of one node. `start()` binds nothing (the constructor
    does: `port` is known before start); `stop()` closes the listener and every
    connection and joins their threads. Counters: requests served, requests
    refused with an error reply, connections dropped mid-request (HELLO, AUTH and
    a successful MAP set a connection up and are not counted)."""

    def __init__(
        self,
        engine: CacheEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_connections: int | None = None,
        max_staging_bytes: int = 1 << 30,
        metrics: NodeMetrics | None = None,
        local: bool = True,
        gate: Gate | None = None,
        tls: TlsConfig | None = None,
        limits: BulkLimits | None = None,
    ) -> None:
        limits = limits or BulkLimits()
        if max_connections is not None:
            limits = BulkLimits(**{**limits.__dict__, "max_connections": max_connections})
        self.limits = limits
        max_connections = limits.max_connections
        self.gate = gate or Gate()
        self.budget = ByteBudget(limits.max_inflight_bytes)
        self._tls = None if tls is None else tls.server_context()
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
        node_ops = frozenset(wire.OP_NAMES) - {wire.OP_UNARY, wire.OP_NOTIFY}  # (the coordinator's port)
        self.ops = node_ops - (frozenset() if listener else LOCAL_OPS)
        self._max_connections = max_connections
        self.attend_ops = AttendOps(self)
        self.kv_ops = KVOps(self, max_staging_bytes)
        self._conns: dict[int, _Conn] = {}
        self._peers = PeerCounter()
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
            conns = list(self._conns.values())
        for sock in (self._sock, self._local_sock):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
                sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        for c in conns:
            if c.thread is not None:
                c.thread.join(5)
        for t in self._accepters:
            t.join(5)

    # -- connections ------------------------------------------------------------

    def _accept_loop(self, listener: socket.socket) -> None:
        is_local = listener.family == socket.AF_UNIX
        while True:
            try:
                conn, addr = listener.accept()
            except OSError:
                return  # listener closed
            if is_local:
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF_BYTES)
            else:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = _local_peer(conn) if is_local else addr[0]
            with self._lock:
                # each listener has its own cap: a same-host client also keeps a TCP connection
                num_same_kind = sum(c.family == listener.family for c in self._conns.values())
                if (
                    self._is_stopping
                    or num_same_kind >= self._max_connections
                    or not self._peers.admit(peer, self.limits.max_per_peer)
                ):
                    conn.close()  # the client falls back to gRPC
                    continue
                served = _Conn(conn, listener.family, peer)
                served.thread = threading.Thread(
                    target=self._serve, args=(served, is_local), name="pagedkv-bulk", daemon=True
                )
                self._conns[id(served)] = served
            served.thread.start()

    def _handshake(self, served: _Conn) -> socket.socket | None:
        """The connection's socket, TLS-wrapped (handshake bounded, on this thread)
        when the node has a certificate; None when the handshake failed."""
        conn = served.sock
        if self._tls is None:
            return conn
        conn.settimeout(self.limits.handshake_timeout_s)
        try:
            wrapped = self._tls.wrap_socket(conn, server_side=True)
        except (OSError, ValueError) as exc:  # a plaintext peer, a bad certificate, a timeout
            logger.info("bulk TLS handshake failed: %s", exc)
            return None
        with self._lock:
            served.sock = wrapped  # (stop() shuts down what the thread reads from)
        return wrapped

    def _serve(self, served: _Conn, is_local: bool = False) -> None:
        """One connection's requests, in order. A local (Unix socket) connection
        may also carry MAP and ATTEND*_SHM; its region is unmapped when it ends."""
        head, body = bytearray(wire.FRAME.size), CallBuffer()
        fds: list[int] | None = [] if is_local else None
        region: Region | None = None
        creds = self.gate.credentials()
        conn: Any = served.sock if is_local else self._handshake(served)
        if conn is None:
            self.bump("num_dropped")
            served.sock.close()
            with self._lock:
                self._conns.pop(id(served), None)
                self._peers.release(served.peer)
            return
        try:
            conn = TimedConn(conn, self.limits)
            while (frame := wire.read_frame(conn, eof_ok=True, buf=head, fds=fds)) is not None:
                conn.arm(frame.payload_len)
                if frame.op not in self.ops or (frame.op in LOCAL_OPS and fds is None):
                    self.reply_error(conn, frame, InvalidArgument(f"bulk: unknown op {frame.op}"))
                    return  # its payload's framing is unknown: close
                if frame.op in (wire.OP_ATTEND, wire.OP_ATTEND_PREFILL_BATCH):
                    self.attend_ops.call(conn, frame, body, creds)
                elif frame.op == wire.OP_PING:
                    self._ping(conn, frame)
                elif frame.op == wire.OP_HELLO:
                    self._hello(conn, frame)
                elif frame.op == wire.OP_AUTH:
                    self._auth(conn, frame, creds)
                elif frame.op == wire.OP_MAP:
                    assert fds is not None
                    region = self._map(conn, frame, fds, region)
                elif frame.op in wire.SHM_OPS:
                    self.attend_ops.shm_call(conn, frame, region, creds)
                elif frame.op == wire.OP_READ_SHM:
                    self.kv_ops.read_shm(conn, frame, region, creds)
                elif frame.op == wire.OP_APPEND:
                    self.kv_ops.append(conn, frame, creds)
                elif frame.op == wire.OP_READ:
                    self.kv_ops.read(conn, frame, creds)
                else:
                    self._open(conn, frame, creds)
                conn.disarm()
                _close_fds(fds)  # descriptors sent with another op than MAP
        except Refused as exc:
            self.bump("num_dropped")
            if exc.error is not None:  # (else its answer already left)
                with contextlib.suppress(OSError):
                    self.refuse(conn, exc.frame, exc.method, exc.error)
        except ProtocolError as exc:
            self.bump("num_dropped")
            logger.info("bulk connection dropped: %s", exc)
            with contextlib.suppress(OSError):  # tell the peer why, if it still listens
                error = Frame(0, status=Status.INVALID_ARGUMENT, text=f"bulk protocol error: {exc}")
                conn.sendall(error.pack())
        except OSError as exc:  # reset, broken pipe, stop()
            self.bump("num_dropped")
            logger.info("bulk connection lost: %s", exc)
        except Exception:  # a bug: log it, drop this connection, keep serving others
            self.bump("num_dropped")
            logger.exception("bulk connection failed")
        finally:
            _close_fds(fds)
            if region is not None:
                region.close()
            conn.close()
            with self._lock:
                self._conns.pop(id(served), None)
                self._peers.release(served.peer)

    def reply_error(self, conn: socket.socket, frame: Frame, exc: Exception) -> str:
        """Send exc as the reply's status; returns the status code's name."""
        if not isinstance(exc, PagedKVError):
            logger.error("bulk %s failed", frame.op, exc_info=exc)
        self.bump("num_errors")
        reply, name = wire.error_frame(frame.op, frame.request_id, exc)
        conn.sendall(reply.pack())
        return name

    def bump(self, counter: str) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)

    def drain(self, conn: socket.socket, num_bytes: int) -> None:
        scratch = bytearray(min(DRAIN_BYTES, max(num_bytes, 1)))
        view = memoryview(scratch)
        while num_bytes > 0:
            chunk = view[: min(len(view), num_bytes)]
            wire.recv_exact(conn, chunk, "a refused payload")
            num_bytes -= len(chunk)

    # -- ATTEND, ATTEND_PREFILL_BATCH, PING ----------------------------------------

    def _ping(self, conn: socket.socket, f: Frame) -> None:
        if f.payload_len:
            error = InvalidArgument("bulk ping: the request carries no payload")
            self.refuse_payload(conn, f, "Ping", error, f.payload_len)
            return
        self.bump("num_requests")
        conn.sendall(Frame(f.op, f.request_id).pack())

    def _auth(self, conn: socket.socket, f: Frame, creds: Credentials) -> None:
        """AUTH: add the presented tickets (and token) to the connection's credentials.
        A refused one (forged, expired, another node's) answers its error and adds
        nothing after it; the connection stays usable."""
        if f.payload_len > wire.MAX_AUTH_BYTES:
            raise ProtocolError(f"auth payload of {f.payload_len} bytes exceeds {wire.MAX_AUTH_BYTES}")
        payload = wire.recv_bytes(conn, f.payload_len, "auth payload")
        try:
            tickets, token = wire.decode_auth(payload)
            self.gate.present(creds, tickets)
            self.gate.present_token(creds, token)
        except PagedKVError as exc:
            self.reply_error(conn, f, exc)
            return
        conn.sendall(Frame(f.op, f.request_id, start=len(tickets)).pack())  # set-up: not counted

    def refuse_payload(
        self, conn: socket.socket, f: Frame, method: str, exc: Exception, num_bytes: int
    ) -> None:
        """Refuse a request whose num_bytes of payload follow: answered at once (refused
        from its header), then the payload drained (the connection stays usable) when it
        is at most wire.MAX_DRAIN_BYTES, else the connection closed (Refused) unread."""
        self.refuse(conn, f, method, exc)
        if num_bytes > wire.MAX_DRAIN_BYTES:
            raise Refused(f, method, None)
        self.drain(conn, num_bytes)

    def _hello(self, conn: socket.socket, f: Frame) -> None:
        if f.payload_len:
            error = InvalidArgument("bulk hello: the request carries no payload")
            self.refuse_payload(conn, f, "Hello", error, f.payload_len)
            return
        bs = self.engine.spec.block_size
        caps = wire.Capabilities(
            self.ops, self.local_name, max_append_tokens=self.engine.config.num_blocks * bs, block_size=bs
        ).encode()
        conn.sendall(Frame(f.op, f.request_id, payload_len=len(caps)).pack() + caps)  # set-up: not counted

    def refuse(self, conn: socket.socket, f: Frame, method: str, exc: Exception) -> None:
        """The error reply of a refused call, counted under its rpc's name."""
        code = self.reply_error(conn, f, exc)
        if self.metrics is not None:
            self.metrics.rpc_errors.labels(method, code).inc()

    def observe(self, method: str, start: float, seconds: float | None = None) -> None:
        """The handler latency metric: the engine call's seconds (from `start` when not given)."""
        if self.metrics is not None:
            self._latency[method].observe(time.perf_counter() - start if seconds is None else seconds)

    def _map(self, conn: socket.socket, f: Frame, fds: list[int], old: Region | None) -> Region | None:
        """The connection's region after a MAP: the new one, or none after an error
        (the old one is unmapped either way)."""
        if old is not None:
            old.close()
        try:
            if f.payload_len:
                self.refuse_payload(
                    conn, f, "Map", InvalidArgument("bulk map: the request carries no payload"), f.payload_len
                )
                return None
            region = map_region(f, fds)
        except PagedKVError as exc:
            self.reply_error(conn, f, exc)
            return None
        finally:
            _close_fds(fds)  # the mapping keeps the memory; the descriptor is not needed
        conn.sendall(Frame(f.op, f.request_id, end=region.size).pack())  # set-up: not counted
        return region

    def fixed_request(
        self, conn: socket.socket, f: Frame, layout: struct.Struct, what: str
    ) -> tuple[int, ...] | None:
        """The request's fixed-size payload, unpacked; None after refusing one of another
        size (drained, error reply: the connection stays in sync; one too large to drain
        closes the connection)."""
        if f.payload_len != layout.size:
            error = InvalidArgument(f"bulk {what}: {f.payload_len}-byte request")
            self.refuse_payload(conn, f, what, error, f.payload_len)
            return None
        head = bytearray(layout.size)
        wire.recv_exact(conn, memoryview(head), what)
        return layout.unpack(head)

    def _open(self, conn: socket.socket, f: Frame, creds: Credentials) -> None:
        """The Open rpc over the channel (docs/bulk-protocol.md, OPEN): a direct-mode
        open (its salt is the caller's), so the coordinator's on a node serving a
        cluster (refused from the header otherwise). The whole request is read
        before the engine opens anything, and the engine's open is the rpc's, so are
        its validation and errors. Recorded under the rpc's name in the metrics: an
        Open is an Open whichever path carried it."""
        if f.payload_len > wire.MAX_CALL_BYTES:  # cannot be drained in bounded time: close
            raise ProtocolError(f"open request of {f.payload_len} bytes exceeds {wire.MAX_CALL_BYTES}")
        try:
            self.gate.require_admin(creds, "Open")
        except PagedKVError as exc:
            self.refuse_payload(conn, f, "Open", exc, f.payload_len)
            return
        if 8 * f.end > f.payload_len:
            msg = (
                f"bulk open: {f.payload_len} payload bytes cannot hold {f.end} token ids ({8 * f.end} bytes)"
            )
            self.refuse_payload(conn, f, "Open", InvalidArgument(msg), f.payload_len)
            return
        try:
            self.budget.take(f.payload_len, "open")
        except PagedKVError as exc:
            raise Refused(f, "Open", exc) from None
        try:
            payload = bytearray(f.payload_len)
            wire.recv_exact(conn, memoryview(payload), "open payload", socket.MSG_WAITALL)
        finally:
            self.budget.give(f.payload_len)
        started = time.perf_counter()
        try:
            req = wire.decode_open(f, payload)
            res = self.engine.open(req.seq_id, req.token_ids, req.salt, req.max_cached_tokens)
        except Exception as exc:  # every failure becomes a status; the node keeps serving
            self.refuse(conn, f, "Open", exc)
            return
        finally:
            if self.metrics is not None:
                self.metrics.rpc_latency.labels("Open").observe(time.perf_counter() - started)
        self.bump("num_requests")
        conn.sendall(
            Frame(f.op, f.request_id, start=res.num_cached_tokens, end=res.num_host_hit_tokens).pack()
        )


def _close_fds(fds: list[int] | None) -> None:
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())


def _local_peer(conn: socket.socket) -> object:
    """The process at the other end of a Unix socket (SO_PEERCRED's pid)."""
    try:
        pid, _uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except (OSError, AttributeError, struct.error):
        return "local"
    return ("pid", pid)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bulk_host(address: str) -> str:
    """The host part of a gRPC listen address ("0.0.0.0:50051", "[::]:0", "localhost:0")."""
    return wire.address_host(address) or "0.0.0.0"
