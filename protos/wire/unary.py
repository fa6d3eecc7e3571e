"""UNARY: one unary rpc of a gRPC service over the framing (spec: docs/bulk-protocol.md,
"The coordinator's framed port"). The request is the rpc's own protobuf message and
its call metadata; the reply is the rpc's response message, or its status as every
error reply carries it. Both ends import this module.

Request: FRAME(op UNARY, text = the method's name, start = the metadata's length,
end = how long the server may hold it, in microseconds, payload_len = metadata +
message) | metadata | message. Metadata: pairs back to
back, each `key_len u16 | value_len u16 | key | value` (what gRPC's call metadata
holds: the bearer token, a node's cluster ticket).
Reply: FRAME(op UNARY, payload_len) | the response message; an error: the status,
text and error class of an error reply, no payload.
NOTIFY: the same request under op NOTIFY, for a method the server takes one-way: it runs
the handler and sends nothing back (a request it cannot take gets an error reply, then
the connection is closed).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

from ..errors import InvalidArgument
from .frame import OP_UNARY, Frame

PAIR = struct.Struct("<HH")
MAX_METADATA_BYTES = 64 << 10
MAX_WAIT_US = 10**7  # a request's `end`: the server holds none longer than it lets it (0: not at all)
Metadata = Sequence[tuple[str, str | bytes]]


def encode_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> bytes:
    """The pairs packed; InvalidArgument for one over the 64 KiB of the whole."""
    parts: list[bytes] = []
    for key, value in metadata:
        k = key.encode()
        v = value.encode() if isinstance(value, str) else bytes(value)
        parts += (PAIR.pack(len(k), len(v)) if len(k) + len(v) <= MAX_METADATA_BYTES else b"", k, v)
    packed = b"".join(parts)
    if len(packed) > MAX_METADATA_BYTES:
        raise InvalidArgument(f"call metadata of {len(packed)} bytes exceeds {MAX_METADATA_BYTES}")
    return packed


def decode_metadata(raw: bytes | memoryview) -> list[tuple[str, str | bytes]]:
    """The pairs, as gRPC hands them to a handler (a "-bin" key keeps its bytes, others
    are text); InvalidArgument when they do not add up."""
    pairs: list[tuple[str, str | bytes]] = []
    at, n = 0, len(raw)
    while at < n:
        if at + PAIR.size > n:
            raise InvalidArgument(f"unary: a metadata pair header runs past the {n}-byte metadata")
        klen, vlen = PAIR.unpack_from(raw, at)
        at += PAIR.size
        if at + klen + vlen > n:
            raise InvalidArgument(
                f"unary: a {klen}+{vlen}-byte metadata pair runs past the {n}-byte metadata"
            )
        key = bytes(raw[at : at + klen]).decode(errors="replace")
        value = bytes(raw[at + klen : at + klen + vlen])
        at += klen + vlen
        pairs.append((key, value if key.endswith("-bin") else value.decode(errors="replace")))
    return pairs


def encode_unary(
    request_id: int, method: str, metadata: bytes, message: bytes, op: int = OP_UNARY, may_wait_s: float = 0.0
) -> bytes:
    """The request: FRAME, packed metadata (encode_metadata), the serialized message
    (`op` OP_NOTIFY: the one-way form). `may_wait_s`: how long the server may hold it to
    serve it with others (FRAME's `end`, in microseconds; 0: serve it at once)."""
    wait_us = min(max(0, round(may_wait_s * 1e6)), MAX_WAIT_US)
    head = Frame(
        op,
        request_id,
        end=wait_us,
        text=method,
        start=len(metadata),
        payload_len=len(metadata) + len(message),
    )
    return head.pack() + metadata + message
