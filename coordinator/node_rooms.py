"""Placement's view of each node in the coordinator: its load, its recent opens, and the
candidate rows kept ranked between opens (room_index.py), mixed into Coordinator.

Every change to what a node's row is made of (a beat's load, an open or a close counted
there, a registration, a node gone) marks the node dirty in every candidate set; an open
rebuilds the dirty rows of its own set only (usually the one node the last open went to)
and takes a snapshot of it, so its cost does not grow with the node count. The reaper's
periodic refresh of the node list rebuilds every row on its own thread, not on an open's.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from ..protos.errors import InvalidArgument
from .records import NodeInfo, NodeRoom, spec_view
from .room_index import CandidateRooms, RoomIndex

SpecKey = tuple[tuple[str, Any], ...] | None  # a model spec's items, sorted; None: every node


def spec_key(spec: Mapping[str, Any] | None) -> SpecKey:
    return tuple(sorted(spec_view(spec).items())) if spec else None


class NodeRooms:
    """Mixed into Coordinator, which sets the attributes declared here in its __init__ and
    calls `_init_rooms`."""

    config: Any  # CoordinatorConfig
    _lock: threading.Lock
    _nodes: dict[str, NodeInfo]
    _recent_opens: dict[str, float]  # node -> opens * growth at their time; value / growth now
    _open_growth: float
    _fleet_sums: tuple[int, float] | None  # core.py: live blocks, scaled recent opens
    _active_blocks: dict[str, int]

    def _init_rooms(self) -> None:
        self._room_sets: dict[SpecKey, RoomIndex] = {None: RoomIndex()}  # None: every node
        # Per candidate set, the nodes whose rows changed since it was last synced: an open
        # syncs only its own set (the one of every node is synced when asked for, or by the
        # reaper's refresh), so each open pays for the rows it reads.
        self._dirty: dict[SpecKey, set[str]] = {None: set()}
        self._block_sizes: frozenset[int] | None = None  # of every live node; None: to count again

    def _touch(self, node_ids: Iterable[str]) -> None:
        """These nodes' rows changed (the caller holds self._lock)."""
        ids = tuple(node_ids)
        for dirty in self._dirty.values():
            dirty.update(ids)

    def _room_row(self, node_id: str) -> NodeRoom | None:
        """The node's row now (caller holds self._lock); None when it is not live."""
        node = self._nodes.get(node_id)
        if node is None:
            return None
        # Cached blocks nobody holds are room, not idle capacity: placement counts them apart.
        load, total = node.load, node.num_blocks
        free = min(load.get("free_blocks", total), total)
        evictable = min(load.get("cached_blocks", 0), total - free)
        opens = float(self._recent_opens.get(node_id, 0.0))  # scaled: a decay changes no row
        return NodeRoom(node_id, free, total, evictable, opens, self._active_blocks.get(node_id, 0))

    def _sync_rooms(self) -> None:
        """Rebuild the dirty rows in every candidate set."""
        with self._lock:
            for key in self._room_sets:
                self._sync_set(key)

    def _sync_set(self, key: SpecKey) -> None:
        """Rebuild the dirty rows of one candidate set (the caller holds self._lock)."""
        dirty = self._dirty[key]
        if not dirty:
            return
        self._dirty[key] = set()
        rows = {n: self._room_row(n) for n in dirty}
        index = self._room_sets[key]
        if key is None and any((rows[n] is None) == (n in index) for n in rows):
            self._block_sizes = None  # a node joined or left
        spec = None if key is None else dict(key)
        keep = {
            n: r for n, r in rows.items() if r is not None and (spec is None or self._nodes[n].spec == spec)
        }
        index.update(keep.values())
        index.remove(n for n in rows if n not in keep)

    def _candidates(self, spec: Mapping[str, Any] | None) -> CandidateRooms:
        """The live nodes serving `spec` (every live node for None) as placement's rows."""
        key = spec_key(spec)
        with self._lock:
            if key not in self._room_sets:  # a new candidate set: every node is its row once
                self._room_sets[key] = RoomIndex()
                self._dirty[key] = set(self._nodes)
            self._sync_set(key)
            index = self._room_sets[key]
        return index.snapshot()

    def _block_size(self, spec: Mapping[str, Any] | None) -> int:
        """The block size of `spec`, or the one every live node serves (16 when none is live)."""
        if spec:
            return int(spec["block_size"])
        with self._lock:
            self._sync_set(None)  # counts the sizes again when a node joined or left
            sizes = self._block_sizes
            if sizes is None:
                sizes = self._block_sizes = frozenset(int(n.spec["block_size"]) for n in self._nodes.values())
        if len(sizes) > 1:
            raise InvalidArgument(f"nodes serve several block sizes {sorted(sizes)}: name the model spec")
        return next(iter(sizes)) if sizes else 16

    def _opens_of(self, node_id: str) -> float:
        return self._recent_opens.get(node_id, 0.0) / self._open_growth

    def _count_open(self, node_id: str, num_blocks: int) -> None:
        """One more open of num_blocks blocks on node_id: its load (until closed) and its recent
        opens; every open count decays by the configured half-life (O(1): the counts are kept
        scaled by a growing factor, rescaled before it overflows)."""
        with self._lock:
            self._active_blocks[node_id] = self._active_blocks.get(node_id, 0) + num_blocks
            self._open_growth *= 2.0 ** (1.0 / self.config.balance_half_life_opens)
            if self._open_growth > 1e100:
                self._recent_opens = {n: v / self._open_growth for n, v in self._recent_opens.items()}
                self._open_growth = 1.0
                self._fleet_sums = None
                self._touch(self._recent_opens)
            self._recent_opens[node_id] = self._recent_opens.get(node_id, 0.0) + self._open_growth
            if self._fleet_sums is not None and node_id in self._nodes:
                self._fleet_sums = (self._fleet_sums[0], self._fleet_sums[1] + self._open_growth)
            self._touch((node_id,))

    def _add_active(self, node_id: str, num_blocks: int) -> None:
        """A sequence of num_blocks blocks on node_id joined the device's load (fork, swap_in)."""
        with self._lock:
            self._active_blocks[node_id] = self._active_blocks.get(node_id, 0) + num_blocks
            self._touch((node_id,))

    def _release_active(self, node_id: str, num_blocks: int) -> None:
        """A sequence of num_blocks blocks on node_id closed, failed or left the device."""
        with self._lock:
            left = self._active_blocks.get(node_id, 0) - num_blocks
            if left > 0:
                self._active_blocks[node_id] = left
            else:
                self._active_blocks.pop(node_id, None)
            self._touch((node_id,))

    def _account(self, node_id: str, blocks: int) -> None:
        """Count a placement (blocks > 0: taken from free, then from cached) or a close
        (blocks < 0: the sequence's blocks become cached, room again) against the node's
        cached load until its next heartbeat brings the truth. A burst of cold opens thus
        spreads instead of piling onto the node that looked emptiest at the last beat,
        and a burst of open + close pairs between two beats (or on a replica, which
        reads the loads from the store only when it refreshes its nodes) does not make
        a node look full."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                return
            load = dict(node.load)
            free = load.get("free_blocks", node.num_blocks)
            cached = load.get("cached_blocks", 0)
            used = load.get("used_blocks", 0)
            if blocks >= 0:
                from_free = min(blocks, free)
                from_cached = min(blocks - from_free, cached)
                load["free_blocks"] = free - from_free
                load["cached_blocks"] = cached - from_cached
                load["used_blocks"] = used + from_free + from_cached
            else:
                back = min(-blocks, used)
                load["cached_blocks"] = cached + back
                load["used_blocks"] = used - back
            self._nodes[node_id] = node.with_load(load)
            self._touch((node_id,))
