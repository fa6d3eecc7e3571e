"""Sequences sharded across nodes: extents, as the coordinator makes and finds them.

A sequence starts with one extent, on the node its open placed it on. When that node
cannot take its next block, or the worker's maximum extent size is reached, the worker
asks for another (Extend): the tail is sealed at a block boundary and a new, empty
sequence is opened on another node, which takes every later append::

    tokens     0 ............ 96 | 96 .......... 160 | 160 ......
    extents    [ n1: blocks 0-5 ] [ n2: blocks 6-9  ] [ n3: tail  ]
               sealed, immutable  sealed, immutable   takes appends

Each extent is the same sequence id on its own node, holding only its own tokens (the
worker merges the nodes' attention by LSE); its Open names its first token's position in the
whole sequence (first_position), from which the node counts a window's or a chunk's positions. The page
table's extents tile the logical blocks; the tail's block count is what its open (or
quota reservations) recorded, and the seal sets it exactly.

Two coordinators extending one sequence at once (replicas; a worker's retry to another):
the page table is written first, as a compare-and-set on the tail each saw (the store's
update_sequence(expect_tail=...), one script). One wins and opens the new extent on its
node; the other changes nothing, opens nothing, and answers with the winner's extents when
they seal at the same token (else FailedPrecondition). A data call that reaches the new
node before its Open waits for it there, as after any open. Failure model: a crash after
the write and before the Open leaves a page table naming an extent its node never held;
the node's reconciliation reports it and the sequence is lost, as for a node restart.

Prefix caching over a sharded sequence: an open reuses the cached prefix on ONE node,
so a prompt is matched against first extents only. A later extent's blocks are keyed
under a fresh random salt of its own: they never alias a first extent's blocks (whose
keys assume position 0) and are never served to another sequence.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ..protos import pagedkv_pb2 as pb
from ..protos.attention import from_messages
from ..protos.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PagedKVError,
    SequenceLost,
    Unavailable,
)
from .placement import NodeCandidate, place
from .records import Extent, NodeInfo, SequenceRecord
from .store import Store, TailMoved

log = logging.getLogger("pagedkv.coordinator")
# Sequences with an Extend running in this process: a concurrent one for the same sequence (a
# retry) waits, then finds the extent the first made; other sequences' Extends go on.
_extending: set[str] = set()
_extending_changed = threading.Condition()


@contextlib.contextmanager
def _one_extend_at_a_time(seq_id: str) -> Iterator[None]:
    with _extending_changed:
        while seq_id in _extending:
            _extending_changed.wait()
        _extending.add(seq_id)
    try:
        yield
    finally:
        with _extending_changed:
            _extending.discard(seq_id)
            _extending_changed.notify_all()


SALT_BYTES = 16
EXTENDS_TO = "extends_to_"  # + n: Extends that gave a sequence its n-th extent (a counter each)


class Extents:
    """Mixed into Coordinator: Extend, and every extent's live node for the other calls."""

    # the Coordinator's (core.py)
    store: Store
    config: Any  # CoordinatorConfig
    counters: dict[str, int]
    _lock: threading.Lock
    _active_blocks: dict[str, int]
    _settle: Callable[..., None]
    _record: Callable[[str, str], SequenceRecord]
    _live_node_of: Callable[[SequenceRecord], NodeInfo]
    _nodes_for: Callable[[Mapping[str, Any] | None], dict[str, NodeInfo]]
    _call: Callable[[NodeInfo, str, Any], Any]
    _opens_of: Callable[[str], float]

    def extent_nodes(self, record: SequenceRecord) -> list[tuple[Extent, NodeInfo]]:
        """Each extent with its live node, in order. SequenceLost naming the node when the
        sequence was lost or one of its nodes is not live (Unavailable within the reaper's
        grace after a coordinator start, as for one node)."""
        out = [(record.extents[0], self._live_node_of(record))]
        for ext in record.extents[1:]:
            node = self._nodes_for(None).get(ext.node_id)
            if node is None:
                raise SequenceLost(
                    record.seq_id, f"node {ext.node_id} of its extent is not live", ext.node_id
                )
            out.append((ext, node))
        return out

    def lost_node_of(self, record: SequenceRecord) -> str:
        """The node a lost sequence was lost with: the one its lost reason names, else its
        first extent's."""
        for ext in record.extents:
            if f"node {ext.node_id} " in f"{record.lost_reason} ":
                return ext.node_id
        return record.extents[0].node_id

    def extend(
        self, tenant: str, seq_id: str, num_tokens: int, attention: Sequence[pb.LayerAttention] = ()
    ) -> SequenceRecord:
        """Seal the tail of `seq_id` at num_tokens and open a new tail extent on another
        node (see the module docstring and the Extend rpc). Returns the page table after.
        `attention`: the sequence's spec, for the new extent's node (opened with its first
        position, so its windows and chunks count the sequence's positions)."""
        self._settle(seq_id)
        with _one_extend_at_a_time(seq_id):
            record = self._record(tenant, seq_id)
            placed = self.extent_nodes(record)
            if record.state != "active":
                raise FailedPrecondition(f"sequence {seq_id!r} is {record.state}: swap it in before it grows")
            tail_ext, tail_node = placed[-1]
            bs = int(tail_node.spec["block_size"])
            if not isinstance(num_tokens, int) or num_tokens % bs:
                raise InvalidArgument(
                    f"extend: num_tokens must be a multiple of block_size {bs}, got {num_tokens}"
                )
            if attention:
                from_messages(attention, int(tail_node.spec["num_layers"]))  # InvalidArgument
            first_block = num_tokens // bs
            if any(e.first_logical_block == first_block for e in record.extents[1:]):
                return record  # a retry: the extent the first call made
            if first_block <= tail_ext.first_logical_block:
                raise InvalidArgument(
                    f"extend: num_tokens {num_tokens} must be past the tail's first token "
                    f"{tail_ext.first_logical_block * bs}"
                )
            node = self._place_extent(record, tail_node.spec, bs)
            request = pb.OpenRequest(
                seq_id=seq_id,
                tenant_salt=os.urandom(SALT_BYTES),
                max_cached_tokens=0,
                attention=attention,
                first_position=num_tokens,
            )
            quota = self.config.quotas.get(tenant)
            sealed = first_block - tail_ext.first_logical_block
            if quota is not None:
                request.max_blocks = 0  # its blocks are reserved as it grows (quota.py)
            extents = (
                *record.extents[:-1],
                Extent(tail_ext.node_id, tail_ext.first_logical_block, sealed),
                Extent(node.node_id, first_block, 0),
            )
            # The page table first, as a compare-and-set on the tail this call saw: of two
            # coordinators extending the sequence at once, one writes its extent and only it
            # opens one on a node; the other answers with the winner's (module docstring)
            seen = (tail_ext.node_id, tail_ext.first_logical_block)
            try:
                updated = self.store.update_sequence(seq_id, extents=extents, expect_tail=seen)
            except TailMoved as exc:
                if any(e.first_logical_block == first_block for e in exc.record.extents[1:]):
                    return exc.record
                raise FailedPrecondition(
                    f"extend {seq_id!r} at token {num_tokens}: another call extended it meanwhile "
                    f"(its extents start at blocks {[e.first_logical_block for e in exc.record.extents]})"
                ) from exc
            try:
                self._call(node, "Open", request)
            except PagedKVError:
                with contextlib.suppress(PagedKVError):  # back to the tail it had, if still ours
                    self.store.update_sequence(
                        seq_id, extents=record.extents, expect_tail=(node.node_id, first_block)
                    )
                raise
            if quota is not None and tail_ext.num_blocks > sealed:  # the sealed tail's unused allowance
                self.store.release_blocks(tenant, tail_ext.num_blocks - sealed)
            self.counters["spills"] += 1
            key = f"{EXTENDS_TO}{len(updated.extents)}"
            self.counters[key] = self.counters.get(key, 0) + 1
            return updated

    def _place_extent(self, record: SequenceRecord, spec: Mapping[str, Any], bs: int) -> NodeInfo:
        """The node for a new extent: placement (room, load, recent opens) among the live nodes
        serving `spec` that hold no extent of the sequence (an extent per node keeps one
        sequence id per node)."""
        holding = set(record.node_ids)
        nodes = {k: n for k, n in self._nodes_for(spec).items() if k not in holding}
        if not nodes:
            raise Unavailable(
                f"sequence {record.seq_id!r}: no other live node serving its spec to extend it to "
                f"(it holds extents on {sorted(holding)})"
            )
        candidates = []
        with self._lock:
            for node in nodes.values():
                load, total = node.load, node.num_blocks
                free = min(load.get("free_blocks", total), total)
                evictable = min(load.get("cached_blocks", 0), total - free)
                active = self._active_blocks.get(node.node_id, 0)
                candidates.append(
                    NodeCandidate(
                        node.node_id, 0, free, total, evictable, 0, self._opens_of(node.node_id), active
                    )
                )
        chosen = place(candidates, 1, bs, self.config.weights)
        return nodes[chosen.node_id]

    def swap_extents(self, seq_id: str, placed: list[tuple[Extent, NodeInfo]], method: str, undo: str) -> int:
        """SwapOut (or SwapIn) on every extent's node; blocks moved in all. When one node
        refuses, the extents already moved are moved back (best effort) and its error raised:
        a sequence is swapped whole or not at all."""
        done: list[NodeInfo] = []
        moved = 0
        try:
            for _, node in placed:
                moved += int(self._call(node, method, pb.SeqRequest(seq_id=seq_id)).num_blocks)
                done.append(node)
        except PagedKVError:
            for node in done:
                try:
                    self._call(node, undo, pb.SeqRequest(seq_id=seq_id))
                except PagedKVError as exc:
                    log.warning(
                        "%s of %s on %s after a failed %s: %s", undo, seq_id, node.node_id, method, exc
                    )
            raise
        return moved

    def _free_extent(self, node_id: str, seq_id: str) -> None:
        """Free a later extent of a closed sequence on its node, now (one rpc; a node that is
        gone or no longer holds it has nothing to free; a failure is counted, and the node's
        reconciliation frees what the store no longer knows)."""
        node = self._nodes_for(None).get(node_id)
        if node is None:
            return
        try:
            self._call(node, "Free", pb.SeqRequest(seq_id=seq_id))
        except NotFound:
            pass
        except PagedKVError as exc:
            self.counters["free_failures"] += 1
            log.warning("Free of extent %s on %s failed: %s", seq_id, node_id, exc)
