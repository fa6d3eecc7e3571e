"""The library inference workers import: sync and asyncio clients of the cache.

Never imports cache_node or coordinator (workers install only what they need).
Every error raised is a PagedKVError (pagedkv.protos.errors), re-raised from the
node's or coordinator's status with the ids it carried.
"""

from ..protos.attention import LayerAttention
from ..protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    NodeLost,
    NodeNotLive,
    NotFound,
    OpenFailed,
    PagedKVError,
    PermissionDenied,
    PrefixEvicted,
    QuotaExceeded,
    SequenceExists,
    SequenceLost,
    SequenceNotFound,
    SpecMismatch,
    Unauthenticated,
    Unavailable,
)
from ..protos.wire import ProtocolError
from .aio import AsyncCacheClient, AsyncSequence
from .config import ClientConfig
from .shm import RegionRefused
from .sync import CacheClient, Sequence
from .transport import TransportUnavailable
from .types import AttentionResult, MissExplanation, NodeStats, OpenResult

__all__ = [
    "NodeLost",
    "NodeNotLive",
    "PermissionDenied",
    "ProtocolError",
    "QuotaExceeded",
    "RegionRefused",
    "SequenceExists",
    "SequenceLost",
    "SpecMismatch",
    "TransportUnavailable",
    "Unauthenticated",
    "AsyncCacheClient",
    "AsyncSequence",
    "AttentionResult",
    "CacheClient",
    "CapacityExceeded",
    "ClientConfig",
    "FailedPrecondition",
    "IntegrityError",
    "InvalidArgument",
    "LayerAttention",
    "MissExplanation",
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
