"""A gRPC servicer's unary methods served over the framing (wire/unary.py), beside its
gRPC port: the same handler runs, with the same checks and errors, without HTTP/2, the
server's poll loop and its hand-off to a handler pool (most of a small control rpc's
cost in gRPC-Python). Role-neutral: it knows a service by its descriptor only.

One thread accepts, one thread serves each connection (its requests one at a time,
as the node's bulk listener, read ahead: one recv takes the requests that wait); TLS
when given, the bulk listener's limits (connections per listener and per peer, idle and
per-request deadlines, a budget for receive buffers). A handler sees a context with the
call's metadata; its abort() becomes the error reply (status, details, the error class
its trailing metadata names).

One-way calls (NOTIFY) of the methods listed as such: the handler runs and nothing is
sent back (a node's event reports, acknowledged by its next beat: a reply would cost the
server a send and the client a wait per report). Its error is counted and logged, at
most once per LOG_EVERY_S. A NOTIFY the server cannot take (another method, a request
that does not parse, one over the cap) gets its error reply and the connection closed:
the client, which reads no reply, would otherwise take that error for its next call's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from .errors import InvalidArgument
from .framed_loop import MAX_LINKS, FramedLoop, is_pliable
from .serving import Offload, name_os_thread
from .status import ERROR_CLASS_KEY, ERROR_IDS_KEY
from .tls import TlsConfig
from .wire import Frame, ProtocolError, Status, error_frame, read_frame, recv_exact
from .wire import frame as wire_frame
from .wire.limits import BulkLimits, ByteBudget, PeerCounter, Refused, TimedConn
from .wire.read_ahead import ReadAhead
from .wire.unary import decode_metadata

logger = logging.getLogger("pagedkv.framed")
MAX_MESSAGE_BYTES = 4 << 20  # gRPC-Python's default receive limit: the same requests fit
DEFAULT_LIMITS = BulkLimits(max_connections=512, max_per_peer=128, max_inflight_bytes=256 << 20)
ACCEPT_RETRY_S = 0.1  # after accept failed for want of descriptors or memory
LOG_EVERY_S = 10.0  # a one-way call's failure is logged at most this often (all are counted)


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class FrameContext:
    """What a handler asks of its grpc.ServicerContext, for a framed call."""

    __slots__ = ("_metadata", "trailing")

    def __init__(self, metadata: list[tuple[str, str | bytes]]) -> None:
        self._metadata = metadata
        self.trailing: tuple[tuple[str, str], ...] = ()

    def invocation_metadata(self) -> list[tuple[str, str | bytes]]:
        return self._metadata

    def set_trailing_metadata(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.trailing = metadata

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


class _Conn:
    __slots__ = ("is_adopted", "peer", "sock", "thread")

    def __init__(self, sock: socket.socket, peer: object) -> None:
        self.sock, self.peer = sock, peer
        self.thread: threading.Thread | None = None
        self.is_adopted = False  # served by the loop, not a thread of its own


Handler = tuple[Callable[[Any, FrameContext], Any], Callable[[bytes | memoryview], Any]]
# Several calls of one method -> a function per call that answers it as its handler would.
BatchHandler = Callable[[list[tuple[Any, FrameContext]]], list[Callable[[], Any]]]


class FramedServer:
    """`methods` of `servicer` (a gRPC servicer of `service`, whose messages are in
    `messages`) on a TCP port of `host`, bound by the constructor (`port` is known
    before start; 0: any free port); those of them in `one_way` are also taken as
    NOTIFY frames (by their handler, or by the one a `one_way` mapping gives them, which
    returns nothing). A plain-TCP connection that served one of `loop_methods` moves to one
    thread serving every such connection (framed_loop.py)."""

    def __init__(
        self,
        servicer: Any,
        service: ServiceDescriptor,
        messages: ModuleType,
        methods: Iterable[str],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        tls: TlsConfig | None = None,
        limits: BulkLimits | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        one_way: Iterable[str] | Mapping[str, Callable[[Any, FrameContext], None]] = (),
        loop_methods: Iterable[str] = (),
        batches: Mapping[str, BatchHandler] | None = None,
    ) -> None:
        self.handlers: dict[str, Handler] = {}
        for name in methods:
            method = service.methods_by_name[name]
            if method.client_streaming or method.server_streaming:
                raise ValueError(f"{service.name}.{name} is not unary")
            self.handlers[name] = (
                getattr(servicer, name),
                getattr(messages, method.input_type.name).FromString,
            )
        self.one_way = frozenset(one_way)
        if not self.one_way <= self.handlers.keys():
            raise ValueError(f"one-way methods {sorted(self.one_way - self.handlers.keys())} are not served")
        # A NOTIFY runs its method's handler, or the one `one_way` maps it to: nothing to reply,
        # so nothing to build (a node's lone event report, where every microsecond is per event).
        self._one_way_handlers: dict[str, Callable[[Any, FrameContext], Any]] = (
            dict(one_way) if isinstance(one_way, Mapping) else {}
        )
        for name in self.one_way - self._one_way_handlers.keys():
            self._one_way_handlers[name] = self.handlers[name][0]
        # A plain-TCP connection that has served one of these is handed to the one-thread loop.
        self.loop_methods = frozenset(loop_methods)
        if not self.loop_methods <= self.handlers.keys():
            unknown = sorted(self.loop_methods - self.handlers.keys())
            raise ValueError(f"loop methods {unknown} are not served")
        # The loop answers a turn's calls of these methods together (answer_batch).
        self.batches = dict(batches or {})
        if not self.batches.keys() <= self.loop_methods:
            raise ValueError(
                f"batched methods {sorted(self.batches.keys() - self.loop_methods)} are not loop methods"
            )
        self.limits = limits or DEFAULT_LIMITS
        self.max_message_bytes = max_message_bytes
        self.budget = ByteBudget(self.limits.max_inflight_bytes)  # its threads' and its loop's
        self._tls = None if tls is None else tls.server_context()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=self.limits.max_connections)
        self.port: int = self._sock.getsockname()[1]
        self._conns: dict[int, _Conn] = {}
        self._peers = PeerCounter()
        self._lock = threading.Lock()
        self._accepter: threading.Thread | None = None
        self._loop: FramedLoop | None = None
        self._num_adopted = 0  # connections in _conns served by the loop
        if self.loop_methods and self._tls is None:
            self._loop = FramedLoop(self, self._release)
        self._is_stopping = False
        self.num_calls = 0  # calls answered (an error reply included)
        self.num_one_way = 0  # one-way calls whose handler ran
        self.num_one_way_failed = 0  # of those, the ones whose handler failed (nothing sent back)
        self._logged_at = -LOG_EVERY_S

    def start(self) -> FramedServer:
        if self._loop is not None:
            self._loop.start()
        self._accepter = threading.Thread(target=self._accept_loop, name="frame-accept", daemon=True)
        self._accepter.start()
        return self

    def stop(self) -> None:
        """Close the port and every connection (a call in flight fails on its client as
        Unavailable; one already in its handler finishes first), joining their threads."""
        with self._lock:
            self._is_stopping = True
            conns = list(self._conns.values())
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        self._sock.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RDWR)
        for c in conns:
            if c.thread is not None:
                c.thread.join(5)
        if self._loop is not None:
            self._loop.stop()
        if self._accepter is not None:
            self._accepter.join(5)

    def _release(self, served: object) -> None:
        """A connection ended (its thread's, or the loop's): its slot and its peer's."""
        assert isinstance(served, _Conn)
        with self._lock:
            if self._conns.pop(id(served), None) is not None:
                self._peers.release(served.peer)
                self._num_adopted -= served.is_adopted

    def _accept_loop(self) -> None:
        name_os_thread()
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return  # closed
                logger.warning("framed port: cannot accept (%s); trying again in %s s", exc, ACCEPT_RETRY_S)
                time.sleep(ACCEPT_RETRY_S)  # out of descriptors: the connection waits in the backlog
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if (
                    self._is_stopping
                    or len(self._conns) - self._num_adopted >= self.limits.max_connections  # threads
                    or not self._peers.admit(addr[0], self.limits.max_per_peer)
                ):
                    sock.close()  # the client takes gRPC
                    continue
                conn = _Conn(sock, addr[0])
                conn.thread = threading.Thread(
                    target=self._serve, args=(conn,), name="frame-conn", daemon=True
                )
                self._conns[id(conn)] = conn
            conn.thread.start()

    def _serve(self, served: _Conn) -> None:
        name_os_thread()
        sock: Any = served.sock
        is_adopted = False
        try:
            if self._tls is not None:
                sock.settimeout(self.limits.handshake_timeout_s)
                sock = self._tls.wrap_socket(sock, server_side=True)
                with self._lock:
                    served.sock = sock
            conn = TimedConn(sock, self.limits, kernel_timeout=True)
            reader = ReadAhead(conn)
            head = bytearray(wire_frame.FRAME.size)
            while (frame := read_frame(reader, eof_ok=True, buf=head)) is not None:  # type: ignore[arg-type]
                conn.arm(frame.payload_len)
                served_ok = False  # a node's call that succeeded: its link may move to the loop
                if frame.op == wire_frame.OP_NOTIFY:
                    served_ok = self._notify(reader, frame)
                elif frame.op == wire_frame.OP_UNARY:
                    reply = self._call(reader, frame)
                    conn.sendall(reply)
                    served_ok = wire_frame.FRAME.unpack_from(reply)[4] == Status.OK
                elif frame.op == wire_frame.OP_PING and not frame.payload_len:
                    conn.sendall(Frame(frame.op, frame.request_id).pack())
                else:
                    msg = f"framed port: op {frame.op} is not served here (UNARY, NOTIFY and PING are)"
                    conn.sendall(error_frame(frame.op, frame.request_id, InvalidArgument(msg))[0].pack())
                    return  # its payload's framing is unknown: close
                conn.disarm()
                if (
                    served_ok
                    and self._loop is not None
                    and frame.text in self.loop_methods
                    and self._adopting(served)
                ):
                    buffered = bytes(reader.take(reader.num_buffered) or b"")
                    self._loop.adopt(served, sock, buffered, is_pliable(frame))
                    is_adopted = True
                    return
                if reader.num_buffered:  # the next request's first bytes are here: its deadline runs
                    conn.arm()
        except Refused as exc:
            assert exc.error is not None  # (this server always says why)
            with contextlib.suppress(OSError):
                sock.sendall(error_frame(exc.frame.op, exc.frame.request_id, exc.error)[0].pack())
        except (OSError, ValueError, ProtocolError) as exc:  # a reset, a handshake, stop(), bad framing
            logger.info("framed connection dropped: %s", exc)
        except Exception:  # a bug: drop this connection, keep serving the others
            logger.exception("framed connection failed")
        finally:
            if not is_adopted:
                sock.close()
                self._release(served)

    def _adopting(self, served: _Conn) -> bool:
        """Whether a node's link leaves its thread for the loop (which holds at most
        MAX_LINKS): its slot then no longer counts against max_connections (threads)."""
        assert self._loop is not None
        with self._lock:
            if self._num_adopted >= MAX_LINKS:
                return False
            served.is_adopted = True
            self._num_adopted += 1
        return True

    def check_request(self, f: Frame) -> None:
        """Refused (the client's mistake: answered, the connection closed) when a request's
        header says it cannot be served: too large, its metadata past its end, a NOTIFY of a
        method not taken one-way, an op this port does not serve."""
        if f.op not in (wire_frame.OP_UNARY, wire_frame.OP_NOTIFY, wire_frame.OP_PING) or (
            f.op == wire_frame.OP_PING and f.payload_len
        ):
            msg = f"framed port: op {f.op} is not served here (UNARY, NOTIFY and PING are)"
            raise Refused(f, f.text, InvalidArgument(msg))
        if f.payload_len > self.max_message_bytes:
            error = InvalidArgument(
                f"framed {f.text[:64]}: a {f.payload_len}-byte request (at most {self.max_message_bytes})"
            )
            raise Refused(f, f.text, error)
        if f.start > f.payload_len:
            error = InvalidArgument(
                f"framed {f.text[:64]}: {f.start} bytes of metadata in a {f.payload_len}-byte request"
            )
            raise Refused(f, f.text, error)
        if f.op == wire_frame.OP_NOTIFY and f.text not in self.one_way:
            taken = ", ".join(sorted(self.one_way)) or "none"
            error = InvalidArgument(f"framed port: {f.text[:64]!r} is not taken one-way (these are: {taken})")
            raise Refused(f, f.text, error)

    def _read_payload(self, reader: ReadAhead, f: Frame) -> memoryview:
        """A request's payload, checked from its header first (Refused: not read); valid
        until the next read (it may be the read-ahead buffer's own bytes)."""
        self.check_request(f)
        buffered = reader.take(f.payload_len)
        if buffered is not None:  # (already in the connection's buffer: nothing to allocate)
            return buffered
        try:
            self.budget.take(f.payload_len, "call")
        except Exception as exc:
            raise Refused(f, f.text, exc) from None
        try:
            payload = bytearray(f.payload_len)
            recv_exact(reader, memoryview(payload), "a unary request")  # type: ignore[arg-type]
        finally:
            self.budget.give(f.payload_len)
        return memoryview(payload)

    def _parse(self, f: Frame, payload: memoryview | bytes) -> tuple[Any, FrameContext]:
        """The request message of `payload` and its call's context; InvalidArgument when
        either does not parse."""
        try:
            request = self.handlers[f.text][1](payload[f.start :])
            return request, FrameContext(decode_metadata(payload[: f.start]))
        except (DecodeError, InvalidArgument) as exc:
            raise InvalidArgument(f"framed {f.text}: the request does not parse: {exc}") from None

    def _notify(self, reader: ReadAhead, f: Frame) -> bool:
        """Read one NOTIFY request, run its handler, send nothing (Refused: the client's
        mistake, answered and the connection closed); whether its handler succeeded."""
        return self.run_one_way(f, self._read_payload(reader, f))

    def run_one_way(self, f: Frame, payload: memoryview | bytes) -> bool:
        """A checked NOTIFY's handler on its payload (Refused when it does not parse);
        whether the handler succeeded (its failure is counted and logged, not answered)."""
        try:
            request, context = self._parse(f, payload)
        except InvalidArgument as exc:
            raise Refused(f, f.text, exc) from None
        self.num_one_way += 1
        try:
            self._one_way_handlers[f.text](request, context)
        except _Aborted as exc:
            self.num_one_way_failed += 1
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                logger.warning(
                    "one-way %s failed (%d so far): %s: %s",
                    f.text,
                    self.num_one_way_failed,
                    exc.code.name,
                    exc,
                )
            return False
        return True

    def _call(self, reader: ReadAhead, f: Frame) -> bytes:
        """Read one UNARY request's payload, run its handler; the reply's bytes."""
        return self.answer(f, self._read_payload(reader, f))

    def answer(self, f: Frame, payload: memoryview | bytes) -> bytes:
        """A checked UNARY request's reply (an error reply when it fails)."""
        self.num_calls += 1
        handler = self.handlers.get(f.text)
        if handler is None:
            known = ", ".join(sorted(self.handlers))
            error = InvalidArgument(
                f"framed port: no method {f.text[:64]!r} (it serves {known}; gRPC serves all)"
            )
            return error_frame(f.op, f.request_id, error)[0].pack()
        try:
            request, context = self._parse(f, payload)
        except InvalidArgument as exc:
            return error_frame(f.op, f.request_id, exc)[0].pack()
        return _reply(f, context, lambda: handler[0](request, context))

    def answer_batch(self, calls: list[tuple[Frame, bytes | memoryview]]) -> list[bytes | None]:
        """The replies of checked UNARY requests of one method in `batches`, in order: answered
        together by its batch handler (a request that does not parse gets its error reply);
        None for one its handler hands back (Offload: to be answered from another thread)."""
        self.num_calls += len(calls)
        replies: list[bytes | None] = [b""] * len(calls)
        parsed: list[tuple[int, Any, FrameContext]] = []
        for i, (f, payload) in enumerate(calls):
            try:
                parsed.append((i, *self._parse(f, payload)))
            except InvalidArgument as exc:
                replies[i] = error_frame(f.op, f.request_id, exc)[0].pack()
        if parsed:
            answers = self.batches[calls[parsed[0][0]][0].text]([(r, c) for _, r, c in parsed])
            for (i, _, context), answer in zip(parsed, answers, strict=True):
                try:
                    replies[i] = _reply(calls[i][0], context, answer)
                except Offload:
                    replies[i] = None
                    self.num_calls -= 1  # (counted by answer() on the thread that answers it)
        return replies


def _reply(f: Frame, context: FrameContext, run: Callable[[], Any]) -> bytes:
    """The reply frame of request `f` whose handler `run` answers (its abort: an error reply)."""
    try:
        reply = run().SerializeToString()
    except _Aborted as exc:
        extra = dict(context.trailing)
        cls, ids = extra.get(ERROR_CLASS_KEY, ""), extra.get(ERROR_IDS_KEY, "")
        head = Frame(
            f.op,
            f.request_id,
            status=Status[exc.code.name],
            text=exc.details,
            extra=f"{cls} {ids}" if ids else cls,
        )
        return head.pack()
    return Frame(f.op, f.request_id, payload_len=len(reply)).pack() + reply
