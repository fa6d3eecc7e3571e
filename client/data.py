"""Data calls, straight to the node that holds the blocks: open (direct mode),
append KV, attend, read KV. Many per token, so they stay lean: one call per layer
per decode step for a whole batch, tensors as raw bytes.

Each call's arguments are checked once (transport/calls.py), then carried by the
first of the node's transports that can (transport/base.py `Fallback`): on the
node's host its shared memory and Unix socket, then its bulk TCP port, then gRPC,
as `ClientConfig.transports` lists them. KV ranges under `config.bulk_min_bytes`
stay on gRPC. The asyncio client runs these same calls on its worker threads.
Sequence ids are translated to the node's (tenant-scoped in a cluster) and the
calls carry their tickets, both from the node's Wallet (transport/tickets.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import grpc
import torch

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos import tensors
from ..protos.errors import PagedKVError
from ..protos.status import error_from_rpc
from . import codec, shm
from .config import ClientConfig
from .control import call as unary
from .transport import calls
from .transport.base import Fallback, Reply, Rewritten, Transport, TransportUnavailable
from .transport.grpc import GrpcTransport
from .transport.link import BulkLink
from .transport.shm import ShmTransport
from .transport.socket import TcpTransport, UnixTransport
from .transport.tickets import Wallet
from .types import AttentionResult, OpenResult

SOCKET_TRANSPORTS: dict[str, Callable[[BulkLink], Transport]] = {
    "shm": ShmTransport,
    "unix": UnixTransport,
    "tcp": TcpTransport,
}
SAME_HOST = ("shm", "unix")
# what a cluster's routing says of a data call's error, given the call's sequence ids
Explain = Callable[[PagedKVError, Sequence[str]], PagedKVError]


class _Named(NamedTuple):
    """What the error explainer reads of a call: the node's id of its sequence."""

    seq_id: str


class _MassReply:
    """A BlockMass rpc in flight (its gRPC future); result() is the mass list."""

    __slots__ = ("_future", "_where")

    def __init__(self, future: Any, where: str) -> None:
        self._future, self._where = future, where

    def result(self) -> list[float]:
        try:
            return list(self._future.result().mass)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self._where) from exc


class NodeData:
    """The data calls to one node (`address`: its gRPC host:port)."""

    def __init__(
        self,
        stub: pb_grpc.CacheNodeStub,
        config: ClientConfig,
        where: str = "",
        address: str = "",
        wallet: Wallet | None = None,
        explain: Explain | None = None,
    ) -> None:
        """explain(exc, seq_ids): asked about every error a data call ended with, the
        worker's ids in it and the call's sequences (a cluster's: whether a sequence the
        node does not know, or cannot be reached for, was lost: routing.py)."""
        self.config = config
        self.where = where  # names the node in error messages
        self.wallet = wallet or Wallet()
        self._explain = explain
        self.grpc = GrpcTransport(stub, config, where, self.wallet)
        names = [n for n in config.data_transports() if n != "grpc"] if address else []
        if not shm.is_supported():
            names = [n for n in names if n not in SAME_HOST]
        self.bulk = (
            BulkLink(address, where, config.bulk_min_bytes or 0, self._learn_port, self.wallet, config.tls)
            if names
            else None
        )
        chosen: list[Transport] = [SOCKET_TRANSPORTS[n](self.bulk) for n in names]  # type: ignore[arg-type]
        self.transports = Fallback([*chosen, self.grpc], self._error)

    def _error(self, exc: PagedKVError, call: Any = None) -> PagedKVError:
        """A node's answer as the worker should see it: its ids, then what the explainer
        adds, told the worker's ids of the call's sequences."""
        exc = self.wallet.worker_error(exc)
        if self._explain is None:
            return exc
        node_ids = getattr(call, "seq_ids", None) or [getattr(call, "seq_id", None)]
        return self._explain(exc, self.wallet.worker_ids([s for s in node_ids if isinstance(s, str)]))

    def _learn_port(self, timeout_s: float) -> tuple[int, int]:
        return codec.bulk_info(self.grpc.stats(timeout_s))

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s

    def bulk_channel(self, timeout_s: float | None = None) -> BulkLink | None:
        """The node's bulk listener (its port learned first), or None when it has none
        or the config keeps every call on gRPC."""
        if self.bulk is None:
            return None
        try:
            self.bulk.ensure_port(self._t(timeout_s))
        except TransportUnavailable:
            return None
        return self.bulk

    def connect(self, timeout_s: float | None = None) -> None:
        """Open now the connections the first data calls would open (each transport's
        own; one that cannot be opened is left for the call to find)."""
        self.transports.connect(self._t(timeout_s))

    def close(self) -> None:
        self.transports.close()

    def open(
        self,
        seq_id: str,
        token_ids: codec.TokenIds,
        max_cached_tokens: int | None,
        timeout_s: float | None = None,
        attention: Sequence[Any] = (),
    ) -> OpenResult:
        """Open seq_id on this node with the client's own tenant salt (direct mode: no
        coordinator). `attention`: pb.LayerAttention messages (the Open rpc carries them)."""
        call = calls.open_call(seq_id, token_ids, self.config.tenant_salt, max_cached_tokens, attention)
        result: OpenResult = self.transports.call("open", call, self._t(timeout_s))
        return result

    def append(
        self, seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any, timeout_s: float | None = None
    ) -> int:
        call = calls.append_call(self.wallet.node_id(seq_id), token_ids, k, v)
        result: int = self.transports.call("append", call, self._t(timeout_s))
        return result

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
        appends: Sequence[bool] | None = None,
    ) -> AttentionResult:
        ids = self.wallet.node_ids(seq_ids)
        call = calls.attend_call(ids, layer, q, k, v, token_ids, None, return_block_mass, appends)
        result: AttentionResult = self.transports.call("attend", call, self._t(timeout_s))
        return result

    def start_attend(
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
        appends: Sequence[bool] | None = None,
    ) -> Reply:
        """attend, its request sent now and its answer read by the Reply's result() (once,
        and always: it holds a connection): one thread keeps calls out on several nodes
        at once. Bad arguments, and a transfer that fails before the node has the
        request, raise here as attend raises them."""
        ids = self.wallet.node_ids(seq_ids)
        call = calls.attend_call(ids, layer, q, k, v, token_ids, None, return_block_mass, appends)
        return self.transports.start("attend", call, self._t(timeout_s))

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
        query_position: int | None = None,
    ) -> AttentionResult:
        """query_position: without k, q are queries at that position of the whole sequence and
        on, past every token the node holds (an earlier extent; extent_masks.py)."""
        node_id = self.wallet.node_id(seq_id)
        tokens = codec.token_list(token_ids)
        call = calls.PrefillCall(node_id, layer, q, k, v, tokens, return_block_mass, query_position)
        try:
            return self.grpc.attend_prefill(call, self._t(timeout_s))
        except PagedKVError as exc:  # (gRPC alone carries it: the Fallback's rewrite, here)
            raise self._error(exc, call) from exc.__cause__

    def start_attend_prefill(
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
        query_position: int | None = None,
    ) -> Reply:
        """attend_prefill started as start_attend starts attend (its gRPC future)."""
        tokens = codec.token_list(token_ids)
        call = calls.PrefillCall(
            self.wallet.node_id(seq_id), layer, q, k, v, tokens, return_block_mass, query_position
        )
        try:
            reply = self.grpc.start_attend_prefill(call, self._t(timeout_s))
        except PagedKVError as exc:
            raise self._error(exc, call) from exc.__cause__
        return Rewritten(reply, self._error, call)

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
        call = calls.attend_call(self.wallet.node_ids(seq_ids), layer, q, k, v, token_ids, num_tokens, False)
        result: AttentionResult = self.transports.call("attend", call, self._t(timeout_s))
        return result

    def read_kv(
        self,
        seq_id: str,
        start: int = 0,
        end: int | None = None,
        timeout_s: float | None = None,
        out: codec.KVOut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        call = calls.read_call(self.wallet.node_id(seq_id), start, end, out)
        result: tuple[torch.Tensor, torch.Tensor] = self.transports.call("read_kv", call, self._t(timeout_s))
        return result

    # -- a token budget kept over several nodes (budget.py) -----------------------------

    def start_block_mass(
        self,
        seq_id: str,
        parts: list[tuple[int, Any, list[float], list[int]]],
        timeout_s: float | None = None,
    ) -> Reply:
        """BlockMass sent for parts (layer, q, lse, visible); result() is the mass list."""
        node_id = self.wallet.node_id(seq_id)
        queries = [
            pb.MassQueries(layer=layer, q=tensors.encode(q, "q"), lse=lse, visible=visible)
            for layer, q, lse, visible in parts
        ]
        req = pb.BlockMassRequest(seq_id=node_id, queries=queries)
        meta = self.wallet.metadata([node_id]) or None
        future = self.grpc.stub.BlockMass.future(req, timeout=self._t(timeout_s), metadata=meta)
        return Rewritten(_MassReply(future, self.where), self._error, _Named(node_id))

    def budget_scores(self, seq_id: str, timeout_s: float | None = None) -> tuple[list[float], int]:
        """The scores this node's own budget gave each block of the sequence, and its tokens here."""
        node_id = self.wallet.node_id(seq_id)
        resp = self._unary(
            self.grpc.stub.BlockMass,
            pb.BlockMassRequest(seq_id=node_id, accumulated=True),
            node_id,
            timeout_s,
        )
        return list(resp.mass), resp.num_cached_tokens

    def drop_blocks(self, seq_id: str, indices: list[int], timeout_s: float | None = None) -> int:
        """Drop these table indices of the sequence here; returns the tokens it keeps."""
        node_id = self.wallet.node_id(seq_id)
        req = pb.DropBlocksRequest(seq_id=node_id, indices=indices)
        return self._unary(self.grpc.stub.DropBlocks, req, node_id, timeout_s).num_cached_tokens

    def _unary(self, rpc: Any, request: Any, node_id: str, timeout_s: float | None) -> Any:
        """One gRPC call on a sequence, its errors as the worker should see them (lost, ids)."""
        try:
            return unary(
                rpc, request, self._t(timeout_s), self.wallet.metadata([node_id]) or None, self.where
            )
        except PagedKVError as exc:
            raise self._error(exc, _Named(node_id)) from exc.__cause__
