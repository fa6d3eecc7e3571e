"""ReadAhead: a connection's receives through one buffer, so that a peer streaming small
requests (a node's one-way event reports) costs a server one recv for many of them
instead of three (header, text, payload) for each.

A receive with nothing buffered takes whatever has arrived, up to the buffer's size; the
reads that follow are served from it. A read at least the buffer's size with nothing
buffered (a large payload) goes straight into its own buffer. The wrapped connection's
deadlines and timeouts (limits.TimedConn) bound every receive it still makes.
"""

from __future__ import annotations

from typing import Any

READ_AHEAD_BYTES = 16 << 10  # per connection: ~100 one-event reports


class ReadAhead:
    """`conn`'s recv_into through a `size`-byte buffer; everything else is conn's own."""

    __slots__ = ("_end", "_start", "_view", "conn")

    def __init__(self, conn: Any, size: int = READ_AHEAD_BYTES) -> None:
        self.conn = conn
        self._view = memoryview(bytearray(size))
        self._start = self._end = 0  # the buffered bytes: _view[_start:_end]

    @property
    def num_buffered(self) -> int:
        """Bytes received and not yet read (the next request's first bytes, if any)."""
        return self._end - self._start

    def take(self, n: int) -> memoryview | None:
        """The next `n` bytes, read, when all of them are buffered (else None, nothing
        read): a view of the buffer, valid until the next receive."""
        start = self._start
        if self._end - start < n:
            return None
        self._start = start + n
        return self._view[start : start + n]

    def recv_into(self, buf: Any, nbytes: int = 0, flags: int = 0) -> int:
        """As socket.recv_into (0: the peer closed); `flags` only reach a direct receive."""
        want = nbytes or len(buf)
        have = self._end - self._start
        if not have:
            if want >= len(self._view):
                return int(self.conn.recv_into(buf, nbytes, flags))
            have = int(self.conn.recv_into(self._view))
            if not have:
                return 0
            self._start, self._end = 0, have
        n = min(want, have)
        buf[:n] = self._view[self._start : self._start + n]
        self._start += n
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)
