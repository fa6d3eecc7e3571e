"""Domain errors <-> gRPC status codes, both directions, for every role.

Server side: `status_for(exc)` gives the code, details and error class name of a
raised exception; `abort_details` also puts the class name in the trailing
metadata (ERROR_CLASS_KEY) and logs unexpected exceptions, which become INTERNAL
while the process keeps serving.

Client side: `error_from_rpc(rpc_error)` re-raises the same class when the
metadata names one of pagedkv.protos.errors that fits the status code (so
`except SequenceNotFound` works across the wire), with the ids it carried
(`exc.seq_id`, ERROR_IDS_KEY), else the generic class for the code.
DEADLINE_EXCEEDED and CANCELLED become Unavailable (may succeed later).
"""

from __future__ import annotations

import contextlib
import json
import logging

import grpc

from . import errors
from .errors import ERROR_FOR_STATUS, PagedKVError, Unavailable

ERROR_CLASS_KEY = "pagedkv-error-class"
ERROR_IDS_KEY = "pagedkv-error-ids"  # JSON of the error's ids (seq_id, node_id, counts)
_TRANSIENT = {"DEADLINE_EXCEEDED", "CANCELLED"}
logger = logging.getLogger("pagedkv.status")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, details, error class name) for an exception raised by a handler."""
    if isinstance(exc, PagedKVError):
        code = getattr(grpc.StatusCode, exc.status_name, grpc.StatusCode.UNKNOWN)
        return code, str(exc) or type(exc).__name__, type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ""


def error_ids(exc: BaseException) -> str:
    """The ids a domain error carries (its public scalar attributes) as JSON; "" when none."""
    if not isinstance(exc, PagedKVError):
        return ""
    ids = {
        k: v
        for k, v in vars(exc).items()
        if not k.startswith("_") and k != "grpc_status" and isinstance(v, str | int | float)
    }
    return json.dumps(ids, sort_keys=True) if ids else ""


def abort_details(
    context: grpc.ServicerContext, method: str, exc: BaseException
) -> tuple[grpc.StatusCode, str]:
    """The (code, details) to abort the call with; sets the error-class trailing
    metadata and logs unexpected exceptions with their traceback."""
    code, details, cls = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=exc)
    if cls:
        ids = error_ids(exc)
        context.set_trailing_metadata(((ERROR_CLASS_KEY, cls), *(((ERROR_IDS_KEY, ids),) if ids else ())))
    return code, details


def _metadata_value(exc: grpc.RpcError, key: str) -> str:
    trailing = getattr(exc, "trailing_metadata", None)
    for k, v in (trailing() if callable(trailing) else None) or ():
        if k == key:
            return v if isinstance(v, str) else v.decode()
    return ""


def error_from_rpc(exc: grpc.RpcError, context: str = "") -> PagedKVError:
    """The domain error a failed call stands for (sync or asyncio RpcError).
    `context` (e.g. "node n1") is prefixed to the server's message."""
    code = exc.code()  # type: ignore[attr-defined]
    name = code.name if code is not None else "UNKNOWN"
    details = exc.details() or name  # type: ignore[attr-defined]
    cls, ids = _metadata_value(exc, ERROR_CLASS_KEY), _metadata_value(exc, ERROR_IDS_KEY)
    return error_from_status(name, details, cls, context, ids)


def status_name(number: int) -> str:
    """The gRPC status code name of its number (the bulk channel sends numbers)."""
    for code in grpc.StatusCode:
        if code.value[0] == number:
            return code.name
    return "UNKNOWN"


def error_from_status(
    name: str, details: str, class_name: str = "", context: str = "", ids: str = ""
) -> PagedKVError:
    """The domain error for a status code name, its details, the error class name and
    the ids (error_ids' JSON) the server sent (gRPC trailing metadata or a bulk frame)."""
    details = details or name
    base = ERROR_FOR_STATUS.get(name, Unavailable if name in _TRANSIENT else PagedKVError)
    cls = getattr(errors, class_name, None) if class_name else None
    # the named class when it travels as this very status (QuotaExceeded is no
    # CapacityExceeded, but both are RESOURCE_EXHAUSTED), else the status's own class
    if not (isinstance(cls, type) and issubclass(cls, PagedKVError) and cls.status_name == base.status_name):
        cls = base
    message = details if name not in _TRANSIENT else f"{name}: {details}"
    if context:
        message = f"{context}: {message}"
    # Bypass subclass constructors (they take ids, not a message): the server
    # already formatted the message.
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.grpc_status = name  # type: ignore[attr-defined]
    if ids:
        # ids that do not parse are dropped: the message still names them
        with contextlib.suppress(ValueError, AttributeError):
            err.__dict__.update({k: v for k, v in json.loads(ids).items() if isinstance(k, str)})
    return err
