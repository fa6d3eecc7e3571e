"""CacheClient: the synchronous user-facing API, and its Sequence handle.

    with CacheClient("node:50051") as client:
        with client.open("req-1", prompt_ids) as seq:      # reuses the cached prefix
            seq.append(prompt_ids[seq.num_cached_tokens:], k, v)  # [layers, n, kv_heads, D]
            out = seq.attend(layer, q, k_new, v_new, token_id)     # one decode step, one layer
        # closing the sequence frees it on the node

A decode step for many sequences on one node is one RPC per layer:
`client.attend_batch(seqs, layer, q, k, v, token_ids)`.

Control calls (NodeControl) and data calls (NodeData) are separate objects, so
the coordinator can take over the control path without changing this API.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from ..protos import pagedkv_pb2_grpc as pb_grpc
from . import channels, codec
from .config import ClientConfig
from .control import NodeControl
from .data import NodeData
from .types import AttentionResult, NodeStats


def _squeeze(res: AttentionResult, squeeze: bool) -> AttentionResult:
    if not squeeze:
        return res
    mass = res.block_mass[0] if res.block_mass is not None else None
    return AttentionResult(res.out[0], res.lse[0], mass)


def _as_batch(t: Any, ndim: int) -> tuple[Any, bool]:
    """A single sequence's [heads, D] tensor as a batch of one."""
    if t is not None and getattr(t, "ndim", 0) == ndim - 1:
        return t[None], True
    return t, False


class Sequence:
    """A handle on one sequence of the node; close() (or `with`) frees it."""

    def __init__(
        self, client: CacheClient, seq_id: str, num_cached_tokens: int = 0, num_host_hit_tokens: int = 0
    ) -> None:
        self.client = client
        self.seq_id = seq_id
        self.num_cached_tokens = num_cached_tokens
        self.num_host_hit_tokens = num_host_hit_tokens
        self.is_closed = False

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, cached={self.num_cached_tokens})"

    def append(self, token_ids: codec.TokenIds, k: Any, v: Any, *, timeout_s: float | None = None) -> int:
        """Append tokens with K/V of every layer ([num_layers, n, kv_heads, D]); returns the new length."""
        return self.client.data.append(self.seq_id, token_ids, k, v, timeout_s)

    def attend(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_id: int | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """One decode step of one layer: q [q_heads, D] (or [1, q_heads, D]); with k, v
        [kv_heads, D] the new token is appended first (token_id at layer 0)."""
        q, squeeze = _as_batch(q, 3)
        k, _ = _as_batch(k, 3)
        v, _ = _as_batch(v, 3)
        tokens = None if token_id is None else [token_id]
        res = self.client.data.attend(
            [self.seq_id], layer, q, k, v, tokens, return_block_mass=return_block_mass, timeout_s=timeout_s
        )
        return _squeeze(res, squeeze)

    def attend_prefill(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """n query tokens (q [n, q_heads, D]) attending causally to the cache and themselves."""
        return self.client.data.attend_prefill(
            self.seq_id, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
        )

    def fork(self, child_id: str, *, timeout_s: float | None = None) -> Sequence:
        """A new sequence sharing every block (copy-on-write of the partial last block)."""
        self.client.control.fork(self.seq_id, child_id, timeout_s)
        return Sequence(self.client, child_id)

    def read_kv(
        self, start: int = 0, end: int | None = None, *, timeout_s: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end): each [num_layers, n, kv_heads, D] (streamed)."""
        return self.client.data.read_kv(self.seq_id, start, end, timeout_s)

    def swap_out(self, *, timeout_s: float | None = None) -> int:
        return self.client.control.swap_out(self.seq_id, timeout_s)

    def swap_in(self, *, timeout_s: float | None = None) -> int:
        return self.client.control.swap_in(self.seq_id, timeout_s)

    def set_budget(
        self,
        max_tokens: int | None,
        sink_blocks: int = 1,
        recent_blocks: int = 4,
        *,
        timeout_s: float | None = None,
    ) -> None:
        self.client.control.set_budget(self.seq_id, max_tokens, sink_blocks, recent_blocks, timeout_s)

    def close(self, *, timeout_s: float | None = None) -> None:
        """Free the sequence on the node. Idempotent on this handle."""
        if not self.is_closed:
            self.client.control.free(self.seq_id, timeout_s)
            self.is_closed = True

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class CacheClient:
    """Synchronous client of one cache node (until the coordinator exists)."""

    def __init__(self, address: str, config: ClientConfig | None = None) -> None:
        self.address = address
        self.config = config if config is not None else ClientConfig()
        self._channel = channels.acquire(address, self.config)
        stub = pb_grpc.CacheNodeStub(self._channel)
        self.control = NodeControl(stub, self.config)
        self.data = NodeData(stub, self.config)
        self._is_closed = False

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        *,
        max_cached_tokens: int | None = None,
        timeout_s: float | None = None,
    ) -> Sequence:
        """Open a sequence reusing the longest cached prefix of the prompt
        (seq.num_cached_tokens); append the rest's KV next."""
        res = self.control.open(seq_id, token_ids, max_cached_tokens, timeout_s)
        return Sequence(self, seq_id, res.num_cached_tokens, res.num_host_hit_tokens)

    def sequence(self, seq_id: str) -> Sequence:
        """A handle on an existing sequence (no call)."""
        return Sequence(self, seq_id)

    def attend_batch(
        self,
        seqs: Seq[Sequence | str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """One decode step of one layer for a batch on this node, in one RPC:
        q [B, q_heads, D]; k, v [B, kv_heads, D]; token_ids [B] at layer 0."""
        ids = [s.seq_id if isinstance(s, Sequence) else s for s in seqs]
        return self.data.attend(
            ids, layer, q, k, v, token_ids, return_block_mass=return_block_mass, timeout_s=timeout_s
        )

    def lookup(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return self.control.lookup(token_ids, timeout_s)

    def pin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return self.control.pin(token_ids, timeout_s)

    def unpin(self, token_ids: codec.TokenIds, *, timeout_s: float | None = None) -> int:
        return self.control.unpin(token_ids, timeout_s)

    def stats(self, *, timeout_s: float | None = None) -> NodeStats:
        return self.control.stats(timeout_s)

    def check_integrity(self, *, timeout_s: float | None = None) -> None:
        """Raise IntegrityError with the node's message when an invariant fails."""
        self.control.check_integrity(timeout_s)

    def ping(self, *, timeout_s: float | None = None) -> None:
        self.control.ping(timeout_s)

    def close(self) -> None:
        """Give the shared channel back (closed when its last user closes)."""
        if not self._is_closed:
            self._is_closed = True
            channels.release(self.address, self.config)

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
