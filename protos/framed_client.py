"""A framed port (docs/bulk-protocol.md, UNARY) as its callers use it: a worker's Open
and Close, a node's Heartbeat and ReportEvents on the coordinator's port, without
gRPC's per-call cost on either end. The same request and reply messages, metadata and
errors as the rpc; gRPC stays the path of every other call and the fallback of these.
Role-neutral: the client and the node both use it.

The port is learned from the coordinator's replies (`frame_port`). Connections are
pooled, one call at a time each, TLS when given. A call that cannot connect, or whose
connection breaks, is not answered here: `call` raises NotCarried and the caller sends
it over gRPC (each of these calls is safe to send again: an open's request id gets
its first answer); after a failed connect the port is left alone for RETRY_AFTER_S.
Only a call whose deadline passed fails here (Unavailable, as gRPC's
DEADLINE_EXCEEDED does).

`notify` sends a request one-way (NOTIFY: no reply is sent, none is read), for a method
the server said it takes so; its outcome is learned some other way (a node's events:
from its next beat). A connection the server wrote to after one (an error reply, then
its close) is readable when next taken, so it is dropped (is_alive) and never misread.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from typing import Any

from . import wire
from .errors import Unavailable
from .tls import TlsConfig
from .wire.frame import address_host, is_alive
from .wire.unary import encode_metadata, encode_unary

MAX_POOLED = 8  # idle connections kept (a worker's concurrent opens and closes)
CONNECT_TIMEOUT_S = 2.0
RETRY_AFTER_S = 30.0


class NotCarried(Exception):
    """The framed port could not carry the call (nothing answered it): send it over gRPC."""


class FramedPort:
    """The framed port of the server whose gRPC address is `address` (the port's host),
    for calls carrying `metadata`."""

    def __init__(self, address: str, metadata: Any, tls: TlsConfig | None) -> None:
        self.host = address_host(address)
        self.port = 0  # 0: not advertised (yet), or off
        self._metadata = encode_metadata(metadata or ())
        self._tls = tls
        self._tls_context: ssl.SSLContext | None = None
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._retry_at = 0.0
        self.num_calls = 0  # calls answered here (an error reply included)
        self.num_notified = 0  # one-way calls sent here
        self.num_fallbacks = 0  # calls handed back to gRPC (no connection, or it broke)

    def learn(self, port: int) -> None:
        """The port a reply advertised (a restarted coordinator may advertise another)."""
        if port != self.port:
            self.port, self._retry_at = port, 0.0  # (a new port: no reason to wait on the old one's failure)
            self.close()

    @property
    def is_usable(self) -> bool:
        return bool(self.port) and time.monotonic() >= self._retry_at

    def call(
        self,
        method: str,
        request: Any,
        reply_type: Any,
        timeout_s: float,
        metadata: bytes | None = None,
        may_wait_s: float = 0.0,
    ) -> Any:
        """The reply of `method`; its error reply raised as the domain error; Unavailable
        when the deadline passed; NotCarried when gRPC should carry it. `metadata`
        (encode_metadata's): this call's, instead of the port's own. `may_wait_s`: how long
        the server may hold the request to serve it with others (a node's periodic calls)."""
        meta = self._metadata if metadata is None else metadata
        request_id = next(self._ids)
        payload = encode_unary(request_id, method, meta, request.SerializeToString(), may_wait_s=may_wait_s)
        sock = self._take(timeout_s)
        deadline = time.monotonic() + timeout_s
        try:
            sock.sendall(payload)
            reply = wire.read_reply(sock)
            if reply.request_id != request_id:
                raise wire.ProtocolError(f"a reply to request {reply.request_id}, not {request_id}")
            if reply.payload_len > wire.MAX_CALL_BYTES:
                raise wire.ProtocolError(f"a {reply.payload_len}-byte reply")
            body = wire.recv_bytes(sock, reply.payload_len, "a unary reply") if reply.payload_len else b""
        except TimeoutError as exc:
            sock.close()
            raise Unavailable(f"coordinator: DEADLINE_EXCEEDED: {method} after {timeout_s} s") from exc
        except (OSError, wire.ProtocolError) as exc:
            sock.close()
            self.num_fallbacks += 1
            if time.monotonic() >= deadline:
                raise Unavailable(f"coordinator: DEADLINE_EXCEEDED: {method}: {exc}") from exc
            raise NotCarried(f"the coordinator's framed port broke a call: {exc}") from exc
        self._give(sock)
        self.num_calls += 1
        if reply.status != wire.Status.OK:
            raise wire.error_of(reply.status, reply.text, reply.extra, "coordinator")
        return reply_type.FromString(body)

    def notify(
        self,
        method: str,
        request: Any,
        timeout_s: float,
        metadata: bytes | None = None,
        may_wait_s: float = 0.0,
    ) -> None:
        """Send `method` one-way: sent is all this knows (not that the server took it).
        NotCarried when it could not be sent whole (the caller sends it another way)."""
        meta = self._metadata if metadata is None else metadata
        message = request.SerializeToString()
        payload = encode_unary(next(self._ids), method, meta, message, wire.OP_NOTIFY, may_wait_s)
        sock = self._take(timeout_s)
        try:
            sock.sendall(payload)
        except OSError as exc:  # (a timeout too: part of it may have gone, the stream is out of step)
            sock.close()
            self.num_fallbacks += 1
            raise NotCarried(f"the coordinator's framed port broke a one-way call: {exc}") from exc
        self._give(sock)
        self.num_notified += 1

    def _take(self, timeout_s: float) -> socket.socket:
        with self._lock:
            while self._idle:
                sock = self._idle.pop()
                if is_alive(sock):
                    sock.settimeout(timeout_s)
                    return sock
                sock.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                if self._tls_context is None:
                    self._tls_context = self._tls.client_context()
                name = self._tls.server_name or self.host
                try:
                    sock = self._tls_context.wrap_socket(sock, server_hostname=name)
                except BaseException:
                    sock.close()
                    raise
        except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
            self._retry_at = time.monotonic() + RETRY_AFTER_S
            self.num_fallbacks += 1
            raise NotCarried(f"cannot connect to {self.host}:{self.port}: {exc}") from exc
        sock.settimeout(timeout_s)
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
        for sock in idle:
            sock.close()
