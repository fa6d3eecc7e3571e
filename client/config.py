"""Client configuration: deadlines, retries and message limits, as one value.

Retries are applied in ONE layer: the gRPC channel's service config
(`retryPolicy`), and only for the idempotent rpcs (node: Lookup, Stats, ReadKV,
Ping; coordinator: Lookup, Stats, Describe) on UNAVAILABLE. Everything else fails fast and the caller decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..protos.errors import InvalidArgument
from ..protos.tensors import CHUNK_BYTES, MESSAGE_SIZE_OPTIONS

NODE_SERVICE = "pagedkv.v1.CacheNode"
IDEMPOTENT_METHODS = ("Lookup", "Stats", "ReadKV", "Ping")
COORDINATOR_SERVICE = "pagedkv.v1.Coordinator"
IDEMPOTENT_COORDINATOR_METHODS = ("Lookup", "Stats", "Describe")


@dataclass(frozen=True)
class ClientConfig:
    deadline_s: float = 30.0  # every call gets one; override per call with timeout_s=
    max_attempts: int = 4  # retries of idempotent calls (gRPC caps this at 5)
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0
    chunk_bytes: int = CHUNK_BYTES  # streamed payload pieces (Append, ReadKV)
    tenant_salt: bytes = b""  # direct-to-node mode only: a trusted caller's salt (see the .proto)
    # KV ranges of at least this many bytes take the node's bulk TCP channel
    # (client/bulk.py) when it has one; None: always the Append/ReadKV rpcs.
    bulk_min_bytes: int | None = 1 << 20

    def __post_init__(self) -> None:
        if self.deadline_s <= 0:
            raise InvalidArgument(f"deadline_s must be positive, got {self.deadline_s}")
        if not 1 <= self.max_attempts <= 5:
            raise InvalidArgument(f"max_attempts must be in [1, 5], got {self.max_attempts}")
        if self.chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.bulk_min_bytes is not None and self.bulk_min_bytes < 0:
            raise InvalidArgument(f"bulk_min_bytes must be >= 0 or None, got {self.bulk_min_bytes}")

    def service_config(self) -> str:
        policy = {
            "maxAttempts": self.max_attempts,
            "initialBackoff": f"{self.initial_backoff_s}s",
            "maxBackoff": f"{self.max_backoff_s}s",
            "backoffMultiplier": self.backoff_multiplier,
            "retryableStatusCodes": ["UNAVAILABLE"],
        }
        names = [{"service": NODE_SERVICE, "method": m} for m in IDEMPOTENT_METHODS]
        names += [{"service": COORDINATOR_SERVICE, "method": m} for m in IDEMPOTENT_COORDINATOR_METHODS]
        if self.max_attempts == 1:  # gRPC refuses a retryPolicy with fewer than 2 attempts
            return json.dumps({"methodConfig": [{"name": names}]})
        return json.dumps({"methodConfig": [{"name": names, "retryPolicy": policy}]})

    def channel_options(self) -> list[tuple[str, object]]:
        return [
            *MESSAGE_SIZE_OPTIONS,
            ("grpc.enable_retries", 1),
            # Reconnect quickly after a node or coordinator restart (gRPC's default
            # backoff grows to 120 s, failing calls fast all that time).
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.service_config", self.service_config()),
        ]
