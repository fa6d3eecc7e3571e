"""Data calls, straight to the node that holds the blocks: append KV, attend,
read KV. Many per token, so they stay lean: one RPC per layer per decode step
for a whole batch, tensors as raw bytes, big payloads streamed in chunks.

KV ranges of at least `config.bulk_min_bytes` go over the node's bulk TCP
channel (client/bulk.py) when the node advertises one (Stats.bulk_port, asked
once per node); otherwise, or when it cannot be reached, over the Append /
ReadKV rpcs. The per-step calls Attend and AttendPrefillBatch take the channel
at any size (gRPC-Python costs ~1 ms a call on a small host, the channel a
fraction of that), with the rpcs as the fallback; so does a direct-mode Open
(`open`: every request pays one before its first token); `bulk_min_bytes=None`
keeps every call on gRPC. On the node's host the channel itself prefers its
same-host path (client/shm.py: shared memory for the per-step calls, a Unix
socket for KV ranges), negotiated per node; the routing here does not change.
The asyncio client runs a bulk call in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from typing import Any

import grpc
import torch

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos import tensors
from ..protos.errors import PagedKVError
from ..protos.status import error_from_rpc
from ..protos.wire import OP_ATTEND, OP_ATTEND_PREFILL_BATCH
from . import codec
from .bulk import BulkChannel, BulkUnavailable
from .config import ClientConfig
from .control import acall, call
from .types import AttentionResult, OpenResult

_EMPTY = pb.Empty()


class _BulkRoute:
    """Which transfers take the bulk channel of one node (`address`: its gRPC host:port)."""

    def __init__(self, config: ClientConfig, where: str, address: str) -> None:
        use = bool(address) and config.bulk_min_bytes is not None
        self.bulk = BulkChannel(address, where) if use else None
        self.min_bytes = config.bulk_min_bytes or 0
        self.bytes_per_token = 0

    def learn(self, resp: pb.StatsResponse) -> None:
        assert self.bulk is not None
        self.bulk.port, self.bytes_per_token = codec.bulk_info(resp)

    def wants(self, num_bytes: int | None, *, any_size: bool = False) -> bool:
        """True when a transfer of num_bytes (None: unknown, a read to the end;
        any_size: a per-step data call) should try the bulk channel, once the
        port is known."""
        return bool(
            self.bulk is not None
            and self.bulk.port
            and (any_size or num_bytes is None or num_bytes >= self.min_bytes)
        )

    def may_try(self, num_bytes: int | None, *, any_size: bool = False) -> bool:
        """False when a transfer of num_bytes goes to gRPC without asking the node: no
        channel, one backing off after a failed connect, or a transfer under min_bytes."""
        is_small = not any_size and num_bytes is not None and num_bytes < self.min_bytes
        return self.bulk is not None and not self.bulk.is_backing_off and not is_small

    def read_bytes(self, start: int, end: int | None) -> int | None:
        return None if end is None else max(0, end - start) * self.bytes_per_token

    def close(self) -> None:
        if self.bulk is not None:
            self.bulk.close()


class _NodeDataBase:
    """What the sync and asyncio data handles of one node share."""

    def __init__(
        self, stub: pb_grpc.CacheNodeStub, config: ClientConfig, where: str = "", address: str = ""
    ) -> None:
        self.stub, self.config = stub, config
        self.where = where  # names the node in error messages
        self.route = _BulkRoute(config, where, address)

    def close(self) -> None:
        self.route.close()

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s


class NodeData(_NodeDataBase):
    def _bulk(self, num_bytes: int | None, timeout_s: float, *, any_size: bool = False) -> BulkChannel | None:
        """The bulk channel for a transfer of num_bytes (any_size: a per-step data
        call, whatever its size), or None (use gRPC)."""
        r = self.route
        if not r.may_try(num_bytes, any_size=any_size):
            return None
        assert r.bulk is not None
        if r.bulk.port is None:
            try:
                r.learn(call(self.stub.Stats, _EMPTY, timeout_s, where=self.where))
            except PagedKVError:
                return None  # the rpc path will say what is wrong
        return r.bulk if r.wants(num_bytes, any_size=any_size) else None

    def bulk_channel(self, timeout_s: float | None = None) -> BulkChannel | None:
        """The channel the per-step calls take (the node's port learned first), or
        None when the node has none or the config keeps every call on gRPC."""
        return self._bulk(None, self._t(timeout_s), any_size=True)

    def connect(self, timeout_s: float | None = None) -> None:
        """The bulk channel's connections opened now (BulkChannel.connect); nothing
        without a channel."""
        bulk = self.bulk_channel(timeout_s)
        if bulk is not None:
            bulk.connect(self._t(timeout_s))

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None = None,
    ) -> OpenResult:
        """Open seq_id on this node with the client's own tenant salt (direct mode: no
        coordinator). Over the bulk channel when the node has one, whatever the prompt's
        size, else (or when the node has no bulk OPEN) the Open rpc: same result, same
        errors."""
        salt = self.config.tenant_salt
        bulk = self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return bulk.open(seq_id, token_ids, salt, max_cached_tokens, self._t(timeout_s))
            except BulkUnavailable:
                pass
        req = codec.open_request(seq_id, token_ids, salt, max_cached_tokens)
        return codec.open_result(call(self.stub.Open, req, self._t(timeout_s), where=self.where))

    def append(
        self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float | None = None
    ) -> int:
        bulk = self._bulk(codec.kv_bytes(k, v), self._t(timeout_s))
        if bulk is not None:
            try:
                return bulk.append(seq_id, token_ids, k, v, self._t(timeout_s))
            except BulkUnavailable:
                pass
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
        bulk = self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return bulk.attend(
                    OP_ATTEND, seq_ids, layer, q, k, v, token_ids,
                    return_block_mass=return_block_mass, timeout_s=self._t(timeout_s),
                )  # fmt: skip
            except BulkUnavailable:
                pass
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
        bulk = self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return bulk.attend(
                    OP_ATTEND_PREFILL_BATCH, seq_ids, layer, q, k, v, token_ids, num_tokens,
                    timeout_s=self._t(timeout_s),
                )  # fmt: skip
            except BulkUnavailable:
                pass
        req = prefill_batch_request(seq_ids, layer, num_tokens, q, k, v, token_ids)
        return codec.attention_result(
            call(self.stub.AttendPrefillBatch, req, self._t(timeout_s), where=self.where)
        )

    def read_kv(
        self,
        seq_id: str,
        start: int = 0,
        end: int | None = None,
        timeout_s: float | None = None,
        out: codec.KVOut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = codec.check_kv_out(out)
        if self.route.bulk is not None:
            bulk = self._bulk(None, self._t(timeout_s))
            if bulk is not None and self.route.wants(self.route.read_bytes(start, end)):
                try:
                    return bulk.read_kv(seq_id, start, end, self._t(timeout_s), out)
                except BulkUnavailable:
                    pass
        req = codec.read_kv_request(seq_id, start, end, self.config.chunk_bytes)
        stream = self.stub.ReadKV(req, timeout=self._t(timeout_s))
        try:
            return codec.kv_from_chunks(stream, out)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.where) from exc
        except BaseException:
            stream.cancel()  # a refused `out`: the node stops streaming
            raise


class AsyncNodeData(_NodeDataBase):
    async def _bulk(
        self, num_bytes: int | None, timeout_s: float, *, any_size: bool = False
    ) -> BulkChannel | None:
        r = self.route
        if not r.may_try(num_bytes, any_size=any_size):
            return None
        assert r.bulk is not None
        if r.bulk.port is None:
            try:
                r.learn(await acall(self.stub.Stats, _EMPTY, timeout_s, where=self.where))
            except PagedKVError:
                return None
        return r.bulk if r.wants(num_bytes, any_size=any_size) else None

    async def connect(self, timeout_s: float | None = None) -> None:
        """The bulk channel's connections opened now (BulkChannel.connect, on a worker
        thread); nothing without a channel."""
        bulk = await self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            await asyncio.to_thread(bulk.connect, self._t(timeout_s))

    async def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None = None,
    ) -> OpenResult:
        """See NodeData.open; the bulk call runs in a worker thread."""
        salt = self.config.tenant_salt
        bulk = await self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return await asyncio.to_thread(
                    bulk.open, seq_id, token_ids, salt, max_cached_tokens, self._t(timeout_s)
                )
            except BulkUnavailable:
                pass
        req = codec.open_request(seq_id, token_ids, salt, max_cached_tokens)
        return codec.open_result(await acall(self.stub.Open, req, self._t(timeout_s), where=self.where))

    async def append(
        self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float | None = None
    ) -> int:
        bulk = await self._bulk(codec.kv_bytes(k, v), self._t(timeout_s))
        if bulk is not None:
            try:
                return await asyncio.to_thread(bulk.append, seq_id, token_ids, k, v, self._t(timeout_s))
            except BulkUnavailable:
                pass
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
        bulk = await self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return await asyncio.to_thread(
                    functools.partial(
                        bulk.attend, OP_ATTEND, seq_ids, layer, q, k, v, token_ids,
                        return_block_mass=return_block_mass, timeout_s=self._t(timeout_s),
                    )
                )  # fmt: skip
            except BulkUnavailable:
                pass
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
        bulk = await self._bulk(None, self._t(timeout_s), any_size=True)
        if bulk is not None:
            try:
                return await asyncio.to_thread(
                    functools.partial(
                        bulk.attend, OP_ATTEND_PREFILL_BATCH, seq_ids, layer, q, k, v, token_ids,
                        num_tokens, timeout_s=self._t(timeout_s),
                    )
                )  # fmt: skip
            except BulkUnavailable:
                pass
        req = prefill_batch_request(seq_ids, layer, num_tokens, q, k, v, token_ids)
        return codec.attention_result(
            await acall(self.stub.AttendPrefillBatch, req, self._t(timeout_s), where=self.where)
        )

    async def read_kv(
        self,
        seq_id: str,
        start: int = 0,
        end: int | None = None,
        timeout_s: float | None = None,
        out: codec.KVOut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = codec.check_kv_out(out)
        if self.route.bulk is not None:
            bulk = await self._bulk(None, self._t(timeout_s))
            if bulk is not None and self.route.wants(self.route.read_bytes(start, end)):
                try:
                    return await asyncio.to_thread(bulk.read_kv, seq_id, start, end, self._t(timeout_s), out)
                except BulkUnavailable:
                    pass
        req = codec.read_kv_request(seq_id, start, end, self.config.chunk_bytes)
        reader = codec.KVReader(out)
        stream = self.stub.ReadKV(req, timeout=self._t(timeout_s))
        try:
            async for chunk in stream:
                reader.add(chunk)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.where) from exc
        except BaseException:
            stream.cancel()  # a refused `out`: the node stops streaming
            raise
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
