"""The room table: each caller's candidate rows kept in Redis between opens.

Above shortlist.WEIGH_ALL candidates the open script reads only a few rows (the prompt's
holders and the shortlist), but it cannot know which before the match, so every row must be
reachable. Sending them all costs Redis ~100 us an open at 1,000 nodes (bench/README
"Control plane at scale"); instead each RedisStore keeps its rows in a hash, one per
candidate set (a model spec's nodes), and sends only the rows that changed since its last
open: the chosen node's load and opens, and the nodes that beat meanwhile.

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
        self._sent: OrderedDict[tuple[str, ...], tuple[NodeRoom, ...]] = OrderedDict()  # ids -> rows

    def args(self, candidates: Sequence[NodeRoom]) -> TableArgs:
        """The table for this candidate set and its rows that changed since the last call."""
        ids = node_ids(candidates)
        key = self._prefix + f"{hash(ids) & 0xFFFFFFFFFFFFFFFF:016x}".encode()
        rows_now = tuple(candidates)
        with self._lock:
            self._stamp += 1
            stamp = self._stamp
            sent = self._sent.get(ids)
            full = sent is None
            if sent is None:
                changed = list(rows_now)
                while len(self._sent) >= KEPT_TABLES:
                    self._sent.popitem(last=False)
            else:
                self._sent.move_to_end(ids)
                # The same ids in the same order: rows compare pairwise as tuples, in C.
                changed = list(compress(rows_now, map(ne, rows_now, sent)))
            self._sent[ids] = rows_now
        rows = "".join(
            f"\n{c.node_id}\t{stamp}\t{c.free_blocks}\t{c.total_blocks}\t{c.evictable_blocks}\t"
            f"{c.recent_opens!r}\t{-1 if c.active_blocks is None else c.active_blocks}"
            for c in changed
        )
        return TableArgs(key, full, rows)

    def forget(self, candidates: Sequence[NodeRoom]) -> None:
        """The table was gone: the next call sends it whole."""
        with self._lock:
            self._sent.pop(node_ids(candidates), None)
