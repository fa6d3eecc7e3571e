"""The bulk channel's wire codec, written once for both ends (spec:
docs/bulk-protocol.md): framing and socket helpers (frame), request and reply
bodies (call), capabilities (hello), credentials (auth)."""

from typing import TYPE_CHECKING, Any

from .auth import MAX_AUTH_BYTES, decode_auth, encode_auth
from .frame import *  # noqa: F403 - the constants and helpers are the module's surface
from .frame import Frame, ProtocolError, Status
from .hello import MAX_HELLO_BYTES, Capabilities, hello

if TYPE_CHECKING:
    from .call import (
        Call,
        IdsMemo,
        Open,
        Unencodable,
        byte_view,
        call_parts,
        decode_call,
        decode_open,
        decode_reply,
        decode_result_head,
        encode_call_body,
        encode_open,
        encode_reply,
        nbytes,
        reply_body,
    )
_CALL_NAMES = frozenset(
    {
        "Call",
        "IdsMemo",
        "Open",
        "Unencodable",
        "byte_view",
        "call_parts",
        "decode_call",
        "decode_open",
        "decode_reply",
        "decode_result_head",
        "encode_call_body",
        "encode_open",
        "encode_reply",
        "nbytes",
        "reply_body",
    }
)


def __getattr__(name: str) -> Any:
    """The call codec's names, imported on first use: it needs torch, and the coordinator
    (which never imports torch) uses the framing alone (framed_server.py)."""
    if name in _CALL_NAMES:
        from . import call

        return getattr(call, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_AUTH_BYTES",
    "MAX_HELLO_BYTES",
    "Call",
    "Capabilities",
    "Frame",
    "IdsMemo",
    "Open",
    "ProtocolError",
    "Status",
    "Unencodable",
    "byte_view",
    "call_parts",
    "decode_auth",
    "decode_call",
    "decode_open",
    "decode_reply",
    "decode_result_head",
    "encode_auth",
    "encode_call_body",
    "encode_open",
    "encode_reply",
    "hello",
    "nbytes",
    "reply_body",
]
