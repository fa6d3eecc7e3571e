"""The node's same-host path of the bulk channel: an abstract Unix socket listener
and the shared-memory regions its clients map (protocol: docs/bulk-protocol.md,
ops HELLO, MAP, ATTEND*_SHM).

A region is a client's sealed memfd, mapped shared for the life of its
connection. Everything read from it is treated as wire input: offsets and sizes
are checked against the mapping before a view is cut, and the client may
scribble on the bytes at any time without harming the node (a shrink, the one
thing that could fault the node, is sealed off before the node maps it).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import secrets
import socket
import sys

import torch

from ..protos import wire
from ..protos.errors import InvalidArgument


def local_listener(backlog: int) -> tuple[socket.socket, str] | None:
    """(listening socket, name) of a fresh abstract Unix socket, or None where
    there are none (not Linux). The name is random (128 bits): nothing to clean
    up when the node dies, and a client that reaches it reached this node."""
    if not sys.platform.startswith("linux"):
        return None
    name = f"pagedkv-bulk-{os.getpid()}-{secrets.token_hex(16)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind("\0" + name)
        sock.listen(backlog)
    except OSError:
        sock.close()
        return None
    return sock, name


class Region:
    """One client's mapped memfd. `view(offset, size, what)` returns a uint8
    tensor over [offset, offset + size) or raises InvalidArgument naming the
    range; `close()` unmaps (at once, or when the last view is dropped)."""

    def __init__(self, fd: int, size: int) -> None:
        """Maps fd (which the caller still owns and closes); InvalidArgument when
        it is not a memfd of `size` bytes sealed against shrinking."""
        if not wire.MIN_REGION_BYTES <= size <= wire.MAX_REGION_BYTES:
            raise InvalidArgument(
                f"bulk map: region of {size} bytes outside [{wire.MIN_REGION_BYTES}, {wire.MAX_REGION_BYTES}]"
            )
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            actual = os.fstat(fd).st_size
        except OSError as exc:
            raise InvalidArgument(f"bulk map: the descriptor is not a sealable memfd ({exc})") from None
        if not seals & fcntl.F_SEAL_SHRINK:
            raise InvalidArgument("bulk map: the memfd must be sealed against shrinking (F_SEAL_SHRINK)")
        if actual != size:
            raise InvalidArgument(f"bulk map: the memfd has {actual} bytes, the frame says {size}")
        try:
            self._map: mmap.mmap | None = mmap.mmap(
                fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except OSError as exc:
            raise InvalidArgument(f"bulk map: cannot map the memfd ({exc})") from None
        self.size = size
        self._bytes: torch.Tensor | None = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, offset: int, size: int, what: str) -> torch.Tensor:
        if self._bytes is None:
            raise InvalidArgument("bulk: no region mapped on this connection (MAP first)")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise InvalidArgument(
                f"bulk shm: {what} [{offset}, {offset + size}) outside the {self.size}-byte region"
            )
        return self._bytes[offset : offset + size]

    def memory(self, offset: int, size: int, what: str) -> memoryview:
        """region[offset, offset + size) as a writable memoryview, checked as `view`
        is (numpy and torch views of it cost a fraction of a torch slice's)."""
        if self._map is None:
            raise InvalidArgument("bulk: no region mapped on this connection (MAP first)")
        if offset < 0 or size < 0 or offset + size > self.size:
            raise InvalidArgument(
                f"bulk shm: {what} [{offset}, {offset + size}) outside the {self.size}-byte region"
            )
        return memoryview(self._map)[offset : offset + size]

    def close(self) -> None:
        """Unmap. A view still alive (an engine error's traceback, say) keeps the
        mapping until it is dropped; then the mmap's own finalizer unmaps it."""
        self._bytes, m = None, self._map
        self._map = None
        if m is not None:
            with contextlib.suppress(BufferError):
                m.close()


def map_region(frame: wire.Frame, fds: list[int]) -> Region:
    """The region a MAP frame sends (InvalidArgument when its descriptor is missing
    or unusable). The descriptors are the caller's to close."""
    if len(fds) != 1:
        raise InvalidArgument(f"bulk map: {len(fds)} file descriptors sent with MAP (expected 1)")
    return Region(fds[0], frame.end)


def write_results(region: Region, offset: int, capacity: int, parts: list[torch.Tensor]) -> bool:
    """Copy the results into region[offset, offset + capacity), each ALIGN-aligned
    from offset (a result already in its place is not copied); False (nothing
    written) when they do not fit."""
    at, spans = 0, []
    for t in parts:
        at += wire.pad(at)
        nbytes = t.numel() * t.element_size()
        spans.append((at, nbytes))
        at += nbytes
    if at > capacity:
        return False
    area = region.view(offset, capacity, "the results")
    for t, (a, nbytes) in zip(parts, spans, strict=True):
        dst = area[a : a + nbytes]
        if nbytes and t.data_ptr() != dst.data_ptr():  # (the engine may have written it in place)
            # one memcpy on this thread (torch's copy_ would wake its intra-op threads)
            dst.numpy()[:] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return True
