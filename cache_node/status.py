"""Domain errors -> gRPC status codes: the node side's one translation.

Every pagedkv error names its status (`status_name`); the class name travels in
the trailing metadata under ERROR_CLASS_KEY so the client re-raises the same
class (client/status.py is the other half). Anything that is not a pagedkv
error is a bug: it becomes INTERNAL with the exception's type and message,
and the process keeps serving.
"""

from __future__ import annotations

import logging

import grpc

from ..protos.errors import PagedKVError

ERROR_CLASS_KEY = "pagedkv-error-class"
logger = logging.getLogger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str]:
    """(status code, details, error class name) for an exception raised by a handler."""
    if isinstance(exc, PagedKVError):
        code = getattr(grpc.StatusCode, exc.status_name, grpc.StatusCode.UNKNOWN)
        return code, str(exc) or type(exc).__name__, type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}", ""


def abort_details(
    context: grpc.ServicerContext, method: str, exc: BaseException
) -> tuple[grpc.StatusCode, str]:
    """The (code, details) to abort the call with; sets the error-class trailing
    metadata and logs unexpected exceptions with their traceback."""
    code, details, cls = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=exc)
    if cls:
        context.set_trailing_metadata(((ERROR_CLASS_KEY, cls),))
    return code, details
