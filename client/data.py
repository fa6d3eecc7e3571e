"""Data calls, straight to the node that holds the blocks: append KV, attend,
read KV. Many per token, so they stay lean: one RPC per layer per decode step
for a whole batch, tensors as raw bytes, big payloads streamed in chunks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import torch

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos import tensors
from ..protos.status import error_from_rpc
from . import codec
from .config import ClientConfig
from .control import acall, call
from .types import AttentionResult


class NodeData:
    def __init__(self, stub: pb_grpc.CacheNodeStub, config: ClientConfig, where: str = "") -> None:
        self.stub, self.config = stub, config
        self.where = where  # names the node in error messages

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s

    def append(
        self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float | None = None
    ) -> int:
        chunks = codec.append_chunks(seq_id, token_ids, k, v, self.config.chunk_bytes)
        return call(self.stub.Append, chunks, self._t(timeout_s), where=self.where).num_tokens

    def attend(
        self,
        seq_ids: Sequence[str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = codec.attend_request(seq_ids, layer, q, k, v, token_ids, return_block_mass)
        return codec.attention_result(call(self.stub.Attend, req, self._t(timeout_s), where=self.where))

    def attend_prefill(
        self,
        seq_id: str,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = codec.prefill_request(seq_id, layer, q, k, v, token_ids, return_block_mass)
        return codec.attention_result(
            call(self.stub.AttendPrefill, req, self._t(timeout_s), where=self.where)
        )

    def attend_prefill_batch(
        self,
        seq_ids: Sequence[str],
        layer: int,
        num_tokens: Sequence[int],
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = prefill_batch_request(seq_ids, layer, num_tokens, q, k, v, token_ids)
        return codec.attention_result(
            call(self.stub.AttendPrefillBatch, req, self._t(timeout_s), where=self.where)
        )

    def read_kv(
        self, seq_id: str, start: int = 0, end: int | None = None, timeout_s: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        req = codec.read_kv_request(seq_id, start, end, self.config.chunk_bytes)
        try:
            return codec.kv_from_chunks(self.stub.ReadKV(req, timeout=self._t(timeout_s)))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.where) from exc


class AsyncNodeData:
    def __init__(self, stub: pb_grpc.CacheNodeStub, config: ClientConfig, where: str = "") -> None:
        self.stub, self.config = stub, config
        self.where = where  # names the node in error messages

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s

    async def append(
        self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float | None = None
    ) -> int:
        chunks = codec.append_chunks(seq_id, token_ids, k, v, self.config.chunk_bytes)
        return (await acall(self.stub.Append, chunks, self._t(timeout_s), where=self.where)).num_tokens

    async def attend(
        self,
        seq_ids: Sequence[str],
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = codec.attend_request(seq_ids, layer, q, k, v, token_ids, return_block_mass)
        return codec.attention_result(
            await acall(self.stub.Attend, req, self._t(timeout_s), where=self.where)
        )

    async def attend_prefill(
        self,
        seq_id: str,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = codec.prefill_request(seq_id, layer, q, k, v, token_ids, return_block_mass)
        return codec.attention_result(
            await acall(self.stub.AttendPrefill, req, self._t(timeout_s), where=self.where)
        )

    async def attend_prefill_batch(
        self,
        seq_ids: Sequence[str],
        layer: int,
        num_tokens: Sequence[int],
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        req = prefill_batch_request(seq_ids, layer, num_tokens, q, k, v, token_ids)
        return codec.attention_result(
            await acall(self.stub.AttendPrefillBatch, req, self._t(timeout_s), where=self.where)
        )

    async def read_kv(
        self, seq_id: str, start: int = 0, end: int | None = None, timeout_s: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        req = codec.read_kv_request(seq_id, start, end, self.config.chunk_bytes)
        reader = codec.KVReader()
        try:
            async for chunk in self.stub.ReadKV(req, timeout=self._t(timeout_s)):
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.where) from exc
        return reader.result()


def prefill_batch_request(
    seq_ids: Sequence[str],
    layer: int,
    num_tokens: Sequence[int],
    q: Any,
    k: Any,
    v: Any,
    token_ids: codec.TokenIds | None,
) -> pb.AttendPrefillBatchRequest:
    """AttendPrefillBatch: sequence i owns the next num_tokens[i] rows of q, k, v, token_ids."""
    req = pb.AttendPrefillBatchRequest(
        seq_ids=list(seq_ids),
        layer=layer,
        num_tokens=[int(n) for n in num_tokens],
        token_ids=codec.token_list(token_ids),
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None:
            getattr(req, name).CopyFrom(tensors.encode(t, name))
    return req
