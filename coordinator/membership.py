"""Membership: nodes register, beat and expire; the coordinator's cache of live nodes.

A node registers (coming back empty if it restarted), then beats at a quarter of its
lease (the lease handed out now: longer for a large fleet, lease_scale.py); a node whose
lease lapsed is a suspect, invisible to placement, until a reaper removes it
(remove_node(require_expired=True): idempotent, refuses revived nodes) once liveness.py
declares it dead (a grace, a failed probe, never for a store outage). A
heartbeat that lists the node's held sequences is reconciled (reconcile.py).
The reaper starts one lease after the coordinator does, so nodes that could not
beat while it was down get to beat first.

Costs, N live nodes: a registration and a heartbeat are O(1) (one script on the
node's own keys; the node cache changes in place, and a heartbeat of a node missing
from it reads that node's record alone). Each reaper tick (lease/4) lists the live
nodes once per replica (their loads, from heartbeats other replicas took: O(N));
the scan for expired nodes runs in one replica only, the holder of the store's
"reaper" lease (try_lead; another takes over within a lease when it dies).

The coordinator keeps the live nodes (address, spec, load) in memory for placement;
this mixin owns that cache and the store calls that change it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from ..protos.errors import FailedPrecondition, InvalidArgument, PagedKVError, Unavailable
from ..protos.serving import name_os_thread
from .lease_scale import granted_lease, scaled_lease
from .liveness import Liveness
from .reconcile import Reconciler
from .records import NodeInfo, PurgeResult, SequenceRecord, check_load, check_name
from .store import Store

log = logging.getLogger("pagedkv.coordinator")
MASS_EXPIRY_SHARE = 1 / 3  # Kubernetes' node controller stops evicting at 55% of a zone unready
MASS_EXPIRY_MIN_NODES = 12  # below this, one death is a large share: always reaped
# After a beat's store call failed, beats fail at once for this long: one thread serves every
# node's link (protos/framed_loop.py), and a store that hangs would hold it a timeout per beat.
BEAT_RETRY_S = 0.25


class Beat(NamedTuple):
    """A renewal's answer: is the node registered, the sequence ids it must free, and the lease
    granted (from when the beat was sent; the store holds it at least that long)."""

    is_registered: bool
    free: list[str]
    lease_s: float


class Membership:
    """Register / heartbeat / reap / refresh_nodes, mixed into Coordinator (which sets the
    attributes declared here in its __init__)."""

    store: Store
    config: Any  # CoordinatorConfig (core.py imports this module)
    counters: dict[str, int]
    _lock: threading.Lock
    _stop: threading.Event
    _nodes: dict[str, NodeInfo]
    _recent_opens: dict[str, float]
    _fleet_sums: tuple[int, float] | None  # core.py: live blocks, scaled recent opens
    _active_blocks: dict[str, int]
    _holder: str  # this replica's name for the store's leases (unique per process)
    _beat_failed_at = float("-inf")  # when a beat's store call last failed (monotonic)
    _lease_s: float  # the lease handed out now (lease_scale.py)
    _touch: Callable[[Iterable[str]], None]  # node_rooms.py: these nodes' rows changed
    _sync_rooms: Callable[[], None]
    liveness: Liveness
    reconciler: Reconciler
    _node_gone: Callable[[str, Sequence[SequenceRecord], Sequence[str]], None]  # failures.py

    def _reap_loop(self, interval_s: float | None) -> None:
        """A tick every `interval_s` (None: a quarter of the lease handed out then)."""
        name_os_thread()
        # Grace: after a (re)start every node gets one lease to beat before any is declared
        # dead (a lapse during our own downtime is not a death): the lease the fleet's size
        # hands out, so the nodes are listed first.
        with contextlib.suppress(PagedKVError):
            self.refresh_nodes()
        if self._stop.wait(self.lease_s):
            return
        while not self._stop.wait(self.lease_s / 4 if interval_s is None else interval_s):
            try:
                if self.store.try_lead("reaper", self._holder, self.config.lease_ttl_s):
                    self.reap()
                else:
                    self.refresh_nodes()
            except PagedKVError as exc:  # the store is down: try again next tick
                if isinstance(exc, Unavailable):  # (try_lead or a follower's refresh: not seen by reap())
                    self._store_failed()
                log.warning("reaper: %s", exc)

    def _store_failed(self) -> None:
        """Every lease is extended by the outage, and every reconcile grace restarts."""
        self.liveness.store_failed()
        self.reconciler.store_failed()

    def reap(self) -> list[str]:
        """Remove nodes whose lease lapsed; refresh the node cache. Returns the removed ids.

        A mass expiry (more than MASS_EXPIRY_SHARE of at least MASS_EXPIRY_MIN_NODES
        registered nodes lapsed at once) is held, not reaped: that many beats late together
        says this coordinator or Redis fell behind (a coordinator saturated by 1,000 nodes'
        beats reaped 391 healthy ones, bench/README "Control plane at scale") more likely
        than that many nodes died. They stay suspects, invisible to placement, and revive
        with their next beat; real deaths are reaped once the share drops below it."""
        removed: list[str] = []
        try:
            expired = self.store.expired_nodes()
        except Unavailable:
            self._store_failed()
            raise
        self.liveness.store_answered()
        with self._lock:  # the cache may still list lapsed nodes: count each once
            registered = len(set(expired).union(self._nodes))
        if registered >= MASS_EXPIRY_MIN_NODES and len(expired) > MASS_EXPIRY_SHARE * registered:
            self.counters["reaps_held"] += 1
            log.warning(
                "reaper: %d of %d nodes lapsed at once; holding (not reaped)", len(expired), registered
            )
            self.refresh_nodes()
            return removed
        for node_id in self.liveness.dead(expired):
            records = self.store.sequences_of_node(node_id)
            try:
                result = self.store.remove_node(node_id, require_expired=True)
            except FailedPrecondition:  # it beat meanwhile
                continue
            if result.was_registered:
                removed.append(node_id)
                self.counters["nodes_reaped"] += 1
                self._node_gone(node_id, records, result.lost_seq_ids)
                log.warning(
                    "node %s expired: %d sequences lost, %d keys purged",
                    node_id,
                    len(result.lost_seq_ids),
                    result.num_keys_purged,
                )
        self.refresh_nodes()
        return removed

    def num_live_nodes(self) -> int:
        with self._lock:
            return len(self._nodes)

    @property
    def lease_s(self) -> float:
        """The lease handed out now: the configured one, lengthened as the fleet grows
        (lease_scale.py)."""
        return self._lease_s

    def _rescale_lease(self, num_nodes: int) -> None:
        """The lease for `num_nodes` live nodes, and the reaper's verdicts on its scale."""
        cfg = self.config
        lease = scaled_lease(cfg.lease_ttl_s, cfg.max_beats_per_s, cfg.lease_cap_s, num_nodes, self._lease_s)
        if lease != self._lease_s:
            log.info("lease %.3g s -> %.3g s (%d live nodes)", self._lease_s, lease, num_nodes)
            self._lease_s = lease
            self.liveness.set_lease(lease)

    def refresh_nodes(self) -> list[NodeInfo]:
        nodes = self.store.live_nodes()
        with self._lock:
            old, new = self._nodes, {n.node_id: n for n in nodes}
            # Only the nodes that joined, left or changed get their rows rebuilt: O(changed)
            # row work a tick (the comparison is C-speed dict and dataclass equality).
            self._touch([i for i, n in new.items() if old.get(i) != n] + [i for i in old if i not in new])
            self._nodes = new
            self._fleet_sums = None  # summed again at the next registration (once a tick)
            self._rescale_lease(len(new))
        self._sync_rooms()  # here, on the reaper's thread, not on the next open's
        self.liveness.seen_live(nodes)
        return nodes

    def register(
        self,
        node_id: str,
        address: str,
        spec: Mapping[str, Any],
        num_blocks: int,
        epoch: int = 0,
        policy: str = "",
        lease_s: float | None = None,
    ) -> PurgeResult:
        """A node joins, or comes back empty (its sequences lost, its keys purged): placement's
        load there starts from nothing and its recent opens at its fair share (placement.py).
        Its lease runs `lease_s` (None: the configured lease, for a node that does not take the
        lease its beats hand out). Returns what its earlier registration lost (the node answers
        SequenceLost for those)."""
        ttl = self.config.lease_ttl_s if lease_s is None else lease_s
        records = self.store.sequences_of_node(node_id)
        result = self.store.register_node(node_id, address, dict(spec), num_blocks, ttl, epoch, policy=policy)
        self._node_gone(node_id, records, result.lost_seq_ids)
        with self._lock:
            self._active_blocks.pop(node_id, None)
            # Neither ahead (its count from before it died) nor behind (0: every open would go
            # to an empty cache until it caught up): a node starts at its fair share of opens.
            total, opens = self._fleet_sums or (
                sum(n.num_blocks for n in self._nodes.values()),
                sum(self._recent_opens.get(n, 0.0) for n in self._nodes),
            )
            if (before := self._nodes.get(node_id)) is not None:  # the others' sums
                total -= before.num_blocks
                opens = max(0.0, opens - self._recent_opens.get(node_id, 0.0))
            share = opens * num_blocks / total if total > 0 else 0.0
            self._recent_opens[node_id] = share
            # What the store now holds, without listing every node (O(1) per registration).
            self._nodes[node_id] = info = NodeInfo(
                node_id, address, dict(spec), num_blocks, {}, policy, epoch
            )
            self._fleet_sums = (total + num_blocks, opens + share)
            self._touch((node_id,))
            self._rescale_lease(len(self._nodes))
        self.liveness.seen_live([info])
        if result.was_registered and (result.lost_seq_ids or result.num_keys_purged):
            log.warning("node %s re-registered empty: %d sequences lost", node_id, len(result.lost_seq_ids))
        return result

    def heartbeat(
        self,
        node_id: str,
        load: Mapping[str, int],
        held: Sequence[str] | None = None,
        held_lease_s: float = 0.0,
    ) -> Beat:
        """Renew the node's lease (for at least `held_lease_s`, the lease it believes it holds);
        with `held` (every sequence id it holds) reconcile it with the store. Returns (is it
        registered, the ids it must free, the lease granted)."""
        result = self.heartbeats([(node_id, load, held)], [held_lease_s])[0]
        if isinstance(result, PagedKVError):
            raise result
        return result

    def heartbeats(
        self,
        beats: Sequence[tuple[str, Mapping[str, int], Sequence[str] | None]],
        held_leases: Sequence[float] = (),
    ) -> list[Beat | PagedKVError]:
        """heartbeat for each (node_id, load, held), their renewals in one store round trip
        (the beats a framed loop's turn took together); each its answer or its error. Each
        renewal runs for the lease handed out now, or for the one its node believes it holds
        when that is longer (`held_leases`, one per beat or none: lease_scale.granted_lease;
        such renewals go in a round trip of their own, so one node's claim stretches no other's);
        each answer grants the lease handed out now. Unavailable, for all, when the store failed
        them."""
        if time.monotonic() - self._beat_failed_at < BEAT_RETRY_S:
            raise Unavailable(f"the store failed a beat under {BEAT_RETRY_S} s ago: beat again")
        lease = self.lease_s  # (once: a rescale meanwhile must not grant more than the store holds)
        by_ttl: dict[float, list[int]] = {}
        for i in range(len(beats)):
            held_s = held_leases[i] if held_leases else 0.0
            by_ttl.setdefault(granted_lease(lease, held_s, self.config.lease_cap_s), []).append(i)
        renewed: dict[int, bool | PagedKVError] = {}
        try:
            for ttl, which in by_ttl.items():  # (one round trip but after a lease shortened)
                renewed.update(self._renew(beats, which, ttl))
        except Unavailable:
            self._beat_failed_at = time.monotonic()
            self._store_failed()
            raise
        out: list[Beat | PagedKVError] = []
        for i, (node_id, load, held) in enumerate(beats):
            ok = renewed[i]
            try:
                if isinstance(ok, PagedKVError):
                    raise ok
                out.append(Beat(ok, self._renewed(node_id, load, held) if ok else [], lease))
            except PagedKVError as exc:
                out.append(exc)
        return out

    def _renew(
        self, beats: Sequence[tuple[str, Mapping[str, int], Any]], which: list[int], ttl: float
    ) -> dict[int, bool | PagedKVError]:
        """The store's renewals of beats[i] for i in `which`, in one round trip. A bad beat fails
        the store's whole call before any renews (InvalidArgument): then each beat is checked
        alone, and the good ones renewed without it (one node's bad beat fails no other's)."""
        calls = [(beats[i][0], dict(beats[i][1])) for i in which]
        try:
            return dict(zip(which, self.store.heartbeats(calls, ttl), strict=True))
        except InvalidArgument:
            pass
        out: dict[int, bool | PagedKVError] = {}
        good: list[tuple[int, tuple[str, dict[str, int]]]] = []
        for i, call in zip(which, calls, strict=True):
            try:
                check_name("node_id", call[0])
                check_load(call[1])
                good.append((i, call))
            except InvalidArgument as exc:
                out[i] = exc
        if good:
            oks = self.store.heartbeats([call for _, call in good], ttl)
            out.update(zip((i for i, _ in good), oks, strict=True))
        return out

    def _renewed(self, node_id: str, load: Mapping[str, int], held: Sequence[str] | None) -> list[str]:
        """The node cache after a renewal; the ids the node must free (reconciled with `held`)."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is not None and node.load != load:  # (an idle node's beats change nothing)
                self._nodes[node_id] = node.with_load(dict(load))
                self._touch((node_id,))
        if node is None:  # its lease had lapsed (e.g. while we were down): live again
            revived = self.store.live_node(node_id)
            if revived is not None:
                with self._lock:
                    self._nodes[node_id] = revived
                    self._fleet_sums = None
                    self._touch((node_id,))
        if held is None:
            return []
        try:
            return self.reconciler.report(node_id, held)
        except PagedKVError as exc:  # the renewal stands; reconcile next time
            log.warning("reconcile of node %s: %s", node_id, exc)
            return []

    def live_node(self, node_id: str) -> NodeInfo | None:
        """The node as the store has it now (None when it is not live): one read, O(1)."""
        return self.store.live_node(node_id)
