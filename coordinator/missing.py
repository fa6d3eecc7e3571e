"""A data call's NOT_FOUND checked with the node, mixed into Coordinator (core.py).

A node without a cluster secret holds no ticket that would tell it a sequence was placed
on it, so it answers NOT_FOUND both for an id nobody opened and for one it should hold:
the open answered OK but its node Open never arrived (the coordinator died after writing
the page table; an Open that failed on the way marks the record lost itself, deferred.py),
or the node lost it in a way the store has not recorded yet (a restarted node is fenced
until its registration marks its sequences lost: this is the backstop). The client then
asks Describe with node_not_found, and the page table alone cannot tell these apart (it
says live until reconciliation finds the ghost, ~3 leases), so the coordinator asks the
node itself before it answers:

- a node Open of the sequence in flight in this process is waited for first;
- a zero-token ReadKV of the sequence on each of its extents' nodes (no KV moves; the
  node waits its own grace for an Open still in flight from elsewhere) shows whether the
  node holds it now;
- NOT_FOUND there: the record becomes lost (Reconciler.mark_lost: expiring, its quota
  released) and the caller gets SequenceLost naming the node, as every later data call
  and the close do. Held after all (its Open arrived late): Unavailable, retry the call.
  The node unreachable or fenced: Unavailable, nothing changed.

Bound: the data call's grace on the node plus this read's (0.5 s each by default) and two
round trips. A node Open delayed past both (only from another coordinator replica, since
this one waits for its own) makes a false loss: the worker reopens, and reconciliation
frees what the late Open left on the node (lost records are no node's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import NotFound, SequenceLost, Unavailable
from ..protos.status import error_from_rpc
from .reconcile import Reconciler
from .records import Extent, NodeInfo, SequenceRecord


class MissingChecks:
    """Mixed into Coordinator, which sets the attributes declared here in its __init__."""

    config: Any  # CoordinatorConfig (core.py imports this module)
    reconciler: Reconciler
    _stub: Callable[[str], pb_grpc.CacheNodeStub]
    _settle: Callable[..., None]
    describe: Callable[[str, str], tuple[SequenceRecord, NodeInfo]]
    extent_nodes: Callable[[SequenceRecord], list[tuple[Extent, NodeInfo]]]

    def describe_not_found(self, tenant: str, seq_id: str) -> tuple[SequenceRecord, NodeInfo]:
        """Describe for a data call a node answered NOT_FOUND: SequenceLost (naming the
        node, the record marked lost) when a node of the live sequence does not hold it;
        Unavailable when a node cannot say, or holds it now; otherwise what describe
        answers (NOT_FOUND for an id nobody opened or one closed)."""
        self._settle(seq_id, raise_error=False)  # its node Open from here: done, or dropped
        record, node = self.describe(tenant, seq_id)
        if record.state != "active":  # (a swapped sequence is its node's to answer for)
            return record, node
        for _, on in self.extent_nodes(record):  # usually one: the node the call went to
            if self._node_holds(on, seq_id):
                continue
            reason = f"node {on.node_id} does not hold it (the node restarted, or its open never reached it)"
            if not self.reconciler.mark_lost(record, reason):  # closed or lost meanwhile: say what is
                return self.describe(tenant, seq_id)
            raise SequenceLost(seq_id, reason, on.node_id)
        raise Unavailable(f"sequence {seq_id!r}: its nodes hold it now (its open arrived late); retry")

    def _node_holds(self, node: NodeInfo, seq_id: str) -> bool:
        """Does the node hold `seq_id` (a zero-token read)? Raises Unavailable (with why)
        when it cannot say: unreachable, fenced, or another error."""
        request = pb.ReadKVRequest(seq_id=seq_id, start=0, end=0)
        stub = self._stub(node.address)
        try:
            for _ in stub.ReadKV(
                request,
                timeout=self.config.node_rpc_timeout_s,
                metadata=self.config.access.node_metadata(node),
            ):
                pass
        except grpc.RpcError as err:
            exc = error_from_rpc(err, f"node {node.node_id} ({node.address})")
            if isinstance(exc, NotFound | SequenceLost):  # (SequenceLost: the node knows it was reset)
                return False
            raise Unavailable(f"sequence {seq_id!r}: its node cannot say if it holds it: {exc}") from None
        return True
