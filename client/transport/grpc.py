"""The gRPC transport: every data call as the node's rpc (the contract, and the
last rung of every fallback, so it carries every call). Each call carries the
wallet's credentials for the sequences it names as metadata."""

from __future__ import annotations

from typing import Any

import grpc

from ...protos import pagedkv_pb2 as pb
from ...protos import pagedkv_pb2_grpc as pb_grpc
from ...protos.status import error_from_rpc
from .. import codec
from ..config import ClientConfig
from ..control import call as unary
from ..types import AttentionResult, OpenResult
from .base import KV
from .calls import AppendCall, AttendCall, OpenCall, PrefillCall, ReadCall
from .tickets import Wallet


class Started:
    """An attend rpc in flight (its gRPC future): result() as the blocking call returns."""

    __slots__ = ("_future", "_where")

    def __init__(self, future: Any, where: str) -> None:
        self._future, self._where = future, where

    def result(self) -> AttentionResult:
        try:
            resp = self._future.result()
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self._where) from exc
        return codec.attention_result(resp)


class GrpcTransport:
    name = "grpc"

    def __init__(
        self, stub: pb_grpc.CacheNodeStub, config: ClientConfig, where: str, wallet: Wallet | None = None
    ) -> None:
        self.stub, self.config, self.where = stub, config, where
        self.wallet = wallet or Wallet()

    def stats(self, timeout_s: float) -> pb.StatsResponse:
        return unary(self.stub.Stats, pb.Empty(), timeout_s, where=self.where)

    def open(self, call: OpenCall, timeout_s: float) -> OpenResult:
        req = codec.open_request(
            call.seq_id, call.token_ids.tolist(), call.salt, call.max_cached_tokens, call.attention
        )
        meta = self.wallet.metadata(())
        return codec.open_result(unary(self.stub.Open, req, timeout_s, meta, self.where))

    def append(self, call: AppendCall, timeout_s: float) -> int:
        ids = call.token_ids.tolist()
        chunks = codec.append_chunks(call.seq_id, ids, call.k, call.v, self.config.chunk_bytes)
        meta = self.wallet.metadata((call.seq_id,))
        return int(unary(self.stub.Append, chunks, timeout_s, meta, self.where).num_tokens)

    def attend(self, call: AttendCall, timeout_s: float) -> AttentionResult:
        rpc, req, meta = self._attend(call)
        return codec.attention_result(unary(rpc, req, timeout_s, meta, self.where))

    def start_attend(self, call: AttendCall, timeout_s: float) -> Started:
        rpc, req, meta = self._attend(call)
        return Started(rpc.future(req, timeout=timeout_s, metadata=meta), self.where)

    def _attend(self, call: AttendCall) -> tuple[Any, Any, Any]:
        """The rpc an AttendCall takes, its request and metadata."""
        tokens = None if call.token_ids is None else call.token_ids.tolist()
        meta = self.wallet.metadata(call.seq_ids)
        if call.is_prefill_batch:
            req = codec.prefill_batch_request(
                call.seq_ids, call.layer, call.num_tokens, call.q, call.k, call.v, tokens
            )
            return self.stub.AttendPrefillBatch, req, meta
        req = codec.attend_request(
            call.seq_ids, call.layer, call.q, call.k, call.v, tokens, call.return_block_mass, call.num_tokens
        )
        return self.stub.Attend, req, meta

    def attend_prefill(self, call: PrefillCall, timeout_s: float) -> AttentionResult:
        req, meta = self._prefill(call)
        return codec.attention_result(unary(self.stub.AttendPrefill, req, timeout_s, meta, self.where))

    def start_attend_prefill(self, call: PrefillCall, timeout_s: float) -> Started:
        req, meta = self._prefill(call)
        return Started(self.stub.AttendPrefill.future(req, timeout=timeout_s, metadata=meta), self.where)

    def _prefill(self, call: PrefillCall) -> tuple[Any, Any]:
        req = codec.prefill_request(
            call.seq_id,
            call.layer,
            call.q,
            call.k,
            call.v,
            call.token_ids,
            call.return_block_mass,
            call.query_position,
        )
        return req, self.wallet.metadata((call.seq_id,))

    def read_kv(self, call: ReadCall, timeout_s: float) -> KV:
        req = codec.read_kv_request(call.seq_id, call.start, call.end, self.config.chunk_bytes)
        stream = self.stub.ReadKV(req, timeout=timeout_s, metadata=self.wallet.metadata((call.seq_id,)))
        try:
            return codec.kv_from_chunks(stream, call.out)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.where) from exc
        except BaseException:
            stream.cancel()  # a refused `out`: the node stops streaming
            raise

    def connect(self, timeout_s: float) -> None:
        pass  # the client pings the node's channel itself (CacheClient.connect)

    def close(self) -> None:
        pass  # the channel is shared (client/channels.py): its owner releases it
