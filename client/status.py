"""gRPC status -> domain error: the client side's one translation.

The node sends the error's class name in trailing metadata; when it names a
class of pagedkv.protos.errors that fits the status code, the client raises
that class (so `except SequenceNotFound` works across the wire), else the
generic class for the code (ERROR_FOR_STATUS). The message is the server's.
DEADLINE_EXCEEDED and CANCELLED become Unavailable (the call may succeed later).
"""

from __future__ import annotations

import grpc

from ..protos import errors
from ..protos.errors import ERROR_FOR_STATUS, PagedKVError, Unavailable

ERROR_CLASS_KEY = "pagedkv-error-class"  # must match cache_node/status.py
_TRANSIENT = {"DEADLINE_EXCEEDED", "CANCELLED"}


def _metadata_value(exc: grpc.RpcError, key: str) -> str:
    trailing = getattr(exc, "trailing_metadata", None)
    for k, v in (trailing() if callable(trailing) else None) or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""


def error_from_rpc(exc: grpc.RpcError) -> PagedKVError:
    """The domain error a failed call stands for (sync or asyncio RpcError)."""
    code = exc.code()  # type: ignore[attr-defined]
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() or name  # type: ignore[attr-defined]
    base = ERROR_FOR_STATUS.get(name, Unavailable if name in _TRANSIENT else PagedKVError)
    named = getattr(errors, _metadata_value(exc, ERROR_CLASS_KEY), None)
    cls: type[PagedKVError] = named if isinstance(named, type) and issubclass(named, base) else base
    # Bypass subclass constructors (they take ids, not a message): the server
    # already formatted the message.
    err = PagedKVError.__new__(cls)
    Exception.__init__(err, details if name not in _TRANSIENT else f"{name}: {details}")
    err.grpc_status = name  # type: ignore[attr-defined]
    return err
