"""EngineConfig: one node's pool size, policy and device, validated once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec
from .eviction import POLICIES

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class EngineConfig:
    spec: ModelSpec
    num_blocks: int
    num_host_blocks: int = 0
    policy: str = "lru"
    device: str = ""  # "" picks CUDA when present, else CPU
    enable_prefix_caching: bool = True
    # A data call may overtake the coordinator's asynchronous node Open (different
    # connections): an unknown sequence id waits this long for its open before NOT_FOUND.
    unknown_seq_grace_s: float = 0.5
    max_tombstones: int = 4096  # failed asynchronous opens remembered for their first data call
    # Run every public method (and make the pool) on one thread of the engine's own: a node
    # process keeps one torch thread pool (compute_thread.py). close() stops it.
    compute_thread: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ModelSpec):
            raise InvalidArgument(f"EngineConfig.spec must be a ModelSpec, got {type(self.spec).__name__}")
        if self.num_blocks <= 0:
            raise InvalidArgument(f"EngineConfig.num_blocks must be positive, got {self.num_blocks}")
        if self.num_host_blocks < 0:
            raise InvalidArgument(f"EngineConfig.num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.policy not in POLICIES:
            raise InvalidArgument(
                f"unknown eviction policy {self.policy!r}; choose one of {sorted(POLICIES)}"
            )
        if not 0 <= self.unknown_seq_grace_s <= 60:
            raise InvalidArgument(f"unknown_seq_grace_s must be in [0, 60], got {self.unknown_seq_grace_s}")
        if self.max_tombstones < 1:
            raise InvalidArgument(f"max_tombstones must be >= 1, got {self.max_tombstones}")
