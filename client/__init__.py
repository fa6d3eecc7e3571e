"""The library inference workers import: sync and asyncio clients of the cache.

Never imports cache_node or coordinator (workers install only what they need).
Errors raised are those of pagedkv.protos.errors, re-raised from gRPC statuses.
"""

from ..protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NotFound,
    OpenFailed,
    PagedKVError,
    PrefixEvicted,
    SequenceNotFound,
    Unavailable,
)
from .aio import AsyncCacheClient, AsyncSequence
from .config import ClientConfig
from .sync import CacheClient, Sequence
from .types import AttentionResult, NodeStats, OpenResult

__all__ = [
    "AsyncCacheClient",
    "AsyncSequence",
    "AttentionResult",
    "CacheClient",
    "CapacityExceeded",
    "ClientConfig",
    "FailedPrecondition",
    "IntegrityError",
    "InvalidArgument",
    "NodeStats",
    "NotFound",
    "OpenFailed",
    "OpenResult",
    "PagedKVError",
    "PrefixEvicted",
    "Sequence",
    "SequenceNotFound",
    "Unavailable",
]
