"""What bounds a framed listener (the node's bulk channel, the coordinator's framed
control port), so that no client can hold it or inflate it.

- Connections: at most `max_connections` per listener and `max_per_peer` per peer
  (an IP address over TCP, a process over the Unix socket); one over is closed at
  once (the client takes its next transport).
- Time: a connection that sends nothing for `idle_timeout_s` (between requests or
  in the middle of one) is closed, and so is one whose request (header, payload,
  the client's acks of a read) is not all there within `frame_timeout_s` + its
  payload at `min_bytes_per_s`: a client that trickles a byte a second holds a
  slot for seconds, not forever. A TLS handshake gets `handshake_timeout_s`, on
  the connection's own thread.
- Memory: a receive buffer sized by the client (an APPEND's staging, a large
  CALL body, an OPEN's ids) is taken from a node-wide budget of
  `max_inflight_bytes`, only after the request was checked from its header (who
  sends it, and that it fits the pool): a request that does not get its bytes is
  refused (RESOURCE_EXHAUSTED) and the connection closed, nothing allocated.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CapacityExceeded, InvalidArgument
from .frame import Frame, ProtocolError


class Refused(Exception):
    """A request refused from its header whose payload is not read (too large to drain):
    its error is sent (unless `error` is None: it was already), then the connection is
    closed (listener.py)."""

    def __init__(self, frame: Frame, method: str, error: Exception | None) -> None:
        super().__init__(str(error))
        self.frame, self.method, self.error = frame, method, error


@dataclass(frozen=True)
class BulkLimits:
    max_connections: int = 64
    max_per_peer: int = 16
    idle_timeout_s: float = 60.0
    frame_timeout_s: float = 30.0
    min_bytes_per_s: float = 4 << 20
    handshake_timeout_s: float = 10.0
    max_inflight_bytes: int = 2 << 30

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_per_peer", "max_inflight_bytes"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"BulkLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("idle_timeout_s", "frame_timeout_s", "min_bytes_per_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"BulkLimits.{name} must be > 0, got {getattr(self, name)}")


class ByteBudget:
    """Bytes of client-sized receive buffers in use on the node, at most `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def take(self, num_bytes: int, what: str) -> None:
        """Count num_bytes in use, or CapacityExceeded (nothing counted)."""
        with self._lock:
            if self.used + num_bytes > self.limit:
                raise CapacityExceeded(
                    f"bulk {what}: {num_bytes} bytes to receive while {self.used} of the node's "
                    f"{self.limit}-byte receive budget are in use; retry",
                    num_bytes,
                    self.limit - self.used,
                )
            self.used += num_bytes

    def give(self, num_bytes: int) -> None:
        with self._lock:
            self.used -= num_bytes


def set_idle_timeout(sock: Any, seconds: float) -> None:
    """Bound every receive and send of `sock` by `seconds`. A plain socket gets it from the
    kernel (SO_RCVTIMEO / SO_SNDTIMEO on a blocking socket: a lapse raises OSError EAGAIN),
    not from Python's socket timeout, which polls before every recv and send: one syscall
    more per call of a small request. TLS keeps Python's timeout."""
    if isinstance(sock, ssl.SSLSocket):
        sock.settimeout(seconds)
        return
    sock.settimeout(None)
    whole = int(seconds)
    timeval = struct.pack("ll", whole, int((seconds - whole) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


class TimedConn:
    """A connection whose requests have deadlines. The socket's own timeout (the idle
    timeout, set once: no syscall per request) bounds a wait for bytes that do not
    come; a request's deadline starts with its first bytes (`arm` extends it by its
    payload) and is checked at every receive, which bounds a trickle. Everything but
    the receives and sendmsg is the socket's own."""

    __slots__ = ("_is_tls", "_limits", "deadline", "sock")

    def __init__(self, sock: Any, limits: BulkLimits, *, kernel_timeout: bool = False) -> None:
        self.sock = sock
        self._limits = limits
        self._is_tls = isinstance(sock, ssl.SSLSocket)
        self.deadline = 0.0  # 0: between requests
        if kernel_timeout:  # (not where a receive may take MSG_WAITALL: it would block past a deadline)
            set_idle_timeout(sock, limits.idle_timeout_s)
        else:
            sock.settimeout(limits.idle_timeout_s)

    def arm(self, payload_len: int = 0) -> None:
        """The request's header is here: its payload must follow in time."""
        lim = self._limits
        self.deadline = time.monotonic() + lim.frame_timeout_s + payload_len / lim.min_bytes_per_s

    def disarm(self) -> None:
        """The request was answered: the connection is idle again."""
        self.deadline = 0.0

    def _check(self) -> None:
        if time.monotonic() > self.deadline:
            raise ProtocolError("the request did not arrive within its deadline (frame timeout)")

    def recv_into(self, buf: Any, nbytes: int = 0, flags: int = 0) -> int:
        if self.deadline:
            self._check()
            return int(self.sock.recv_into(buf, nbytes, 0 if self._is_tls else flags))
        n = int(self.sock.recv_into(buf, nbytes, 0 if self._is_tls else flags))
        self.arm()  # a request's first bytes: its deadline starts now
        return n

    def recvmsg_into(self, buffers: Any, ancbufsize: int = 0, flags: int = 0) -> Any:
        if self.deadline:
            self._check()
            return self.sock.recvmsg_into(buffers, ancbufsize, flags)
        got = self.sock.recvmsg_into(buffers, ancbufsize, flags)
        self.arm()
        return got

    def sendmsg(self, buffers: Any, *args: Any) -> int:
        if not self._is_tls:
            return int(self.sock.sendmsg(buffers, *args))
        total = 0
        for b in buffers:  # (an SSL socket has no sendmsg)
            self.sock.sendall(b)
            total += len(b)
        return total

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class PeerCounter:
    """Open connections per peer (an IP address, or a local process id)."""

    def __init__(self) -> None:
        self._count: dict[object, int] = {}

    def admit(self, peer: object, limit: int) -> bool:
        n = self._count.get(peer, 0)
        if n >= limit:
            return False
        self._count[peer] = n + 1
        return True

    def release(self, peer: object) -> None:
        n = self._count.get(peer, 0) - 1
        if n > 0:
            self._count[peer] = n
        else:
            self._count.pop(peer, None)
