"""Small result types the client returns (torch tensors inside)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..protos.spec import ModelSpec


@dataclass(frozen=True)
class AttentionResult:
    """out [B or n, q_heads, D] in q's dtype; lse [B or n, q_heads] float32 (natural
    log, for merging partial results across nodes); block_mass only when asked."""

    out: torch.Tensor
    lse: torch.Tensor
    block_mass: torch.Tensor | None = None


@dataclass(frozen=True)
class OpenResult:
    num_cached_tokens: int
    num_host_hit_tokens: int


@dataclass(frozen=True)
class NodeStats:
    counters: dict[str, int]
    spec: ModelSpec
    device: str
    policy: str


@dataclass(frozen=True)
class Route:
    """Where a sequence's blocks live: the node its data calls go to (what routes
    compare), with the id that node knows it by ("": the worker's own) and the
    ticket its calls present there (b"": none needed)."""

    node_id: str
    address: str
    node_seq_id: str = field(default="", compare=False)
    ticket: bytes = field(default=b"", repr=False, compare=False)  # a credential, not a place


@dataclass(frozen=True)
class NodeEntry:
    node_id: str
    address: str
    spec: ModelSpec
    num_blocks: int


@dataclass(frozen=True)
class ClusterStats:
    counters: dict[str, int]  # opens, prompt/cached tokens, nodes_live, nodes_reaped
    nodes: list[NodeEntry]
