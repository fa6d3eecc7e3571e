"""Fake nodes' beats on the coordinators' framed ports, every link on one thread (bench.scale).

A node holds a connection of its own and waits for its own beat's reply, which the
coordinator may hold a few ms (a node's beats may wait, BEAT_WAIT_S). A thread pool making
those calls cost this host 0.27 of a core for 1,333 beats a second, more than the coordinator
spent on them, on the 2 cores the coordinator, Redis and the clients share. Here every link is
a non-blocking socket on one selector: a beat is sent when due and its reply read when it
comes, as many in flight as there are nodes.
"""

from __future__ import annotations

import itertools
import selectors
import socket

from pagedkv.cache_node.coordinator_link import BEAT_WAIT_S
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos.serving import raise_open_files_limit
from pagedkv.protos.wire import Status
from pagedkv.protos.wire import frame as wire_frame
from pagedkv.protos.wire.unary import encode_unary

READ_BYTES = 64 << 10


class BeatLinks:
    """A framed connection per node to its coordinator's port (node i to frame_ports[i % n],
    from 127.0.0.(2 + i // 100): the port takes at most 128 connections from one address),
    made at the node's first beat as a node makes it (1,000 made at once would meet the port's
    cap on connections not yet moved to its loop)."""

    def __init__(self, num_nodes: int, frame_ports: list[int]) -> None:
        raise_open_files_limit()  # (a descriptor per node)
        self._sel = selectors.DefaultSelector()
        self._ports = frame_ports
        self._socks: list[socket.socket | None] = [None] * num_nodes
        self._is_broken = [False] * num_nodes
        self._bufs = [bytearray() for _ in range(num_nodes)]
        self._ids = itertools.count(1)
        self._pending = [0] * num_nodes  # each link's beats sent, not answered
        self._lost: list[int] = []  # nodes whose link broke with beats unanswered, one per beat
        self.num_pending = 0

    def _connect(self, node: int) -> socket.socket:
        port = self._ports[node % len(self._ports)]
        sock = socket.create_connection(("127.0.0.1", port), 10, (f"127.0.0.{2 + node // 100}", 0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, node)
        self._socks[node] = sock
        return sock

    def send(self, node: int, request: pb.HeartbeatRequest) -> bool:
        """Send node `node`'s beat; False when its link is gone (the caller beats another way)."""
        if self._is_broken[node]:
            return False
        sock = self._socks[node]
        try:
            sock = sock or self._connect(node)
        except OSError:
            self._is_broken[node] = True
            return False
        message = request.SerializeToString()
        data = encode_unary(next(self._ids), "Heartbeat", b"", message, may_wait_s=BEAT_WAIT_S)
        try:
            if sock.send(data) == len(data):  # (a beat is ~100 bytes: it goes whole or not at all)
                self._pending[node] += 1
                self.num_pending += 1
                return True
        except OSError:
            pass
        self._drop(node)
        return False

    def poll(self, timeout_s: float) -> list[tuple[int, pb.HeartbeatResponse | None]]:
        """The replies that came within `timeout_s`: (node, its reply; None for an error reply
        or a beat its broken link lost)."""
        out: list[tuple[int, pb.HeartbeatResponse | None]] = [(node, None) for node in self._lost]
        self._lost = []
        for key, _ in self._sel.select(max(0.0, timeout_s)):
            node = key.data
            try:
                data = key.fileobj.recv(READ_BYTES)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._drop(node)
                continue
            buf = self._bufs[node]
            buf += data
            while (parsed := wire_frame.frame_at(buf)) is not None and len(buf) - parsed[1] >= parsed[
                0
            ].payload_len:
                head, at = parsed
                body = bytes(buf[at : at + head.payload_len])
                del buf[: at + head.payload_len]
                self._pending[node] -= 1
                self.num_pending -= 1
                ok = head.status == Status.OK
                out.append((node, pb.HeartbeatResponse.FromString(body) if ok else None))
        return out

    def _drop(self, node: int) -> None:
        sock = self._socks[node]
        if sock is not None:
            self._sel.unregister(sock)
            sock.close()
            self._socks[node] = None
            self._is_broken[node] = True
            self._lost += [node] * self._pending[node]
            self.num_pending -= self._pending[node]
            self._pending[node] = 0

    def close(self) -> None:
        for node in range(len(self._socks)):
            self._drop(node)
        self._sel.close()
