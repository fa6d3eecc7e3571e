"""The bulk channel: raw TCP framing for large KV ranges and the per-step data calls
(part of the wire contract).

gRPC-Python moves ~0.3 GB/s through a stream on one core pair (protobuf
messages, HTTP/2 framing, a bytes object per chunk). Large KV ranges therefore
take a side channel, as LMCache does: the node also listens on a plain TCP port
(advertised as `StatsResponse.bulk_port`, 0 = off) and both ends move the bytes
with `sendall` / `recv_into` between tensors and the socket, no copies in
Python. The gRPC rpcs (Append, ReadKV) stay the contract for small calls and
the fallback when the port is off or unreachable; both paths validate the same
way and fail with the same errors (protos/status.py, protos/errors.py).
The per-step Attend / AttendPrefillBatch calls take the channel too, at any
size: gRPC-Python costs ~1 ms a call on a small host (HTTP/2, protobuf, the
server's thread hand-off), several times the attention itself at batch 1.

A connection carries any number of requests, one at a time, each answered
before the next. Every integer is little-endian. Each request and reply starts
with FRAME (54 bytes):

    magic "PKVB" | version u8 | op u8 | dtype u8 | status u8 | request_id u64
    | start u64 | end u64 | num_layers u16 | num_kv_heads u16 | head_dim u16
    | slab_tokens u32 | text_len u16 | extra_len u16 | payload_len u64

then `text_len` bytes of UTF-8 text and `extra_len` bytes of extra text.

APPEND (op 1), client -> node: text = seq_id; tokens [start=0, end=n); then n
token ids (int64), then payload_len = n * bytes_per_token bytes: consecutive
slabs of `slab_tokens` whole tokens (the last may be shorter), each slab the
bytes of stack(k, v)[:, :, a:b] = [2, num_layers, t, kv_heads, head_dim] --
the layout of the gRPC Append chunks (protos/tensors.py). The node reads the
whole request before it changes anything, then appends atomically. Reply: a
FRAME with status (and `end` = the sequence's new length when OK).

READ (op 2), client -> node: text = seq_id, [start, end) (flag: end is
`END_OF_SEQUENCE` for "to the end"), slab_tokens = the slab size the client
wants (0: the node picks). Reply: a FRAME with status; when OK it echoes the
resolved range, shape, dtype and slab_tokens, and payload_len, then the slabs,
each preceded by SLAB (num_tokens u32 | status u8 | pad | text_len u16 |
extra_len u16). A SLAB with a non-zero status (say, the sequence was freed
mid-read) carries the error text instead of bytes and ends the reply.

ATTEND (op 3) and ATTEND_PREFILL_BATCH (op 4), client -> node: the per-step
data calls, the Attend / AttendPrefillBatch rpcs' semantics (append the new
tokens' k/v first when given, then attend). The frame's other fields are 0
except payload_len, the length of this CALL body, which is laid out as

    CALL (24 bytes): layer i32 | flags u8 (1: return_block_mass, 2: k given,
        4: v given) | pad u8 u16 | num_seqs u32 | num_counts u32
        | num_token_ids u32 | seq_ids_len u32
    TENSOR (24 bytes) for q, then k, then v if given: dtype u8 | ndim u8 (<= 5)
        | pad u16 | 5 x dim u32 (unused dims 0)
    num_token_ids x token id i64 | num_counts x num_tokens i32 (ATTEND_PREFILL_
    BATCH: rows per sequence; ATTEND: none) | seq_ids_len bytes: each sequence
    id's length u16, then the ids' UTF-8 back to back | zeros to a multiple of 64 | q's bytes | zeros to
    a multiple of 64 | k's bytes | ... (each tensor's bytes start 64-byte aligned:
    the node computes on views of its receive buffer, and the CPU kernels' results
    depend on alignment in the last bit, so a fixed one keeps them reproducible)

Layer and counts are signed so that a negative one reaches the engine and is
refused with the gRPC path's error. A CALL body over MAX_CALL_BYTES is refused
and the connection closed (it cannot be drained in bounded time); a body whose
sections disagree with payload_len is refused after it was read (the connection
stays usable). Reply: a FRAME with status; when OK, payload_len bytes of

    REPLY (80 bytes): num_tensors u8 (2: out, lse; 3: with block_mass)
        | placement u8 (0 over TCP) | pad 6 | 3 x TENSOR (the absent one all zeros)
    then the tensors' bytes back to back (out, lse, block_mass).

PING (op 5): a bare FRAME both ways (the channel's own no-op floor).

OPEN (op 11), client -> node: the Open rpc of a client that talks to one node
directly (no coordinator). Time-to-first-token pays one Open per request, ~1-2 ms
over gRPC on a small host against ~0.1-0.3 ms for a round trip here. FRAME with
text = seq_id, end = n (the prompt's token ids), start = max_cached_tokens + 1
(0: not given, the node's default, as the rpc's absent field), payload_len =
8 * n + len(tenant_salt); the payload is the n token ids (int64), then the tenant
salt's bytes (TRUSTED, as the rpc's field: whoever reaches the channel could set
it, as whoever reaches the gRPC port). Validation and errors are the rpc's (the
engine's). There is no expect_cached_tokens: that is the coordinator's
asynchronous open, which stays on gRPC. A payload_len below 8 * n is refused
after the payload was drained (the connection stays usable); one over
MAX_CALL_BYTES is refused and the connection closed, as for a CALL body. Reply:
a bare FRAME with status; when OK, start = num_cached_tokens and end =
num_host_hit_tokens. A node that predates OPEN answers "unknown op" and closes:
the client then opens over the rpc from then on.

Same-host path (shared memory). Over TCP a batch-32 attend moves ~1.3 MB through
the loopback stack each way, more than the whole per-call budget; a client on the
node's host instead passes the bytes through a memory region both processes map.
It is negotiated, never configured:

HELLO (op 6), client -> node over TCP: a bare FRAME. Reply: a FRAME whose text is
the name of the node's same-host listener, a Linux abstract Unix socket
(`"\0" + name`, no file to leave behind; reachable only from the node's network
namespace), or "" when it has none. The name carries 128 random bits, so a
successful connect reaches this node. Like the TCP port, it is open to any local
process that can reach it (an abstract socket has no file permissions; the bulk
channel has no authentication either way). A node that predates HELLO answers
"unknown op" and closes: the client stays on TCP.

A connection to that socket speaks the same FRAMEs (APPEND, READ, PING, ATTEND*,
OPEN work on it as on TCP; descriptors sent with any other op than MAP are closed)
plus:

MAP (op 7), client -> node: a bare FRAME with `end` = the region's size in bytes
(MIN_REGION_BYTES..MAX_REGION_BYTES), sent with exactly one file descriptor
(SCM_RIGHTS): a memfd of that size sealed against shrinking (F_SEAL_SHRINK; a
region that could shrink would fault the node on access). The node maps it
shared and replies with a bare FRAME (an error status and no region when the fd
is missing, not a sealed memfd, or of another size; the connection stays usable).
A later MAP replaces the region (the client grows it). A memfd has no name in any
file system: its memory is freed once both sides have unmapped it and closed the
descriptor, whichever side dies first (the node closes the descriptor after
mapping and unmaps when the connection ends), so nothing is left behind.

ATTEND_SHM (op 8) and ATTEND_PREFILL_BATCH_SHM (op 9), client -> node, on a
connection with a region: FRAME with payload_len = SHM_CALL.size, then

    SHM_CALL (32 bytes): body_offset u64 | body_len u64 | out_offset u64
        | out_len u64

The CALL body (laid out as above) lies in region[body_offset, +body_len),
body_offset a multiple of ALIGN (the tensors' alignment is relative to the page-
aligned region). A range outside the region is refused (INVALID_ARGUMENT, the
connection stays usable). The node computes on views of the region and replies
like ATTEND, except that REPLY's `placement` byte says where the tensors are:
PLACED_INLINE (0: after REPLY, as over TCP; they did not fit in out_len) or
PLACED_REGION (1: in region[out_offset, +out_len), out then lse then block_mass,
each starting at a multiple of ALIGN from out_offset; payload_len is then
REPLY_SIZE). The client must not touch the region until the reply arrived (one
call at a time per connection), and copies the results out before it returns
them: a caller's result is never overwritten by a later call.

READ_SHM (op 10), client -> node, on a connection with a region: a READ whose
bytes pass through a small ring of slots in the region instead of the socket.
FRAME as READ's (text = seq_id, [start, end), slab_tokens: 0 = the node picks;
at most what one slot holds) with payload_len = SHM_READ.size, then

    SHM_READ (24 bytes): area_offset u64 | slot_bytes u64 | num_slots u32 | pad u32

The ring is region[area_offset, +num_slots * slot_bytes), area_offset and
slot_bytes multiples of ALIGN, 1..MAX_READ_SLOTS slots. A ring outside the
region, or no region, is refused (INVALID_ARGUMENT, the connection stays
usable); so is a slot smaller than one token, whose error reply's `end` is the
node's bytes per token (the client grows its region once and asks again). Reply:
a FRAME as READ's (resolved range, shape, dtype, slab_tokens) with payload_len 0,
then per slab i only its SLAB header over the socket: its bytes (READ's slab
layout, [2, num_layers, t, kv_heads, head_dim]) are in slot i % num_slots. All
slabs but the last have slab_tokens tokens. After copying slab i out, the client
sends READ_ACK (u64 = i) when i + num_slots < the number of slabs; the node waits
for slab i's ACK before it writes slab i + num_slots into the same slot, so it
gathers the next slabs while the client copies this one out. An ACK out of order
is a protocol error (the connection closes). A SLAB with a non-zero status ends
the reply, as in READ; the node then reads the ACKs the client sent for slabs
before it, so the connection stays in sync. The node only writes the ring (it
never trusts what the client leaves there); a client that dies mid-read just
ends the connection, which unmaps its region.

The ring stays small and reused (2 x 2 MiB by default): backing a whole 256 MiB
result with memfd was measured and dropped, as shared memory has no transparent
huge pages on the hosts measured, so faulting 256 MiB of it cost ~0.3 s in page
allocation alone (anonymous memory: 0.03 s). READ_SHM moves each byte twice
(pool -> slot on the node, slot -> result on the client) where READ over a socket
moves it three times (pool -> staging, staging -> socket buffer, socket buffer
-> result).

APPEND and READ on a same-host connection are TCP's, through the Unix socket (no
TCP stack: under load it kept 4x TCP's download rate in the same run); READ is
what a client uses when the node answers READ_SHM with "unknown op" (an older
node; the connection closes and the client opens another).

Both ends move tensors with sendmsg / recv_into between the tensors' memory and
the socket (no payload-sized Python bytes); TCP_NODELAY is on at both ends.

Error replies: status = the gRPC status code number, text = the message, extra
= the pagedkv error class name (as in the gRPC trailing metadata), mapped back
by `protos.status.error_from_status`. A node that cannot parse a request (bad
magic, unknown version or op) replies with an error and closes the connection.
"""

from __future__ import annotations

import array
import functools
import socket
import struct
from typing import NamedTuple

from .tensors import MAX_MESSAGE_BYTES

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
SHM_OPS = {OP_ATTEND_SHM: OP_ATTEND, OP_ATTEND_PREFILL_BATCH_SHM: OP_ATTEND_PREFILL_BATCH}
PLACED_INLINE, PLACED_REGION = 0, 1
MIN_REGION_BYTES = 4096
FLAG_BLOCK_MASS, FLAG_K, FLAG_V = 1, 2, 4
MAX_TENSOR_DIMS = 5
ALIGN = 64  # tensors in a CALL body start at multiples of this offset
MAX_CALL_BYTES = MAX_MESSAGE_BYTES  # an ATTEND* body over gRPC's message cap is refused (as the rpc is)
# A region holds one CALL body and its results (out is q's size): twice the cap, and slack.
MAX_REGION_BYTES = 2 * MAX_CALL_BYTES + (16 << 20)
STATUS_OK = 0
END_OF_SEQUENCE = 2**64 - 1
MAX_TEXT_BYTES = 4096
MAX_FDS = 4  # descriptors taken with one header (MAP sends one; extras are closed)
# dtype codes, fixed for the wire (the names are protos.tensors.TORCH_DTYPES keys).
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}

FRAME = struct.Struct("<4sBBBBQQQHHHIHHQ")
SLAB = struct.Struct("<IBxHH")
CALL = struct.Struct("<iBxxxIIII")
SHM_CALL = struct.Struct("<QQQQ")
SHM_READ = struct.Struct("<QQI4x")  # area_offset, slot_bytes, num_slots
READ_ACK = struct.Struct("<Q")  # the slab index the client copied out
MAX_READ_SLOTS = 64
TENSOR = struct.Struct("<BBxx5I")
REPLY = struct.Struct("<BB6x")  # num_tensors, placement
REPLY_SIZE = REPLY.size + 3 * TENSOR.size


class ProtocolError(Exception):
    """The peer broke the framing (bad magic/version, truncated stream): the
    connection cannot be trusted any more and is closed."""


class Frame(NamedTuple):
    """One FRAME and its texts. A NamedTuple: every request and reply makes one or
    two, and a tuple is ~5x cheaper to build than a frozen dataclass (~0.5 vs ~2.5 us)."""

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
            MAGIC, VERSION, self.op, DTYPE_CODES[self.dtype], self.status, self.request_id, self.start,
            self.end, self.num_layers, self.num_kv_heads, self.head_dim, self.slab_tokens, len(text),
            len(extra), self.payload_len,
        )  # fmt: skip
        return head + text + extra


def recv_exact(sock: socket.socket, view: memoryview, what: str, flags: int = 0) -> None:
    """Fill `view` from the socket; ProtocolError if the peer closes first. flags:
    recv's (socket.MSG_WAITALL on a blocking socket: one call for the whole view
    instead of one per segment that arrived)."""
    got, n = 0, len(view)
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


def _header_fields(buf: bytearray) -> tuple[int, ...]:
    """FRAME's fields after the magic and version, checked (ProtocolError)."""
    magic, version, *fields = FRAME.unpack_from(buf, 0)
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
