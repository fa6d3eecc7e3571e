"""AUTH: the credentials a client presents on a bulk connection, once per connection
and sequence (spec: docs/bulk-protocol.md). The node adds them to the connection's
credentials (cache_node/gate.py); every later request on it is checked against them.

Payload: items back to back, each `kind u8 | length u16 | bytes`: kind 1 a ticket
(protos/tickets.py), kind 2 a standalone node's bearer token.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from ..errors import InvalidArgument
from .frame import OP_AUTH, Frame

ITEM = struct.Struct("<BH")
KIND_TICKET, KIND_TOKEN = 1, 2
MAX_AUTH_BYTES = 1 << 20


def encode_auth(request_id: int, tickets: Sequence[bytes], token: str = "") -> bytes:
    """FRAME + the items; InvalidArgument for an item over 64 KiB."""
    items = [(KIND_TICKET, t) for t in tickets] + ([(KIND_TOKEN, token.encode())] if token else [])
    try:
        payload = b"".join(ITEM.pack(kind, len(raw)) + raw for kind, raw in items)
    except struct.error as exc:
        raise InvalidArgument(f"a credential too long for the bulk channel: {exc}") from None
    return Frame(OP_AUTH, request_id, payload_len=len(payload)).pack() + payload


def decode_auth(payload: bytes) -> tuple[list[bytes], str | None]:
    """(tickets, token or None); InvalidArgument when the items do not add up."""
    tickets, token, at = [], None, 0
    while at < len(payload):
        if at + ITEM.size > len(payload):
            raise InvalidArgument(f"bulk auth: an item header runs past the {len(payload)}-byte payload")
        kind, n = ITEM.unpack_from(payload, at)
        at += ITEM.size
        if at + n > len(payload):
            raise InvalidArgument(f"bulk auth: a {n}-byte item runs past the {len(payload)}-byte payload")
        raw = bytes(payload[at : at + n])
        at += n
        if kind == KIND_TICKET:
            tickets.append(raw)
        elif kind == KIND_TOKEN:
            token = raw.decode(errors="replace")
        else:
            raise InvalidArgument(f"bulk auth: unknown item kind {kind}")
    return tickets, token
