"""Client configuration: deadlines, retries and message limits, as one value.

Retries are applied in ONE layer: the gRPC channel's service config
(`retryPolicy`), and only for the idempotent rpcs on UNAVAILABLE: node Lookup, Stats,
Ping; coordinator Lookup, Stats, Describe, Close (closing a closed sequence
succeeds) and Open (each open carries a request id: a retry gets the first answer).
Everything else fails fast and the caller decides (a data call refused by a fenced node
changed nothing and may be sent again; one that timed out may have landed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..protos.errors import InvalidArgument
from ..protos.tensors import CHUNK_BYTES, MESSAGE_SIZE_OPTIONS
from ..protos.tls import TlsConfig

NODE_SERVICE = "pagedkv.v1.CacheNode"
# Not ReadKV: gRPC's retries of a server stream outlived the call's deadline (a read hung past
# 60 s at a 4 s deadline when its node was SIGKILLed and restarted, tests/chaos).
IDEMPOTENT_METHODS = ("Lookup", "Stats", "Ping")
COORDINATOR_SERVICE = "pagedkv.v1.Coordinator"
IDEMPOTENT_COORDINATOR_METHODS = ("Lookup", "Stats", "Describe", "Close", "Open")
TRANSPORTS = ("shm", "unix", "tcp", "grpc")


@dataclass(frozen=True)
class ClientConfig:
    deadline_s: float = 30.0  # every call gets one; override per call with timeout_s=
    max_attempts: int = 4  # retries of idempotent calls (gRPC caps this at 5)
    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    backoff_multiplier: float = 2.0
    chunk_bytes: int = CHUNK_BYTES  # streamed payload pieces (Append, ReadKV)
    tenant_salt: bytes = b""  # direct-to-node mode only: a trusted caller's salt (see the .proto)
    # KV ranges of at least this many bytes take the node's bulk listener when it has
    # one (smaller ones, gRPC); None: every data call on gRPC, whatever `transports` says.
    bulk_min_bytes: int | None = 1 << 20
    # The ways a data call may reach its node, tried in this order (client/transport/):
    # "shm" (same-host shared memory), "unix" (same-host socket), "tcp" (the bulk
    # port), "grpc" (always last: it carries every call). Same-host ones are skipped
    # where the platform has none or the node is on another host.
    transports: tuple[str, ...] = TRANSPORTS
    # TLS to the coordinator and the nodes (gRPC and the bulk TCP port; the same-host
    # paths need none): the CA that signed their certificates, and this client's own
    # certificate when they require one (mTLS). None: plaintext. TlsConfig.from_env()
    # reads the PAGEDKV_TLS_* variables the servers use.
    tls: TlsConfig | None = None
    # In a cluster the worker sends its sequence's node Open itself (the coordinator signs
    # it and spends no rpc on it) and open() waits for it: a node's refusal is open()'s
    # error. False: the coordinator sends it without waiting, open() returns a round trip
    # sooner, and a refusal comes with the first data call (OpenFailed / PrefixEvicted).
    worker_opens: bool = True
    # Open and Close on the coordinator's framed port when it advertises one (protos/framed_client.py:
    # the same calls without gRPC's per-call cost); gRPC carries them when it cannot be reached.
    coordinator_frames: bool = True
    # An open whose prompt another worker's open is computing on the same node right now
    # (CoordOpenResponse.num_pending_tokens) opens again once those blocks are cached,
    # waiting at most this long, instead of computing them a second time. 0 (the default):
    # never waits. Worth it where workers start alike (the demo sets 2 s).
    await_in_flight_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.await_in_flight_s >= 0:
            raise InvalidArgument(f"await_in_flight_s must be >= 0, got {self.await_in_flight_s}")
        if self.deadline_s <= 0:
            raise InvalidArgument(f"deadline_s must be positive, got {self.deadline_s}")
        if not 1 <= self.max_attempts <= 5:
            raise InvalidArgument(f"max_attempts must be in [1, 5], got {self.max_attempts}")
        if self.chunk_bytes <= 0:
            raise InvalidArgument(f"chunk_bytes must be positive, got {self.chunk_bytes}")
        if self.bulk_min_bytes is not None and self.bulk_min_bytes < 0:
            raise InvalidArgument(f"bulk_min_bytes must be >= 0 or None, got {self.bulk_min_bytes}")
        names = tuple(self.transports)
        unknown = [n for n in names if n not in TRANSPORTS]
        if unknown or len(set(names)) != len(names) or not names or names[-1] != "grpc":
            raise InvalidArgument(
                f"transports must be distinct names of {TRANSPORTS} ending with 'grpc', got {names}"
            )

    def data_transports(self) -> tuple[str, ...]:
        """The transports data calls take (gRPC alone when bulk_min_bytes is None)."""
        return ("grpc",) if self.bulk_min_bytes is None else self.transports

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
            *(self.tls.channel_options() if self.tls is not None else ()),
        ]
