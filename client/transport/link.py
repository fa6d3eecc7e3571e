"""One node's bulk listener as this client sees it, shared by the socket transports
(tcp, unix, shm): where it is (the port, learned from the node's Stats; the
capabilities, from its HELLO), the pooled connections of each kind, and the
counters tests and benchmarks read. The redis-py shape: the pool and the protocol
are written once, each transport only says how its connection opens.

Connections are pooled per kind, one request at a time on each, so concurrent calls
from several threads each get their own. `start` sends a request and leaves its reply
on the connection for later (an Exchange), so one thread can have calls out on several
nodes at once. Each remembers the credentials it
presented (AUTH): a sequence's ticket goes once per connection, before its first
call there (`authorize`). TCP connections use TLS when the client config has it.
After a failed TCP connect the node's listener is left alone for RETRY_AFTER_S (gRPC
carries the calls), then learned again: a firewalled port costs one short connect
timeout per interval, and a restarted node's new port is found.
"""

from __future__ import annotations

import itertools
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ...protos import wire
from ...protos.errors import PagedKVError, Unavailable
from ...protos.tls import TlsConfig
from .. import shm
from .base import TransportUnavailable
from .tickets import Wallet

MAX_POOLED = 4  # idle connections kept per kind
MAX_PRESENTED = 2048  # tickets remembered per connection (the node keeps twice that many)
CONNECT_TIMEOUT_S = 2.0
RETRY_AFTER_S = 30.0


class Connection(Protocol):
    sock: socket.socket
    presented: set[bytes]
    has_token: bool

    def close(self) -> None: ...


class TcpConnection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.presented: set[bytes] = set()  # tickets this connection carried to the node
        self.has_token = False

    def close(self) -> None:
        self.sock.close()


class Abandoned(Exception):
    """Raised inside a body that refuses a reply whose bytes are still arriving (a read
    into an `out` of another shape): the connection is closed, then `error` raised."""

    def __init__(self, error: PagedKVError) -> None:
        super().__init__(str(error))
        self.error = error


class BulkLink:
    """The bulk listener of the node at `address` (its gRPC host:port). `learn_port`
    asks the node for its bulk port (its Stats over gRPC; 0: off)."""

    def __init__(
        self,
        address: str,
        where: str,
        min_bytes: int,
        learn_port: Callable[[float], tuple[int, int]],
        wallet: Wallet | None = None,
        tls: TlsConfig | None = None,
    ) -> None:
        self.host = wire.address_host(address)
        self.where = where
        self.wallet = wallet or Wallet()
        self._tls = tls
        self._tls_context: ssl.SSLContext | None = None
        self.min_bytes = min_bytes  # KV transfers below this take gRPC
        self._learn_port = learn_port
        self.port: int | None = None  # None: not learned yet; 0: the node has it off
        self.bytes_per_token = 0
        self.caps: wire.Capabilities | None = None  # the node's HELLO reply (None: not asked yet)
        # The node's same-host listener: None = not asked yet, "" = none or unusable here.
        self.local_name: str | None = None
        self._idle: dict[str, list[Any]] = {"tcp": [], "unix": []}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._retry_at = 0.0  # time.monotonic() before which the listener is not tried
        self._local = threading.local()  # reused header buffers, one set per calling thread
        self.ids_memo = wire.IdsMemo()  # the last batch's encoded sequence ids
        self.read_slot_bytes = 0  # a READ_SHM slot the node asked for (a token over shm.READ_SLOT_BYTES)
        self.num_calls = 0  # attend calls answered over the listener (OK or a node error)
        self.num_local_calls = 0  # of which through the shared region
        self.num_local_transfers = 0  # append / read_kv over the same-host Unix socket
        self.num_shm_reads = 0  # read_kv through the shared region (counted in num_local_transfers too)
        self.num_opens = 0  # opens answered over the listener (OK or a node error)
        self.num_auth = 0  # AUTH round trips (credentials presented on a connection)
        self.num_refused = 0  # error replies the node sent over the listener

    def next_id(self) -> int:
        return next(self._ids)

    @property
    def is_backing_off(self) -> bool:
        return time.monotonic() < self._retry_at

    def num_idle(self, kind: str) -> int:
        return len(self._idle[kind])

    # -- where the listener is ----------------------------------------------------

    def ensure_port(self, timeout_s: float) -> int:
        """The node's bulk port, learned once; TransportUnavailable when it is off,
        backing off after a failed connect, or cannot be learned (gRPC says why)."""
        if self.is_backing_off:
            raise TransportUnavailable("the node's bulk listener failed a connect lately")
        if self.port is None:
            try:
                self.port, self.bytes_per_token = self._learn_port(timeout_s)
            except PagedKVError as exc:
                raise TransportUnavailable(f"the node's bulk port is not known: {exc}") from exc
        if not self.port:
            raise TransportUnavailable("the node's bulk port is off")
        return self.port

    def wants(self, num_bytes: int | None) -> None:
        """TransportUnavailable for a KV transfer under min_bytes (None: unknown size)."""
        if num_bytes is not None and num_bytes < self.min_bytes:
            raise TransportUnavailable(f"a {num_bytes}-byte transfer is under {self.min_bytes}: gRPC")

    def capabilities(self, timeout_s: float) -> wire.Capabilities:
        """What the node's listener serves (its HELLO reply, asked once per learned port);
        no ops at all when it cannot be asked now (gRPC carries everything)."""
        if self.caps is None:
            try:
                self.caps = self.run("tcp", timeout_s, lambda c: wire.hello(c.sock, self.next_id()))
            except PagedKVError:
                return wire.Capabilities()  # asked again with the next call
        assert self.caps is not None
        return self.caps

    def require(self, op: int, timeout_s: float) -> None:
        if not self.capabilities(timeout_s).serves(op):
            raise TransportUnavailable(f"the node's bulk listener serves no {wire.OP_NAMES[op]}")

    def same_host_name(self, timeout_s: float) -> str:
        """The node's same-host listener; TransportUnavailable when there is none or it
        cannot be reached from this process."""
        if self.local_name is None:
            self.local_name = self.capabilities(timeout_s).local_name
        if not self.local_name:
            raise TransportUnavailable("the node has no same-host listener reachable from here")
        return self.local_name

    # -- connections ----------------------------------------------------------------

    def take(self, kind: str, timeout_s: float) -> Any:
        """A pooled or new connection of this kind ("tcp", "unix": a shm.LocalConnection);
        TransportUnavailable (nothing sent) when none can be opened."""
        with self._lock:
            idle = self._idle[kind]
            while idle:
                conn = idle.pop()
                if wire.is_alive(conn.sock):
                    _set_timeout(conn.sock, timeout_s)
                    return conn
                conn.close()
        return self._open_tcp(timeout_s) if kind == "tcp" else self._open_unix(timeout_s)

    def give(self, kind: str, conn: Any) -> None:
        with self._lock:
            if len(self._idle[kind]) < MAX_POOLED:
                self._idle[kind].append(conn)
                return
        conn.close()

    def _open_tcp(self, timeout_s: float) -> TcpConnection:
        where = (self.host, self.ensure_port(timeout_s))
        try:
            sock = socket.create_connection(where, timeout=min(timeout_s, CONNECT_TIMEOUT_S))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._wrap(sock)
        except (OSError, ValueError) as exc:  # (ssl.SSLError is an OSError)
            self._retry_at, self.port = time.monotonic() + RETRY_AFTER_S, None  # re-learn it later
            self.local_name, self.caps = None, None
            raise TransportUnavailable(f"cannot connect to {where[0]}:{where[1]}: {exc}") from exc
        sock.settimeout(timeout_s)
        return TcpConnection(sock)

    def _wrap(self, sock: socket.socket) -> socket.socket:
        """sock over TLS (handshake done, bounded by the connect timeout)."""
        assert self._tls is not None
        if self._tls_context is None:
            self._tls_context = self._tls.client_context()
        try:
            return self._tls_context.wrap_socket(sock, server_hostname=self._tls.server_name or self.host)
        except BaseException:
            sock.close()
            raise

    def authorize(self, conn: Any, node_seq_ids: Sequence[str], timeout_s: float) -> None:
        """Present on `conn` the wallet's tickets for these sequences (and its token)
        that it has not carried yet: one AUTH round trip, none when it has. The node's
        refusal raises its error (the connection stays in sync)."""
        wallet = self.wallet
        if wallet.is_empty:
            return
        presented = conn.presented
        fresh = [t for t in wallet.tickets(node_seq_ids) if t not in presented]
        token = "" if conn.has_token else wallet.token
        if not fresh and not token:
            return
        if not self.capabilities(timeout_s).serves(wire.OP_AUTH):
            raise TransportUnavailable("the node's bulk listener takes no credentials (AUTH)")
        conn.sock.sendall(wire.encode_auth(self.next_id(), fresh, token))
        reply = wire.read_reply(conn.sock, self.head_buffer())
        self.num_auth += 1
        if reply.status != wire.Status.OK:
            raise self.error(reply.status, reply.text, reply.extra)
        if len(presented) + len(fresh) > MAX_PRESENTED:
            presented.clear()
        presented.update(fresh)
        conn.has_token = conn.has_token or bool(token)

    def _open_unix(self, timeout_s: float) -> shm.LocalConnection:
        name = self.same_host_name(timeout_s)
        try:
            conn = shm.LocalConnection(name, min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as exc:  # another host or network namespace, or the node went away
            self.local_name = ""
            raise TransportUnavailable(f"cannot reach the node's same-host listener: {exc}") from exc
        try:  # a node at its connection cap closes a new one at once: find out (HELLO, not counted)
            wire.hello(conn.sock, self.next_id())
        except (OSError, PagedKVError) as exc:
            conn.close()
            raise TransportUnavailable(f"the node's same-host listener refused a connection: {exc}") from exc
        conn.sock.settimeout(timeout_s)
        return conn

    def close(self) -> None:
        with self._lock:
            idle = [c for conns in self._idle.values() for c in conns]
            self._idle = {kind: [] for kind in self._idle}
        for conn in idle:
            conn.close()

    def run(self, kind: str, timeout_s: float, body: Callable[[Any], Any], conn: Any = None) -> Any:
        """body(conn) on a taken connection of this kind (or on `conn`, already taken):
        given back after a reply (an error reply included: the connection is in sync),
        closed when the transfer broke (Unavailable naming the node) or on anything else."""
        if conn is None:
            conn = self.take(kind, timeout_s)
        result = self._guarded(kind, conn, body)
        self.give(kind, conn)
        return result

    def start(
        self,
        kind: str,
        timeout_s: float,
        send: Callable[[Any], Any],
        receive: Callable[[Any, Any], Any],
        conn: Any = None,
    ) -> Exchange:
        """`run` in two halves: send(conn) now, receive(conn, what send returned) when the
        Exchange's result is asked, so that one thread can have requests out on several
        nodes at once. Errors are handled as `run` handles them, in either half."""
        if conn is None:
            conn = self.take(kind, timeout_s)
        sent = self._guarded(kind, conn, send)
        return Exchange(self, kind, conn, receive, sent)

    def _guarded(self, kind: str, conn: Any, body: Callable[..., Any], *args: Any) -> Any:
        """body(conn, *args), conn kept on success; on a node's error reply given back (it is in
        sync), else closed (a broken transfer raises Unavailable naming the node)."""
        try:
            return body(conn, *args)
        except Abandoned as exc:
            conn.close()
            raise exc.error from None
        except TransportUnavailable:  # (a region refused: nothing of the call sent)
            conn.close()
            raise
        except (OSError, wire.ProtocolError) as exc:
            conn.close()
            what = "timed out (DEADLINE_EXCEEDED)" if isinstance(exc, TimeoutError) else "failed"
            path = "bulk transfer" if kind == "tcp" else "bulk transfer (same host)"
            raise Unavailable(f"{self.where}: {path} {what}: {exc}") from exc
        except PagedKVError:
            self.give(kind, conn)
            raise
        except BaseException:
            conn.close()
            raise

    def error(self, status: int, text: str, extra: str) -> PagedKVError:
        self.num_refused += 1
        return wire.error_of(status, text, extra, self.where)

    def head_buffer(self) -> bytearray:
        """This thread's buffer for a bare reply FRAME."""
        buf: bytearray | None = getattr(self._local, "head", None)
        if buf is None:
            buf = self._local.head = bytearray(wire.FRAME.size)
        return buf

    def reply_buffer(self) -> bytearray:
        """This thread's buffer for an attend reply's FRAME and REPLY (one recv)."""
        buf: bytearray | None = getattr(self._local, "reply", None)
        if buf is None:
            buf = self._local.reply = bytearray(wire.FRAME.size + wire.REPLY_SIZE)
        return buf


class Exchange:
    """A request out on a taken connection, its reply not read yet (BulkLink.start).
    `result()` reads it, once, and gives the connection back (or closes it); every
    started exchange must be asked for its result, or its connection is never reused."""

    __slots__ = ("_link", "_kind", "_conn", "_receive", "_sent")

    def __init__(self, link: BulkLink, kind: str, conn: Any, receive: Callable[[Any, Any], Any], sent: Any):
        self._link: BulkLink | None = link
        self._kind, self._conn, self._receive, self._sent = kind, conn, receive, sent

    def result(self) -> Any:
        link, self._link = self._link, None
        if link is None:
            raise RuntimeError("an exchange's reply is read once")
        sent, self._sent = self._sent, None
        result = link._guarded(self._kind, self._conn, self._receive, sent)
        link.give(self._kind, self._conn)
        return result


def _set_timeout(sock: socket.socket, timeout_s: float) -> None:
    """settimeout, skipped when it already has this one (each call is an fcntl)."""
    if sock.gettimeout() != timeout_s:
        sock.settimeout(timeout_s)
