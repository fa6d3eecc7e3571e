"""Control calls to one node: sequence lifecycle, prefix lookups, pins, swaps,
stats. In a cluster the coordinator takes the lifecycle calls (routing.py); the
per-node ones (stats, budgets, integrity) still come here.
"""

from __future__ import annotations

from typing import Any

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import IntegrityError
from ..protos.status import error_from_rpc
from . import codec
from .config import ClientConfig
from .transport.tickets import Wallet
from .types import NodeStats

_EMPTY = pb.Empty()


def call(rpc: Any, request: Any, timeout_s: float, metadata: Any = None, where: str = "") -> Any:
    """One unary call with a deadline; failures raise the domain error
    (`where`, e.g. "node 127.0.0.1:5000", prefixes its message)."""
    try:
        return rpc(request, timeout=timeout_s, metadata=metadata)
    except grpc.RpcError as exc:
        raise error_from_rpc(exc, where) from exc


class NodeControl:
    def __init__(
        self, stub: pb_grpc.CacheNodeStub, config: ClientConfig, wallet: Wallet | None = None
    ) -> None:
        self.stub, self.config = stub, config
        self.wallet = wallet or Wallet()  # a standalone node's token; a cluster's tickets (set_budget)

    def _t(self, timeout_s: float | None) -> float:
        return self.config.deadline_s if timeout_s is None else timeout_s

    def _call(self, rpc: Any, request: Any, timeout_s: float | None, *seq_ids: str) -> Any:
        return call(rpc, request, self._t(timeout_s), self.wallet.metadata(seq_ids) or None)

    def lookup(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        req = codec.with_token_ids(pb.LookupRequest, token_ids, tenant_salt=self.config.tenant_salt)
        return self._call(self.stub.Lookup, req, timeout_s).num_cached_tokens

    def fork(self, parent_id: str, child_id: str, timeout_s: float | None = None) -> None:
        self._call(self.stub.Fork, pb.ForkRequest(parent_id=parent_id, child_id=child_id), timeout_s)

    def open_signed(self, order: pb.SignedOpen, timeout_s: float | None = None) -> pb.OpenResponse:
        """The coordinator's node Open, carried by this worker (the coordinator signed what
        the node checks; client/node_opens.py sends it from its own thread)."""
        return self.stub.OpenSigned(order, timeout=self._t(timeout_s))

    def free(self, seq_id: str, timeout_s: float | None = None, keep_prefix: int | None = None) -> None:
        """Free the sequence here, by the node's id for it and with its ticket when the
        wallet holds one (a cluster worker's close: client/closing.py)."""
        node_seq_id = self.wallet.node_id(seq_id)
        request = pb.SeqRequest(seq_id=node_seq_id, keep_prefix=keep_prefix)
        self._call(self.stub.Free, request, timeout_s, node_seq_id)

    def swap_out(self, seq_id: str, timeout_s: float | None = None) -> int:
        return self._call(self.stub.SwapOut, pb.SeqRequest(seq_id=seq_id), timeout_s).num_blocks

    def swap_in(self, seq_id: str, timeout_s: float | None = None) -> int:
        return self._call(self.stub.SwapIn, pb.SeqRequest(seq_id=seq_id), timeout_s).num_blocks

    def pin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        req = pb.PinRequest(token_ids=codec.token_list(token_ids), tenant_salt=self.config.tenant_salt)
        return self._call(self.stub.Pin, req, timeout_s).num_tokens

    def unpin(self, token_ids: codec.TokenIds, timeout_s: float | None = None) -> int:
        req = pb.PinRequest(token_ids=codec.token_list(token_ids), tenant_salt=self.config.tenant_salt)
        return self._call(self.stub.Unpin, req, timeout_s).num_tokens

    def set_budget(
        self,
        seq_id: str,
        max_tokens: int | None,
        sink_blocks: int,
        recent_blocks: int,
        timeout_s: float | None,
    ) -> None:
        node_seq_id = self.wallet.node_id(seq_id)
        req = codec.budget_request(node_seq_id, max_tokens, sink_blocks, recent_blocks)
        self._call(self.stub.SetBudget, req, timeout_s, node_seq_id)

    def stats(self, timeout_s: float | None = None) -> NodeStats:
        return codec.stats_result(call(self.stub.Stats, _EMPTY, self._t(timeout_s)))

    def check_integrity(self, timeout_s: float | None = None) -> None:
        resp = call(self.stub.CheckIntegrity, _EMPTY, self._t(timeout_s))
        if not resp.ok:
            raise IntegrityError(resp.message)

    def ping(self, timeout_s: float | None = None) -> None:
        call(self.stub.Ping, _EMPTY, self._t(timeout_s))
