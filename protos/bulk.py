"""The bulk KV channel: raw TCP framing for large KV ranges (part of the wire contract).

gRPC-Python moves ~0.3 GB/s through a stream on one core pair (protobuf
messages, HTTP/2 framing, a bytes object per chunk). Large KV ranges therefore
take a side channel, as LMCache does: the node also listens on a plain TCP port
(advertised as `StatsResponse.bulk_port`, 0 = off) and both ends move the bytes
with `sendall` / `recv_into` between tensors and the socket, no copies in
Python. The gRPC rpcs (Append, ReadKV) stay the contract for small calls and
the fallback when the port is off or unreachable; both paths validate the same
way and fail with the same errors (protos/status.py, protos/errors.py).

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

Error replies: status = the gRPC status code number, text = the message, extra
= the pagedkv error class name (as in the gRPC trailing metadata), mapped back
by `protos.status.error_from_status`. A node that cannot parse a request (bad
magic, unknown version or op) replies with an error and closes the connection.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

MAGIC = b"PKVB"
VERSION = 1
OP_APPEND = 1
OP_READ = 2
STATUS_OK = 0
END_OF_SEQUENCE = 2**64 - 1
MAX_TEXT_BYTES = 4096
# dtype codes, fixed for the wire (the names are protos.tensors.TORCH_DTYPES keys).
DTYPES = ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}

FRAME = struct.Struct("<4sBBBBQQQHHHIHHQ")
SLAB = struct.Struct("<IBxHH")


class ProtocolError(Exception):
    """The peer broke the framing (bad magic/version, truncated stream): the
    connection cannot be trusted any more and is closed."""


@dataclass(frozen=True)
class Frame:
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


def recv_exact(sock: socket.socket, view: memoryview, what: str) -> None:
    """Fill `view` from the socket; ProtocolError if the peer closes first."""
    got, n = 0, len(view)
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes of {what}")
        got += r


def recv_bytes(sock: socket.socket, n: int, what: str) -> bytes:
    buf = bytearray(n)
    recv_exact(sock, memoryview(buf), what)
    return bytes(buf)


def read_frame(sock: socket.socket, *, eof_ok: bool = False) -> Frame | None:
    """The next frame with its text, or None when eof_ok and the peer closed
    cleanly between frames. Raises ProtocolError on a malformed frame."""
    buf = bytearray(FRAME.size)
    view = memoryview(buf)
    first = sock.recv_into(view)
    if first == 0:
        if eof_ok:
            return None
        raise ProtocolError("connection closed before a frame header")
    recv_exact(sock, view[first:], "a frame header")
    magic, version, op, dtype, status, rid, start, end, layers, heads, dim, slab, tlen, xlen, plen = (
        FRAME.unpack(buf)
    )
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): not a pagedkv bulk peer")
    if version != VERSION:
        raise ProtocolError(f"bulk protocol version {version} unsupported (this side speaks {VERSION})")
    if dtype >= len(DTYPES):
        raise ProtocolError(f"unknown dtype code {dtype}")
    if tlen > MAX_TEXT_BYTES or xlen > MAX_TEXT_BYTES:
        raise ProtocolError(f"frame text of {tlen}+{xlen} bytes exceeds {MAX_TEXT_BYTES}")
    text = recv_bytes(sock, tlen, "frame text").decode(errors="replace")
    extra = recv_bytes(sock, xlen, "frame text").decode(errors="replace")
    return Frame(op, rid, DTYPES[dtype], status, start, end, layers, heads, dim, slab, text, extra, plen)


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
