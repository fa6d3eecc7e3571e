"""HELLO: what a node's bulk listener offers, asked once per connection set-up
(spec: docs/bulk-protocol.md). The client decides from this which ops and paths
to use; it never guesses from an error's text."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

from .frame import (
    MAX_CALL_BYTES,
    MAX_READ_SLOTS,
    MAX_REGION_BYTES,
    OP_HELLO,
    OP_NAMES,
    Frame,
    ProtocolError,
    Status,
    error_of,
    read_reply,
    recv_bytes,
)

MAX_HELLO_BYTES = 64 << 10


@dataclass(frozen=True)
class Capabilities:
    """A node's bulk listener: the ops it serves, the name of its same-host listener
    ("" when it has none), and its limits (max_append_tokens: its whole pool, an APPEND
    of more is refused from its header; 0: not said)."""

    ops: frozenset[int] = field(default_factory=frozenset)
    local_name: str = ""
    max_call_bytes: int = MAX_CALL_BYTES
    max_region_bytes: int = MAX_REGION_BYTES
    max_read_slots: int = MAX_READ_SLOTS
    max_append_tokens: int = 0
    block_size: int = 0

    def serves(self, op: int) -> bool:
        return op in self.ops

    def encode(self) -> bytes:
        return json.dumps(
            {
                "ops": sorted(OP_NAMES[op] for op in self.ops),
                "local_name": self.local_name,
                "max_call_bytes": self.max_call_bytes,
                "max_region_bytes": self.max_region_bytes,
                "max_read_slots": self.max_read_slots,
                "max_append_tokens": self.max_append_tokens,
                "block_size": self.block_size,
            }
        ).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Capabilities:
        """ProtocolError when the payload is not a HELLO reply; unknown op names are
        ignored (a node may serve ops this side does not use)."""
        try:
            d = json.loads(raw)
            numbers = {name: op for op, name in OP_NAMES.items()}
            return cls(
                frozenset(numbers[n] for n in d["ops"] if n in numbers),
                str(d["local_name"]),
                int(d["max_call_bytes"]),
                int(d["max_region_bytes"]),
                int(d["max_read_slots"]),
                int(d.get("max_append_tokens", 0)),
                int(d.get("block_size", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ProtocolError(f"malformed HELLO reply: {exc}") from None


def hello(sock: socket.socket, request_id: int) -> Capabilities:
    """Ask the node on sock what it offers (one HELLO round trip). ProtocolError when
    the reply is not a HELLO reply; a refused HELLO raises its domain error."""
    sock.sendall(Frame(OP_HELLO, request_id).pack())
    reply = read_reply(sock)
    if reply.status != Status.OK:
        raise error_of(reply.status, reply.text, reply.extra, "bulk hello")
    if reply.op != OP_HELLO or not 0 < reply.payload_len <= MAX_HELLO_BYTES:
        raise ProtocolError(f"hello answered with op {reply.op} and {reply.payload_len} payload bytes")
    return Capabilities.decode(recv_bytes(sock, reply.payload_len, "hello reply"))
