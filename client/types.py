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
class MissExplanation:
    """Why an open's first prompt block that its node does not serve from its device missed it
    (asked with `open(..., explain_miss=True)`; the coordinator's reasons, coordinator/misses.py):
    reason is one of none, host_tier, in_flight, other_node, evicted, not_cached; first_block
    that block's index; node_id / policy the node (and its eviction policy) the reason names."""

    reason: str
    first_block: int
    node_id: str = ""
    policy: str = ""
    cached_elsewhere_blocks: int = 0


@dataclass(frozen=True)
class OpenResult:
    num_cached_tokens: int
    num_host_hit_tokens: int
    miss: MissExplanation | None = None


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
class ExtentRoute:
    """One extent of a sequence: its node's route and the first token it holds (it holds
    tokens [first_token, the next extent's first_token); the last extent, the tail, takes
    appends)."""

    route: Route
    first_token: int


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
