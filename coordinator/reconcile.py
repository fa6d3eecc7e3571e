"""Reconciliation: the nodes and the store converge after any crash.

Every few beats (cache_node/coordinator_link.py: RECONCILE_EVERY, once a lease) a node's
heartbeat carries the ids of every sequence it holds. Compared with the page tables the
store keeps for that node (one read), two kinds of disagreement come out:

- held, not in the store (an orphan): a close whose Free never reached the node (the
  coordinator died in between), a fork whose page table was never written. Freed by the
  node once it has been an orphan for `grace_s` in every report since: the reply to the
  heartbeat names it.
- in the store, not held (a ghost): an open whose node Open never arrived (the
  coordinator died after writing the page table), a failed open whose page table could
  not be dropped. Marked lost ("node X does not hold it") after the same grace: its
  worker then gets SequenceLost from close, and from data calls when its ticket is old.

The grace covers the legitimate windows (an Open or Free in flight, a fork between its
node call and its page table): 2 leases by default, well above the node rpc timeout. It
counts time the store answered: a store outage restarts it (a worker whose node Free went
through before the outage could not drop the page table during it; its close after it
answers OK, not SequenceLost).
Work per report: one store read and O(sequences on the node); a node that holds more than
the report's cap sends none and is skipped.

Lost records are garbage-collected: every record that becomes lost here or when a node
dies gets an expiry (`lost_ttl_s`) in the store and leaves its node's set of sequences
(Store.mark_lost here; the node's purge when it dies), so a worker that never closes
leaves nothing behind for good and the set holds only records that are not lost; the
tenant's quota is released when the blocks are lost (close then releases nothing more).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ..protos.errors import InvalidArgument, PagedKVError
from .records import SequenceRecord
from .store import Store

log = logging.getLogger("pagedkv.coordinator.reconcile")


class Reconciler:
    def __init__(
        self,
        store: Store,
        grace_s: float,
        lost_ttl_s: float,
        *,
        release: Callable[[SequenceRecord], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """release(record): give back what a sequence that became lost held (quota, load)."""
        if not grace_s >= 0 or not lost_ttl_s > 0:
            raise InvalidArgument(f"grace_s must be >= 0 and lost_ttl_s > 0, got {grace_s}, {lost_ttl_s}")
        self.store = store
        self.grace_s = grace_s
        self.lost_ttl_s = lost_ttl_s
        self._release = release
        self._clock = clock
        self._orphans: dict[str, dict[str, float]] = {}  # node -> held id unknown to the store -> since
        self._ghosts: dict[str, dict[str, float]] = {}  # node -> record not held -> since
        self._lock = threading.Lock()
        self.counters = {"orphans_freed": 0, "ghosts_lost": 0, "lost_expired": 0}

    def report(self, node_id: str, held: Sequence[str]) -> list[str]:
        """A node's full list of held sequence ids: returns the ids it must free (orphans past
        the grace) and marks lost the records it does not hold (past the grace)."""
        records = self.store.sequences_of_node(node_id)
        now = self._clock()
        held_ids = set(held)
        known = {r.seq_id: r for r in records if r.state != "lost"}
        with self._lock:
            orphans = _track(self._orphans.setdefault(node_id, {}), held_ids - known.keys(), now)
            ghosts = _track(self._ghosts.setdefault(node_id, {}), known.keys() - held_ids, now)
            free = [s for s, since in orphans.items() if now - since >= self.grace_s]
            gone = [known[s] for s, since in ghosts.items() if now - since >= self.grace_s]
            for s in free:
                del orphans[s]
            for r in gone:
                del ghosts[r.seq_id]
        for record in gone:
            self.mark_lost(record, f"node {node_id} does not hold it (its open never completed)")
        self.counters["orphans_freed"] += len(free)
        if free:
            log.warning(
                "node %s holds %d sequences the store does not know: freeing them", node_id, len(free)
            )
        return free

    def mark_lost(self, record: SequenceRecord, reason: str) -> bool:
        """A record its node does not hold becomes lost, in one round trip: unlinked from
        the node (its set lists live records only) and expiring, so nothing of it outlives
        lost_ttl_s in the store. False (nothing changed) when it was closed or lost meanwhile."""
        was = self.store.mark_lost(record.seq_id, reason, self.lost_ttl_s)
        if was is None:
            return False
        self.counters["ghosts_lost"] += 1
        self.counters["lost_expired"] += 1
        log.warning("sequence %s marked lost: %s", record.seq_id, reason)
        self._release_all([was])
        return True

    def lost(self, records: Iterable[SequenceRecord]) -> None:
        """These sequences just became lost (their node died, re-registered, or never held
        them): release what they held and give their records an expiry."""
        records = [r for r in records if r.state != "lost"]
        self._release_all(records)
        if records:
            n = self.store.expire_lost([r.seq_id for r in records], self.lost_ttl_s)
            self.counters["lost_expired"] += n

    def _release_all(self, records: Sequence[SequenceRecord]) -> None:
        for record in records:
            try:
                self._release(record)
            except PagedKVError as exc:
                log.warning("could not release what lost sequence %s held: %s", record.seq_id, exc)

    def store_failed(self) -> None:
        """A store call failed: no worker could close, nor coordinator open, while it was
        down, so every grace restarts from the next report (it counts time the store answered)."""
        with self._lock:
            self._orphans.clear()
            self._ghosts.clear()

    def forget(self, node_id: str) -> None:
        """The node died or re-registered: what was tracked for it is moot."""
        with self._lock:
            self._orphans.pop(node_id, None)
            self._ghosts.pop(node_id, None)


def _track(tracked: dict[str, float], now_ids: set[str], now: float) -> dict[str, float]:
    """Keep `tracked` (id -> first seen) to exactly the ids seen now, the new ones from `now`."""
    for seq_id in [s for s in tracked if s not in now_ids]:
        del tracked[seq_id]
    for seq_id in now_ids:
        tracked.setdefault(seq_id, now)
    return tracked
