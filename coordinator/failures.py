"""What the coordinator does about failures, mixed into Coordinator (core.py): the
bookkeeping when a node's sequences are lost (reconcile.py releases what they held and
gives their records an expiry), liveness.py's direct probe of a node, and the first
answer of an open retried with the same request id (from its page table)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.errors import SequenceExists
from .event_applier import EventApplier
from .liveness import Liveness, ProbeAnswer
from .placement import Placement
from .reconcile import Reconciler
from .records import NodeInfo, SequenceRecord
from .store import Store


class Failures:
    """Mixed into Coordinator, which sets the attributes declared here in its __init__."""

    store: Store
    config: Any  # CoordinatorConfig (core.py imports this module)
    liveness: Liveness
    reconciler: Reconciler
    events: EventApplier
    _lock: threading.Lock
    _active_blocks: dict[str, int]
    _touch: Callable[[Iterable[str]], None]  # node_rooms.py: these nodes' rows changed
    _stub: Callable[[str], pb_grpc.CacheNodeStub]
    _live_node_of: Callable[[SequenceRecord], NodeInfo]

    def _node_gone(self, node_id: str, records: Sequence[SequenceRecord], lost_ids: Sequence[str]) -> None:
        """A node died or re-registered: its sequences `lost_ids` are lost (records: what
        they were just before)."""
        with self._lock:
            self._active_blocks.pop(node_id, None)  # its sequences are lost
            self._touch((node_id,))
        self.liveness.forget(node_id)
        self.reconciler.forget(node_id)
        self.events.forget(node_id)  # (its queued events are the gone registration's)
        lost = set(lost_ids)
        self.reconciler.lost([r for r in records if r.seq_id in lost])

    def _release_lost(self, record: SequenceRecord) -> None:
        """What a sequence that became lost held: its tenant's quota (close releases nothing
        more for a lost record)."""
        if record.tenant in self.config.quotas and record.num_blocks:
            self.store.release_blocks(record.tenant, record.num_blocks)

    def is_replaced(self, node: NodeInfo) -> bool:
        """Is another process (a restart: another epoch) answering at the node's address
        (a probe)? Then its registration is gone for sure; no answer proves nothing (the
        old process may be cut off, still serving until its fence)."""
        answer = self._probe(node, self.config.probe_timeout_s)
        return answer is not None and answer.epoch != node.epoch

    def _probe(self, node: NodeInfo, timeout_s: float) -> ProbeAnswer | None:
        """liveness.py's direct probe: the node's Stats (its epoch, whether it is fenced)."""
        try:
            reply = self._stub(node.address).Stats(pb.Empty(), timeout=timeout_s)
        except grpc.RpcError:
            return None
        return ProbeAnswer(int(reply.epoch), bool(reply.is_fenced))

    def _first_answer(self, tenant: str, seq_id: str, request_id: str, exists: SequenceExists) -> Any:
        """A retried open (the same request id): what the first one answered, from its page
        table; `exists` when the id is another open's."""
        record = self.store.get_sequence(seq_id)
        if record.tenant != tenant or record.request_id != request_id:
            raise exists
        node = self._live_node_of(record)
        bs = int(node.spec["block_size"])
        cached = record.num_cached_blocks
        placement = Placement(node.node_id, cached, cached * bs, record.num_blocks - cached)
        from .core import OpenResult  # (core.py imports this module)

        return OpenResult(seq_id, node.node_id, node.address, cached * bs, placement)
