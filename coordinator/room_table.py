"""The room table: each caller's candidate rows kept in Redis between opens.

Above shortlist.WEIGH_ALL candidates the open script reads only a few rows (the prompt's
holders and the shortlist), but it cannot know which before the match, so every row must be
reachable. Sending them all costs Redis ~100 us an open at 1,000 nodes (bench/README
"Control plane at scale"); instead each RedisStore keeps its rows in a hash, one per
candidate set (a model spec's nodes), and sends only the rows that changed since its last
open: the chosen node's load and opens, and the nodes that beat meanwhile. A RoomIndex
snapshot names those rows from its change log (O(changed); a row-by-row diff of 1,000 rows
was ~70 us an open); a plain sequence of rows is diffed against what was sent.

Rows are stamped from a counter under a lock when they are diffed, and the script keeps the
newer stamp, so an open that reaches Redis after a later one never puts back older values.
A table that is gone (Redis restarted, or it expired after ten idle minutes) is refused by
the script ({-4}); the caller forgets what it sent and sends the whole table once. After a
Sentinel failover the new primary may hold rows a moment older than those sent (replication
is asynchronous): each is right again when its node's room next changes. Recent opens travel
scaled (NewSequence.opens_scale), so their decay changes no row.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import compress
from operator import ne
from typing import NamedTuple

from .records import NodeRoom, node_ids
from .room_index import CandidateRooms

KEPT_TABLES = 8  # candidate sets remembered per store (one per model spec served, usually one)


class TableArgs(NamedTuple):
    """key: the table's Redis key; full: `rows` is every row; rows: "\\nid TAB stamp TAB free
    TAB total TAB evictable TAB opens TAB active" per changed row."""

    key: bytes
    full: bool
    rows: str


class RoomTables:
    """What one store has sent to its room tables. Thread-safe."""

    def __init__(self, prefix: bytes) -> None:
        self._prefix = prefix + b"rooms:" + os.urandom(8).hex().encode() + b":"
        self._lock = threading.Lock()
        self._stamp = 0
        # table key -> the rows sent (a plain sequence's) or the version sent (a snapshot's);
        # keyed by the key's bytes, not the ids: a 1,000-id tuple hashes in ~15 us
        self._sent: OrderedDict[bytes, tuple[NodeRoom, ...] | int] = OrderedDict()
        self._keys: tuple[int, tuple[str, ...], bytes] = (0, (), b"")  # the last key made

    def args(self, candidates: Sequence[NodeRoom]) -> TableArgs:
        """The table for this candidate set and its rows that changed since the last call.
        A RoomIndex snapshot names its changed rows (O(changed)); other sequences are diffed
        row by row against what was sent (O(N), in C)."""
        ids = node_ids(candidates)
        snap = candidates if isinstance(candidates, CandidateRooms) else None
        source = 0 if snap is None else snap.source
        key = self._key(source, ids)
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            sent = self._sent.get(key)
            full = sent is None
            if sent is None:
                while len(self._sent) >= KEPT_TABLES:
                    self._sent.popitem(last=False)
            else:
                self._sent.move_to_end(key)
            if snap is not None:
                assert sent is None or isinstance(sent, int)
                changed = list(snap) if sent is None else snap.changed_since(sent)
                # A snapshot older than the last one sent adds nothing; the newer version stays.
                self._sent[key] = snap.version if sent is None else max(snap.version, sent)
            else:
                rows_now = tuple(candidates)
                # The same ids in the same order: rows compare pairwise as tuples, in C.
                if sent is None:
                    changed = list(rows_now)
                else:
                    changed = list(compress(rows_now, map(ne, rows_now, sent)))  # type: ignore[arg-type]
                self._sent[key] = rows_now
        rows = "".join(
            f"\n{c.node_id}\t{stamp}\t{c.free_blocks}\t{c.total_blocks}\t{c.evictable_blocks}\t"
            f"{c.recent_opens!r}\t{-1 if c.active_blocks is None else c.active_blocks}"
            for c in changed
        )
        return TableArgs(key, full, rows)

    def _key(self, source: int, ids: tuple[str, ...]) -> bytes:
        """The table's key: one per (index, membership); the last one kept (a 1,000-id tuple's
        hash is ~5 us an open otherwise)."""
        last = self._keys
        if last[0] == source and last[1] is ids:
            return last[2]
        key = self._prefix + f"{source}:{hash(ids) & 0xFFFFFFFFFFFFFFFF:016x}".encode()
        self._keys = (source, ids, key)
        return key

    def forget(self, candidates: Sequence[NodeRoom]) -> None:
        """The table was gone: the next call sends it whole."""
        source = candidates.source if isinstance(candidates, CandidateRooms) else 0
        key = self._key(source, node_ids(candidates))
        with self._lock:
            self._sent.pop(key, None)
