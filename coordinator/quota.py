"""Quotas charge the blocks a sequence may hold, not its opens.

An open reserves the prompt's blocks from the tenant's quota and the node is told
that allowance (OpenRequest.max_blocks); a fork reserves the parent's (its
copy-on-write copy fits in it). When an append (or a decode step) would take a
sequence past its allowance, its node asks here for more (Coordinator.Reserve)
before it changes anything: the tenant's usage grows and the page table records
the new block count, which its close releases. A tenant at its quota gets
QuotaExceeded (RESOURCE_EXHAUSTED) on the append, and nothing changed. A swapped
sequence keeps its allowance, so swapping it back in never needs more.
"""

from __future__ import annotations

from ..protos.errors import InvalidArgument, PagedKVError, QuotaExceeded, SequenceNotFound
from .core import Coordinator
from .records import Extent

UNLIMITED_BLOCKS = 2**62  # the allowance of a tenant without a quota
MAX_STEP_BLOCKS = 1 << 20


def reserve(coordinator: Coordinator, node_id: str, seq_id: str, min_blocks: int, num_blocks: int) -> int:
    """Grow the allowance of sequence `seq_id` (the node's id of it) on `node_id` by
    num_blocks, or by min_blocks when the tenant has no room for more; returns the new
    allowance. QuotaExceeded when not even min_blocks fit; SequenceNotFound when the
    sequence does not live on that node. Two store round trips (the reservation, then
    the page table; the first is released when the second fails)."""
    if not 1 <= min_blocks <= num_blocks <= MAX_STEP_BLOCKS:
        raise InvalidArgument(
            f"reserve: need 1 <= min_blocks ({min_blocks}) <= num_blocks ({num_blocks}) <= {MAX_STEP_BLOCKS}"
        )
    store = coordinator.store
    record = store.get_sequence(seq_id)
    if node_id not in record.node_ids or record.state == "lost":
        raise SequenceNotFound(seq_id, f"not on node {node_id!r}")
    quota = coordinator.config.quotas.get(record.tenant)
    if quota is None:
        return UNLIMITED_BLOCKS
    try:
        store.reserve_blocks(record.tenant, num_blocks, quota)
        got = num_blocks
    except QuotaExceeded:
        if num_blocks == min_blocks:
            raise
        store.reserve_blocks(record.tenant, min_blocks, quota)
        got = min_blocks
    last = record.extents[-1]
    extents = (*record.extents[:-1], Extent(last.node_id, last.first_logical_block, last.num_blocks + got))
    try:
        updated = store.update_sequence(seq_id, extents=extents)
    except PagedKVError:
        store.release_blocks(record.tenant, got)
        raise
    return updated.num_blocks
