"""The bulk channel's framing: constants, the FRAME header, and the socket reads
and writes every op shares (spec: docs/bulk-protocol.md).

Both ends import this module; nothing here knows which side it runs on.
"""

from __future__ import annotations

import array
import enum
import functools
import select
import socket
import ssl
import struct
from typing import NamedTuple

from ..errors import PagedKVError
from ..status import error_from_status, error_ids, status_for

MAGIC = b"PKVB"
VERSION = 1
OP_APPEND = 1
OP_READ = 2
OP_ATTEND = 3
OP_ATTEND_PREFILL_BATCH = 4
OP_PING = 5
OP_HELLO = 6
OP_MAP = 7
OP_ATTEND_SHM = 8
OP_ATTEND_PREFILL_BATCH_SHM = 9
OP_READ_SHM = 10
OP_OPEN = 11
OP_AUTH = 12
OP_UNARY = 13  # a unary rpc of a gRPC service, carried by a framed control port (unary.py)
OP_NOTIFY = 14  # a UNARY request whose reply is not sent (a one-way rpc: unary.py)
OP_NAMES = {op: name[3:] for name, op in list(globals().items()) if name.startswith("OP_")}
SHM_OPS = {OP_ATTEND_SHM: OP_ATTEND, OP_ATTEND_PREFILL_BATCH_SHM: OP_ATTEND_PREFILL_BATCH}
PLACED_INLINE, PLACED_REGION = 0, 1
MIN_REGION_BYTES = 4096
FLAG_BLOCK_MASS, FLAG_K, FLAG_V = 1, 2, 4
MAX_TENSOR_DIMS = 5
ALIGN = 64  # tensors in a CALL body start at multiples of this offset
# An ATTEND* body over gRPC's message cap (tensors.MAX_MESSAGE_BYTES; this module stays
# torch-free) is refused, as the rpc is.
MAX_CALL_BYTES = 64 << 20
# A region holds one CALL body and its results (out is q's size): twice the cap, and slack.
MAX_REGION_BYTES = 2 * MAX_CALL_BYTES + (16 << 20)
END_OF_SEQUENCE = 2**64 - 1
MAX_TEXT_BYTES = 4096
# A request refused from its header is answered at once; a payload up to this follows and is
# read and dropped (the connection stays in sync), a larger one is never read: the node
# closes the connection after its answer (a client may look for that answer first).
MAX_DRAIN_BYTES = 16 << 20
MAX_FDS = 4  # descriptors taken with one header (MAP sends one; extras are closed)
MAX_READ_SLOTS = 64
# dtype codes, fixed for the wire (the names are protos.tensors.TORCH_DTYPES keys).
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}

FRAME = struct.Struct("<4sBBBBQQQHHHIHHQ")
SLAB = struct.Struct("<IBxHH")
CALL = struct.Struct("<iBxxxIIII")
SHM_CALL = struct.Struct("<QQQQ")
SHM_READ = struct.Struct("<QQI4x")  # area_offset, slot_bytes, num_slots
READ_ACK = struct.Struct("<Q")  # the slab index the client copied out
TENSOR = struct.Struct("<BBxx5I")
REPLY = struct.Struct("<BB6x")  # num_tensors, placement
REPLY_SIZE = REPLY.size + 3 * TENSOR.size


class Status(enum.IntEnum):
    """A frame's status byte: the gRPC status code numbers, so both transports
    report an error under the same code (protos/status.py maps them to errors)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


STATUS_OK = Status.OK


class ProtocolError(PagedKVError):
    """The peer broke the framing (bad magic/version, truncated stream): the
    connection cannot be trusted any more and is closed."""

    status_name = "UNAVAILABLE"


class Frame(NamedTuple):
    """One FRAME and its texts. A NamedTuple: every request and reply makes one or
    two, and a tuple is several times cheaper to build than a frozen dataclass."""

    op: int
    request_id: int = 0
    dtype: str = "float32"
    status: int = STATUS_OK
    start: int = 0
    end: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    slab_tokens: int = 0
    text: str = ""
    extra: str = ""
    payload_len: int = 0

    def pack(self) -> bytes:
        text, extra = self.text.encode()[:MAX_TEXT_BYTES], self.extra.encode()[:MAX_TEXT_BYTES]
        head = FRAME.pack(
            MAGIC,
            VERSION,
            self.op,
            DTYPE_CODES[self.dtype],
            self.status,
            self.request_id,
            self.start,
            self.end,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.slab_tokens,
            len(text),
            len(extra),
            self.payload_len,
        )
        return head + text + extra


def recv_exact(sock: socket.socket, view: memoryview, what: str, flags: int = 0) -> None:
    """Fill `view` from the socket; ProtocolError if the peer closes first. flags:
    recv's (socket.MSG_WAITALL on a blocking socket: one call for the whole view)."""
    got, n = 0, len(view)
    if flags and isinstance(sock, ssl.SSLSocket):  # (TLS takes no recv flags)
        flags = 0
    while got < n:
        r = sock.recv_into(view[got:], 0, flags)
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes of {what}")
        got += r


def recv_bytes(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), what)
    return bytes(buf)


def read_frame(
    sock: socket.socket, *, eof_ok: bool = False, buf: bytearray | None = None, fds: list[int] | None = None
) -> Frame | None:
    """The next frame with its text, or None when eof_ok and the peer closed
    cleanly between frames. Raises ProtocolError on a malformed frame. `buf`
    (FRAME.size bytes) is reused for the header when given. `fds` (a Unix socket):
    file descriptors that came with the header are appended to it; the caller
    owns (and must close) them, even when this raises."""
    buf = bytearray(FRAME.size) if buf is None else buf
    view = memoryview(buf)
    first = sock.recv_into(view) if fds is None else _recv_with_fds(sock, view, fds)
    if first == 0:
        if eof_ok:
            return None
        raise ProtocolError("connection closed before a frame header")
    recv_exact(sock, view[first:], "a frame header")
    fields = _header_fields(buf)
    tlen, xlen = fields[-3], fields[-2]
    text = recv_bytes(sock, tlen, "frame text").decode(errors="replace") if tlen else ""
    extra = recv_bytes(sock, xlen, "frame text").decode(errors="replace") if xlen else ""
    return _frame(fields, text, extra)


def read_reply(sock: socket.socket, buf: bytearray | None = None) -> Frame:
    """read_frame for a reply: the peer closing first is a ProtocolError."""
    frame = read_frame(sock, buf=buf)
    assert frame is not None  # (eof_ok is off)
    return frame


def read_frame_ahead(sock: socket.socket, buf: bytearray) -> tuple[Frame, int]:
    """read_frame for a reply, taking in the same recv whatever of its payload
    arrived with the header, up to len(buf) - FRAME.size bytes (a reply leaves in
    one sendmsg: one recv instead of two for an attend's REPLY). Returns the frame
    and the number of its payload's first bytes now in buf[FRAME.size:] (its texts,
    if any, moved out of the way). Only for a reply, when nothing but its own
    payload can follow it; ProtocolError as read_frame."""
    view = memoryview(buf)
    got = sock.recv_into(view)
    if got == 0:
        raise ProtocolError("connection closed before a frame header")
    if got < FRAME.size:
        recv_exact(sock, view[got : FRAME.size], "a frame header")
        got = FRAME.size
    fields = _header_fields(buf)
    num_text = fields[-3] + fields[-2]
    texts = bytes(view[FRAME.size : min(got, FRAME.size + num_text)])
    if len(texts) < num_text:
        texts += recv_bytes(sock, num_text - len(texts), "frame text")
    ahead = max(0, got - FRAME.size - num_text)
    if num_text and ahead:
        view[FRAME.size : FRAME.size + ahead] = bytes(view[FRAME.size + num_text : got])
    text = texts[: fields[-3]].decode(errors="replace")
    return _frame(fields, text, texts[fields[-3] :].decode(errors="replace")), ahead


def frame_at(buf: bytes | bytearray, offset: int = 0) -> tuple[Frame, int] | None:
    """The frame whose header starts at buf[offset] and the offset just past its texts (where
    its payload starts), or None while buf does not hold the header and texts yet: a frame
    parsed from bytes already received (a non-blocking reader). ProtocolError as read_frame."""
    if len(buf) - offset < FRAME.size:
        return None
    fields = _header_fields(buf, offset)
    at = offset + FRAME.size
    end = at + fields[-3] + fields[-2]
    if len(buf) < end:
        return None
    text = bytes(buf[at : at + fields[-3]]).decode(errors="replace")
    extra = bytes(buf[at + fields[-3] : end]).decode(errors="replace")
    return _frame(fields, text, extra), end


def _header_fields(buf: bytes | bytearray, offset: int = 0) -> tuple[int, ...]:
    """FRAME's fields after the magic and version, checked (ProtocolError)."""
    magic, version, *fields = FRAME.unpack_from(buf, offset)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a pagedkv bulk peer")
    if version != VERSION:
        raise ProtocolError(f"bulk protocol version {version} unsupported (this side speaks {VERSION})")
    if fields[1] >= len(DTYPES):
        raise ProtocolError(f"unknown dtype code {fields[1]}")
    if fields[-3] > MAX_TEXT_BYTES or fields[-2] > MAX_TEXT_BYTES:
        raise ProtocolError(f"frame text of {fields[-3]}+{fields[-2]} bytes exceeds {MAX_TEXT_BYTES}")
    return tuple(fields)


def _frame(fields: tuple[int, ...], text: str, extra: str) -> Frame:
    op, dtype, status, rid, start, end, layers, heads, dim, slab, _, _, plen = fields
    return Frame(op, rid, DTYPES[dtype], status, start, end, layers, heads, dim, slab, text, extra, plen)


def _recv_with_fds(sock: socket.socket, view: memoryview, fds: list[int]) -> int:
    """recv_into that also takes the descriptors (SCM_RIGHTS) sent with the bytes."""
    n, ancillary, _, _ = sock.recvmsg_into([view], socket.CMSG_SPACE(4 * MAX_FDS))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
    return n


def send_parts(sock: socket.socket, parts: list[bytes | memoryview]) -> None:
    """sendall of several buffers with sendmsg (one syscall when the socket takes
    them all); a partial send resumes where it stopped."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):  # (TLS has no sendmsg)
        for view in views:
            sock.sendall(view)
        return
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def pack_slab(num_tokens: int, status: int = STATUS_OK, text: str = "", extra: str = "") -> bytes:
    t, x = text.encode()[:MAX_TEXT_BYTES], extra.encode()[:MAX_TEXT_BYTES]
    return SLAB.pack(num_tokens, status, len(t), len(x)) + t + x


def read_slab(sock: socket.socket) -> tuple[int, int, str, str]:
    """(num_tokens, status, text, extra) of the next slab header."""
    buf = bytearray(SLAB.size)
    recv_exact(sock, memoryview(buf), "a slab header")
    n, status, tlen, xlen = SLAB.unpack(buf)
    if tlen > MAX_TEXT_BYTES or xlen > MAX_TEXT_BYTES:
        raise ProtocolError(f"slab text of {tlen}+{xlen} bytes exceeds {MAX_TEXT_BYTES}")
    text = recv_bytes(sock, tlen, "slab text").decode(errors="replace")
    return n, status, text, recv_bytes(sock, xlen, "slab text").decode(errors="replace")


def pad(n: int) -> int:
    """Bytes of zeros that follow n bytes to reach a multiple of ALIGN."""
    return -n % ALIGN


@functools.lru_cache(maxsize=256)
def pack_tensor(dtype: str, shape: tuple[int, ...]) -> bytes:
    """A TENSOR descriptor; ValueError when the shape cannot be carried. Cached: a
    decode loop sends and answers the same few shapes on every call."""
    if len(shape) > MAX_TENSOR_DIMS:
        raise ValueError(f"{len(shape)} dims (at most {MAX_TENSOR_DIMS})")
    dims = (*shape, *(0,) * (MAX_TENSOR_DIMS - len(shape)))
    return TENSOR.pack(DTYPE_CODES[dtype], len(shape), *dims)


def unpack_tensor(buf: bytes | bytearray | memoryview, offset: int) -> tuple[str, tuple[int, ...]]:
    """(dtype name, shape) of the TENSOR at offset; ProtocolError when malformed."""
    code, ndim, *dims = TENSOR.unpack_from(buf, offset)
    if code >= len(DTYPES) or ndim > MAX_TENSOR_DIMS:
        raise ProtocolError(f"bad tensor descriptor (dtype code {code}, {ndim} dims)")
    return DTYPES[code], tuple(dims[:ndim])


def error_frame(op: int, request_id: int, exc: BaseException, end: int = 0) -> tuple[Frame, str]:
    """The error reply for exc (status, message, error class name: what gRPC's status
    and trailing metadata carry) and its status name."""
    code, details, cls = status_for(exc)
    status = Status[code.name]
    return Frame(op, request_id, status=status, end=end, text=details, extra=_extra(cls, exc)), code.name


def error_slab(exc: BaseException) -> bytes:
    """A SLAB that ends a read with exc's status instead of bytes."""
    code, details, cls = status_for(exc)
    return pack_slab(0, Status[code.name], details, _extra(cls, exc))


def error_of(status: int, text: str, extra: str, where: str) -> PagedKVError:
    """The domain error an error reply stands for (`where` names the node)."""
    name = Status(status).name if status in Status._value2member_map_ else "UNKNOWN"
    cls, _, ids = extra.partition(" ")
    return error_from_status(name, text, cls, where, ids)


def _extra(cls: str, exc: BaseException) -> str:
    """A frame's extra text: the error class name, then a space and its ids (JSON)."""
    ids = error_ids(exc) if cls else ""
    return f"{cls} {ids}" if ids else cls


def is_alive(sock: socket.socket) -> bool:
    """False when the peer closed this idle connection (restart, stop), or when it is
    readable at all (EOF, or bytes on an idle connection: out of sync). One poll
    (a peek would need the socket set non-blocking and back: three syscalls)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return not poller.poll(0)
    except (OSError, ValueError):  # closed
        return False


def address_host(address: str) -> str:
    """The host part of a gRPC address ("node-0:50051", "[::1]:0", "localhost"), brackets
    off: where a framed or bulk port of the same server listens."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")
