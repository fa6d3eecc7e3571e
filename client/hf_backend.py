"""The seam between the transformers integration and a cache node: the few calls it makes.

`KVBackend` is what `PagedKVCache` needs from a node, and nothing more. Two thin adapters implement it:

- `GrpcBackend` -- the product path: a worker process talking gRPC to a node (`NodeControl` for the
  sequence lifecycle, `NodeData` for the per-layer data calls).
- `EngineBackend` -- an in-process `CacheEngine`, for fast unit tests and single-process demos. It
  is duck-typed (it never imports `cache_node`: the client package must not depend on it).

Data calls per forward (B rows, L layers):

    decode (1 new token per row)   L calls  -- `attend_decode`, one per layer for the whole batch
    prefill (n_b new tokens)       L calls  -- `attend_prefill_batch`, one AttendPrefillBatch rpc
                                               per layer for all B rows (per node the rows span)
    gathered-KV mode               B `read_kv` + B `append` per forward (K/V cross the wire)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..protos.attention import LayerAttention
from ..protos.errors import Unavailable
from ..protos.spec import ModelSpec
from .config import ClientConfig


class KVBackend(Protocol):
    """One cache node, as the transformers integration sees it.

    Every method may raise a pagedkv domain error (pagedkv.protos.errors); a failed call leaves the
    node as it was. `token_ids` are Python ints; tensors are on the CPU in the node's dtype.
    """

    spec: ModelSpec

    def open(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        max_cached_tokens: int,
        *,
        attention: Sequence[LayerAttention] = (),
    ) -> int:
        """Create `seq_id` holding the longest cached prefix of `token_ids` (whole blocks, at most
        `max_cached_tokens`). Returns the number of tokens it starts with. `attention`: one entry
        per layer (windows, chunks, soft-cap), which every attend of the sequence and its forks
        follows; () for plain causal attention."""
        ...

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of `token_ids` cached on the node. Changes nothing."""
        ...

    def fork(self, parent_id: str, child_id: str) -> None:
        """`child_id` shares every block of `parent_id` (copy-on-write)."""
        ...

    def free(self, seq_id: str) -> None:
        """Release `seq_id`; its full blocks stay cached for later prefix hits."""
        ...

    def attend_decode(
        self,
        seq_ids: Sequence[str],
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        token_ids: Sequence[int] | None,
        *,
        with_lse: bool = False,
    ) -> Any:
        """Append one token per sequence (k, v [B, Hk, D]; `token_ids` at layer 0 only) and attend
        q [B, Hq, D] over each whole sequence. Returns out [B, Hq, D]; with `with_lse`, the
        pair (out, lse [B, Hq] float32, natural log of the sum of exp(scaled scores))."""
        ...

    def attend_prefill_batch(
        self,
        seq_ids: Sequence[str],
        layer: int,
        qs: Sequence[torch.Tensor],
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[int]] | None,
        *,
        with_lse: bool = False,
    ) -> Any:
        """For each sequence i: append n_i tokens (ks[i], vs[i] [n_i, Hk, D]; token ids at layer 0
        only) and attend qs[i] [n_i, Hq, D] causally. Returns the outputs [n_i, Hq, D]; with
        `with_lse`, the pair (outputs, LSEs [n_i, Hq])."""
        ...

    def append(self, seq_id: str, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append n tokens with K, V for every layer: [num_layers, n, Hk, D]."""
        ...

    def read_kv(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the whole sequence, each [num_layers, len, Hk, D]. Changes nothing."""
        ...


_QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_Rows = tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor, "list[int] | None"]


class _BatchedAttention:
    """The two attend calls of KVBackend, written once over what each backend sends: `_decode`
    (one token per sequence: q, k, v) and `_prefill` (the rows concatenated: counts, q, k, v, ids),
    each returning a result with `.out` and `.lse`."""

    def _decode(self, seq_ids: Sequence[str], layer: int, qkv: _QKV, token_ids: Sequence[int] | None) -> Any:
        raise NotImplementedError

    def _prefill(self, seq_ids: Sequence[str], layer: int, rows: _Rows) -> Any:
        raise NotImplementedError

    def attend_decode(
        self,
        seq_ids: Sequence[str],
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        token_ids: Sequence[int] | None,
        *,
        with_lse: bool = False,
    ) -> Any:
        """KVBackend.attend_decode."""
        res = self._decode(seq_ids, layer, (q, k, v), token_ids)
        return (res.out, res.lse) if with_lse else res.out

    def attend_prefill_batch(
        self,
        seq_ids: Sequence[str],
        layer: int,
        qs: Sequence[torch.Tensor],
        ks: Sequence[torch.Tensor],
        vs: Sequence[torch.Tensor],
        token_ids: Sequence[Sequence[int]] | None,
        *,
        with_lse: bool = False,
    ) -> Any:
        """KVBackend.attend_prefill_batch: one call for every row."""
        rows = _concat_rows(qs, ks, vs, token_ids)
        res = self._prefill(seq_ids, layer, rows)
        return _split_rows(res.out, res.lse, rows[0], with_lse)


class EngineBackend(_BatchedAttention):
    """KVBackend over an in-process CacheEngine (anything with its methods)."""

    def __init__(self, engine: Any, salt: bytes = b"") -> None:
        self.engine = engine
        self.spec: ModelSpec = engine.spec
        self.salt = salt

    def open(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        max_cached_tokens: int,
        *,
        attention: Sequence[LayerAttention] = (),
    ) -> int:
        res = self.engine.open(seq_id, list(token_ids), self.salt, max_cached_tokens, attention=attention)
        return int(res.num_cached_tokens)

    def lookup(self, token_ids: Sequence[int]) -> int:
        return self.engine.lookup(list(token_ids), self.salt)

    def fork(self, parent_id: str, child_id: str) -> None:
        self.engine.fork(parent_id, child_id)

    def free(self, seq_id: str) -> None:
        self.engine.free(seq_id)

    def _decode(self, seq_ids: Sequence[str], layer: int, qkv: _QKV, token_ids: Sequence[int] | None) -> Any:
        return self.engine.attend_decode(list(seq_ids), layer, *qkv, token_ids)

    def _prefill(self, seq_ids: Sequence[str], layer: int, rows: _Rows) -> Any:
        return self.engine.attend_prefill_batch(list(seq_ids), layer, *rows)

    def append(self, seq_id: str, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self.engine.append(seq_id, list(token_ids), k, v)

    def read_kv(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.engine.read_kv(seq_id)

    def stats(self) -> dict[str, int]:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def close(self) -> None:
        """Nothing to release: the engine belongs to the caller."""


class GrpcBackend(_BatchedAttention):
    """KVBackend over gRPC, through a CacheClient: a cluster (`coordinator=`, the coordinator
    places each row's sequence and the data calls go to its node; a decode batch spanning nodes
    is one RPC per node) or one node (`address`). `close()` gives the channels back."""

    def __init__(
        self,
        address: str | None = None,
        config: ClientConfig | None = None,
        *,
        coordinator: str | None = None,
        token: str | None = None,
        spec: ModelSpec | None = None,
        max_extent_tokens: int | None = None,
    ) -> None:
        """max_extent_tokens: each row's sequence continues on another node past this many
        tokens on one (a cluster; client/sequence.py), as it does when its node is full,
        sliding windows and chunks included (each extent's node counts the sequence's positions)."""
        from .sync import CacheClient  # the in-process path never loads the gRPC stubs

        self.client = CacheClient(address, config, coordinator=coordinator, token=token, spec=spec)
        if spec is None:
            if self.client.is_cluster:
                nodes = self.client.cluster_stats().nodes
                if not nodes:
                    raise Unavailable(f"no live cache node behind coordinator {coordinator}")
                spec = nodes[0].spec
            else:
                spec = self.client.stats().spec
        self.spec = spec
        self.max_extent_tokens = max_extent_tokens
        self._seqs: dict[str, Any] = {}
        self._closed = False

    def open(
        self,
        seq_id: str,
        token_ids: Sequence[int],
        max_cached_tokens: int,
        *,
        attention: Sequence[LayerAttention] = (),
    ) -> int:
        seq = self.client.open(
            seq_id,
            list(token_ids),
            max_cached_tokens=max_cached_tokens,
            attention=attention,
            max_extent_tokens=self.max_extent_tokens,
        )
        self._seqs[seq_id] = seq
        return seq.num_cached_tokens

    def lookup(self, token_ids: Sequence[int]) -> int:
        return self.client.lookup(list(token_ids))

    def fork(self, parent_id: str, child_id: str) -> None:
        self._seqs[child_id] = self._seqs[parent_id].fork(child_id)

    def free(self, seq_id: str) -> None:
        self._seqs.pop(seq_id).close()

    def _decode(self, seq_ids: Sequence[str], layer: int, qkv: _QKV, token_ids: Sequence[int] | None) -> Any:
        return self.client.attend_batch([self._seqs[s] for s in seq_ids], layer, *qkv, token_ids)

    def _prefill(self, seq_ids: Sequence[str], layer: int, rows: _Rows) -> Any:
        return self.client.attend_prefill_batch([self._seqs[s] for s in seq_ids], layer, *rows)

    def append(self, seq_id: str, token_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        self._seqs[seq_id].append(list(token_ids), k, v)

    def read_kv(self, seq_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self._seqs[seq_id].read_kv()

    def stats(self) -> dict[str, int]:
        """The node's counters; in a cluster, summed over every live node."""
        if not self.client.is_cluster:
            return self.client.stats().counters
        total: dict[str, int] = {}
        for node in self.client.cluster_stats().nodes:
            for key, value in self.client.node_stats(node.address).counters.items():
                total[key] = total.get(key, 0) + value
        return total

    def check_integrity(self) -> None:
        self.client.check_integrity()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()

    def __enter__(self) -> GrpcBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _concat_rows(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    token_ids: Sequence[Sequence[int]] | None,
) -> _Rows:
    """Per-sequence prefill rows -> (counts, q, k, v, token ids) concatenated in order, the
    layout of one AttendPrefillBatch (no copy when the rows are adjacent views, see join_rows)."""
    counts = [q.shape[0] for q in qs]
    tokens = None if token_ids is None else [t for row in token_ids for t in row]
    return counts, join_rows(qs), join_rows(ks), join_rows(vs), tokens


def _split_rows(out: torch.Tensor, lse: torch.Tensor, counts: list[int], with_lse: bool) -> Any:
    """One AttendPrefillBatch result back into per-sequence rows (views, no copy)."""
    outs = list(out.split(counts))
    return (outs, list(lse.split(counts))) if with_lse else outs


def join_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(rows) along dim 0, without the copy when the rows already lie back to back in
    one buffer: a batch's rows are usually views of one transposed tensor on the way out and
    slices of one decoded output on the way back (a prefill batch copies each once, not twice)."""
    first = rows[0]
    if len(rows) == 1:
        return first
    if not first.is_contiguous():
        return torch.cat(list(rows))
    tail = first.shape[1:]
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for row in rows:
        if (
            row.shape[1:] != tail
            or row.dtype != first.dtype
            or not row.is_contiguous()
            or row.untyped_storage().data_ptr() != storage
            or row.storage_offset() != offset
        ):
            return torch.cat(list(rows))
        offset += row.numel()
    total = sum(row.shape[0] for row in rows)
    return first.as_strided((total, *tail), first.stride(), first.storage_offset())
