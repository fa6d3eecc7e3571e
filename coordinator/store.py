"""The Store: every piece of coordinator state, behind one interface.

A coordinator keeps nothing in its own memory that it cannot lose: membership,
the global prefix index, page tables and tenants live in a Store, so a
coordinator can restart, or run as several replicas, without losing anything.

Two backends implement the same contract and run one contract suite
(tests/contract/test_store_contract.py):

- RedisStore (redis_store.py): the production backend. Every method is one
  round trip and every multi-key update is one Lua script, so it is atomic
  against other coordinator replicas (open_sequence runs placement in Lua).
- MemoryStore (memory_store.py): embedded, in-process, one lock; for `pagedkv up`
  on a machine without Redis, and for tests.

Liveness is tooz-style: a registered node has a TTL key; each heartbeat pushes
its deadline ttl_s ahead (the node beats at half the TTL). A node whose TTL
lapsed is "expired": still registered, invisible to placement (live_nodes,
match_prefix), until a reaper calls remove_node(node_id, require_expired=True).

Errors (protos.errors): InvalidArgument for bad input (checked before any state
is touched), SequenceNotFound, QuotaExceeded, FailedPrecondition subclasses
(SequenceExists, NodeNotLive) for valid calls on the wrong state, and
Unavailable when the backend cannot be reached: the call may or may not have
been applied, so callers retry only idempotent calls blindly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from ..protos.errors import FailedPrecondition, PagedKVError, Unavailable
from .placement import Placement
from .records import (
    BeatLoads,
    EventRun,
    NewSequence,
    NodeInfo,
    PurgeResult,
    SequenceRecord,
    check_ttl,
)

T = TypeVar("T")


def one_by_one(calls: Sequence[Callable[[], T]]) -> list[T | PagedKVError]:
    """Each call's answer or its error, in order; once one raised Unavailable (the store
    failed) the rest get that error untried."""
    out: list[T | PagedKVError] = []
    for call in calls:
        try:
            out.append(call())
        except Unavailable as exc:
            out += [exc] * (len(calls) - len(out))
            break
        except PagedKVError as exc:
            out.append(exc)
    return out


class TailMoved(FailedPrecondition):
    """update_sequence(expect_tail=...): the sequence's tail extent is no longer the one the
    caller saw (another coordinator extended it); `record` is the page table now."""

    def __init__(self, record: SequenceRecord, expected: tuple[str, int]) -> None:
        self.record = record
        tail = record.extents[-1]
        super().__init__(
            f"sequence {record.seq_id!r}: its tail is on {tail.node_id} from block "
            f"{tail.first_logical_block}, not on {expected[0]} from block {expected[1]}"
        )


class Store(ABC):
    """Coordinator state. Thread-safe: one Store object may serve many threads."""

    # Whether open_sequences sends its opens together, each weighing what the earlier ones
    # placed (RedisStore); else Coordinator.open_many opens them one after the other itself.
    weighs_batches = False

    # ---- membership ---------------------------------------------------------------------------

    @abstractmethod
    def register_node(
        self,
        node_id: str,
        address: str,
        spec: Mapping[str, Any],
        num_blocks: int,
        ttl_s: float,
        epoch: int = 0,
        *,
        policy: str = "",
    ) -> PurgeResult:
        """(Re-)register a node; it is live for ttl_s seconds. `epoch` names this
        registration (NodeInfo.epoch; the tickets for its sequences carry it); `policy` (its
        eviction policy's name, kept in NodeInfo.policy) says what evicts its blocks, for
        explained misses.

        A node that registers again comes back EMPTY (it restarted, its blocks are
        gone): atomically with the new record, its old keys leave the prefix index
        and its old sequences are marked lost ("node X re-registered"); the result
        says what was purged (was_registered=False on a first registration).
        Load starts empty, and so does its applied event seq (applied_seq: 0). One round trip
        (one script).
        """

    @abstractmethod
    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        """Push the node's deadline ttl_s ahead and record its load counters
        (free_blocks, used_blocks, num_sequences, ...; ints >= 0).

        A node whose TTL lapsed but that no reaper has removed yet is revived: a
        lapse only makes a node a suspect (invisible to placement); removal is
        what declares it dead. So a coordinator (or Redis) outage longer than the
        TTL does not kill every healthy node. Returns False, changing nothing, if
        the node is unknown or was removed: it must register again (and comes back
        empty). One round trip.
        """

    def heartbeats(self, beats: Sequence[tuple[str, Mapping[str, int]]], ttl_s: float) -> list[bool]:
        """heartbeat for each (node_id, load), in order: what each would answer. The Redis
        store sends them in one round trip (one write, the replies read in order); a store
        that fails fails them all (none may have renewed). InvalidArgument, before any
        renews, for a bad node_id or load."""
        check_ttl(ttl_s)
        BeatLoads()(beats)  # (every beat checked before any renews)
        return [self.heartbeat(node_id, load, ttl_s) for node_id, load in beats]

    @abstractmethod
    def live_nodes(self) -> list[NodeInfo]:
        """Registered nodes whose TTL has not lapsed, sorted by node_id. Read-only; one round trip."""

    @abstractmethod
    def live_node(self, node_id: str) -> NodeInfo | None:
        """The node's record if it is registered and its TTL has not lapsed, else None: what a
        Register or a revived heartbeat needs without listing every node. Read-only; one
        round trip, O(1)."""

    @abstractmethod
    def expired_nodes(self) -> list[str]:
        """Ids of registered nodes whose TTL lapsed (sorted): what a reaper removes. Read-only;
        one round trip."""

    @abstractmethod
    def remove_node(self, node_id: str, *, require_expired: bool = False) -> PurgeResult:
        """Atomically purge the node's keys from the prefix index, mark its sequences
        lost ("node X died"), and drop its record.

        Idempotent: an unknown node gives was_registered=False and changes nothing.
        With require_expired=True a node that is still live raises FailedPrecondition
        and changes nothing (checked atomically), so a reaper racing a re-registration
        never drops a fresh node. One round trip.
        """

    @abstractmethod
    def try_lead(self, role: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the lease on `role` for `holder` (e.g. the reaper, so one replica scans
        for expired nodes, not every one). True if `holder` holds it for the next ttl_s
        seconds; False, changing nothing, while another holder's lease runs. A holder that
        gets False, or does not renew within ttl_s, must stop acting in the role. One
        round trip."""

    # ---- global prefix index (exact) ----------------------------------------------------------

    @abstractmethod
    def apply_events(
        self,
        node_id: str,
        stored: Sequence[bytes],
        removed: Sequence[bytes],
        offloaded: Sequence[bytes] = (),
    ) -> None:
        """Record that the node now holds `stored` (on its device), no longer holds `removed`,
        and still holds `offloaded` but on its host tier (16-byte keys). A host key that is
        stored again moved back to the device.

        Set semantics: storing a held key or removing an absent one is a no-op.
        A key in two lists raises InvalidArgument (the node sends each key's net
        effect). If the node is not live, raises NodeNotLive and changes nothing:
        its events are stale (it will re-register and come back empty), and the
        error tells it so at once. Atomic; one round trip.
        """

    @abstractmethod
    def apply_event_runs(self, runs: Sequence[EventRun]) -> list[int]:
        """Apply each run; for each, the node's applied seq after it (NOT_LIVE when the node is
        not live or is live under another epoch: nothing changed).

        Every run is checked first (records.check_run): InvalidArgument before anything is
        applied. Per run, atomically: last_seq <= applied: nothing (a replay); first_seq >
        applied + 1: nothing (a gap: the caller resends from applied + 1); else the run applies
        (set semantics exactly as apply_events, in-flight markers of stored keys cleared as
        apply_events does) and applied = last_seq. A run overlapping what was applied applies
        whole (event_run_scripts.py says why that is right). Runs of one node in one call apply
        in order; several replicas may apply overlapping runs of one node in any order: once
        applied reaches the node's last event, the index is its log applied in order
        (ClusterStore: keys_of is; nodes_holding may lag while replicas race, by its rule).

        The Redis stores cut a run of more than event_runs.MAX_KEYS_PER_SCRIPT keys into several
        scripts, only the last recording last_seq: a crash between them leaves applied unchanged
        and the run is resent whole. RedisStore pipelines every script of the call: one round
        trip. ClusterStore: the node-slot scripts (a round trip per master), then the index
        writes (its consistency rule).
        """

    @abstractmethod
    def applied_seq(self, node_id: str, epoch: int) -> int:
        """The node's applied seq under its live registration `epoch` (0 for a fresh
        registration: register_node starts every registration at 0); NOT_LIVE when it is not
        live or is live under another epoch. InvalidArgument unless epoch is an int in
        [1, 2**63), as a run's. Read-only; one round trip."""

    @abstractmethod
    def match_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        """For every live node, how many LEADING keys of `keys` it holds on either tier
        (keys[0], keys[1], ... consecutively; the first key it lacks stops its count). Live
        nodes holding nothing map to 0; expired nodes are absent. Read-only; one
        round trip (one script), a consistent snapshot. O(H x K + N): H nodes holding
        keys[0] are asked their run, the N live nodes are listed.
        """

    @abstractmethod
    def nodes_holding(self, key: bytes) -> set[str]:
        """The nodes the index says hold `key`, exactly as stored (expired nodes included
        until removed). Read-only; one round trip."""

    @abstractmethod
    def keys_of(self, node_id: str) -> set[bytes]:
        """Every key the index says `node_id` holds (empty if unknown). Read-only; one round trip."""

    # ---- page tables --------------------------------------------------------------------------

    @abstractmethod
    def create_sequence(self, record: SequenceRecord) -> None:
        """Insert a page-table entry. Raises SequenceExists if the id is taken, NodeNotLive
        if an extent names a node that is not live; nothing changes then. One round trip."""

    @abstractmethod
    def open_sequence(self, new: NewSequence) -> Placement:
        """Match, place and record a new sequence, atomically: the whole open in one round trip.

        1. match: each candidate that is live gets its leading cached blocks of
           new.keys as the node serves them (its device run, then the host-tier run
           that continues it: cached and host blocks), and the blocks an open in
           flight brings it (placement.py's marker on its first uncached key); the
           others are skipped.
        2. place: placement.place(those candidates with their room and active blocks,
           new.num_blocks, new.block_size, new.weights, the first of new.keys or b""
           as tie_key, new.scan_classes):
           the same node, cached blocks, scores and
           rejected list; Unavailable when no candidate is live, CapacityExceeded
           (requested = fewest uncached blocks, available = most free) when none
           has room.
        3. quota: with new.quota set, the tenant's usage grows by new.num_blocks,
           or QuotaExceeded(tenant, requested, quota, used).
        4. write: the page table (one extent [0, num_blocks) on the chosen node,
           num_tokens, state active) and its node link; SequenceExists if the id
           is taken.
        5. mark: with new.pending_ttl_ms > 0 and keys left uncached on the chosen
           node, the first of them names that node and the prompt's key count for
           that long (the last open to mark a key wins), or until a node reports
           that key stored (apply_events drops the marker).

        Checked in that order; any error changes nothing. Returns the Placement.

        Cost, K prompt keys, H live candidates holding the first key, C candidates: the
        match is O(H x K) (through the key -> nodes index; a node holding none of the prompt
        costs nothing there). A backend may weigh, besides the holders and the marker's node,
        only a shortlist of the others (shortlist.py: the best non-holders in place()'s own
        order, so the choice is place()'s over all C); `scores` and `rejected` then cover the
        nodes weighed. RedisStore does so above shortlist.WEIGH_ALL candidates: its Redis work
        is O(H x K + shortlist), flat in C (bench/README "Control plane at scale").
        """

    def open_sequences(self, news: Sequence[NewSequence]) -> list[Placement | PagedKVError]:
        """open_sequence of each, in order, as if one after the other: each its Placement or
        its error. A store that fails (Unavailable) fails every one not yet written. Here,
        one at a time, each placed by the rooms its NewSequence carries; a store that
        `weighs_batches` sends them together (RedisStore: one round trip) and each weighs,
        besides those rooms, what the batch's earlier opens placed."""
        return one_by_one([partial(self.open_sequence, new) for new in news])

    @abstractmethod
    def get_sequence(self, seq_id: str) -> SequenceRecord:
        """The entry, or SequenceNotFound. Read-only; one round trip."""

    @abstractmethod
    def update_sequence(
        self, seq_id: str, *, expect_tail: tuple[str, int] | None = None, **fields: Any
    ) -> SequenceRecord:
        """Set some of extents, num_tokens, state, lost_reason; returns the updated record.

        Unknown or invalid fields raise InvalidArgument; a missing id raises
        SequenceNotFound; new extents on a node that is not live raise NodeNotLive;
        `expect_tail` (node id, first logical block): the update applies only while the
        last extent is that one, else TailMoved with the record as it is (an Extend's
        compare-and-set: two coordinators extending one sequence make one extent);
        nothing changes then. Atomic (node->sequences links move with the extents);
        one round trip.
        """

    @abstractmethod
    def delete_sequence(
        self, seq_id: str, *, tenant: str | None = None, require_live: bool = False
    ) -> SequenceRecord:
        """Remove the entry and return what it was; SequenceNotFound if absent. With
        `tenant`, an entry of another tenant raises PermissionDenied and stays (checked
        atomically, so a close is one round trip). With `require_live`, an entry that is
        not lost with an extent on a node that is not live (a suspect: its lease lapsed,
        no reaper removed it) raises NodeNotLive naming that node and stays: a close must
        not answer before the node's verdict (back: freed; declared dead: lost). One round
        trip. (Quota is not released here: the caller releases what it reserved.)"""

    def delete_sequences(
        self, deletes: Sequence[tuple[str, str | None, bool]]
    ) -> list[SequenceRecord | PagedKVError]:
        """delete_sequence of each (seq_id, tenant, require_live), in order: each the record
        it removed or its error; Unavailable for every one not yet done when the store
        fails. Here, one at a time; a backend may send them together."""
        return one_by_one(
            [partial(self.delete_sequence, s, tenant=t, require_live=live) for s, t, live in deletes]
        )

    @abstractmethod
    def mark_lost(self, seq_id: str, reason: str, ttl_s: float) -> SequenceRecord | None:
        """Mark an entry lost (reconciliation: its node does not hold it): state "lost",
        `reason` as lost_reason, unlinked from its nodes (sequences_of_node stops listing it,
        as after a node's purge), and expiring ttl_s from now. Returns the entry as it was
        before; None, changing nothing, when it is absent or lost already. One round trip."""

    @abstractmethod
    def expire_lost(self, seq_ids: Sequence[str], ttl_s: float) -> int:
        """Give each of these records that is lost an expiry ttl_s from now (garbage
        collection: a lost record lives until its worker closes it or this long); others
        (unknown, or not lost) are left alone. Returns how many got one. One round trip;
        each record is its own script (one sequence's key)."""

    @abstractmethod
    def sequences_of_node(self, node_id: str) -> list[SequenceRecord]:
        """Sequences with an extent on the node, sorted by seq_id. After the node is removed
        or re-registered this is empty (its sequences are lost, their records kept until
        deleted). Read-only; one round trip."""

    # ---- tenants ------------------------------------------------------------------------------

    @abstractmethod
    def tenant_salt(self, tenant: str) -> bytes:
        """The tenant's 16-byte key salt: created server-side (os.urandom) on first use,
        the same forever after; concurrent first uses (any replicas) agree. One round trip."""

    @abstractmethod
    def reserve_blocks(self, tenant: str, n: int, quota: int) -> int:
        """Atomically add n blocks to the tenant's usage if usage + n <= quota; returns the
        new usage. Otherwise raises QuotaExceeded(tenant, requested=n, quota, used) and
        changes nothing. One round trip."""

    @abstractmethod
    def release_blocks(self, tenant: str, n: int) -> int:
        """Subtract n from the tenant's usage; returns the new usage. Releasing more than
        is used raises InvalidArgument and changes nothing. One round trip."""

    @abstractmethod
    def tenant_usage(self, tenant: str) -> int:
        """Blocks the tenant has reserved (0 if never seen). Read-only; one round trip."""

    # ---- operations ---------------------------------------------------------------------------

    @abstractmethod
    def ping(self) -> None:
        """Return if the backend answers; raise Unavailable otherwise."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections. The store must not be used afterwards."""


def open_store(url: str, **options: Any) -> Store:
    """A Store from a URL (tooz style): "memory://" or "redis://host:port/db" (rediss:// too),
    or "redis+sentinel://host:port,host:port/mastername" (the primary the sentinels name), or
    "redis+cluster://host:port,host:port" (Redis Cluster: cluster_store.py, any of its masters).

    Options go to the backend (e.g. prefix="pkv:" for Redis, clock=... for memory).
    """
    from pagedkv.protos.errors import InvalidArgument

    if url == "memory://" or url.startswith("memory://"):
        from .memory_store import MemoryStore

        return MemoryStore(**options)
    if url.startswith("redis+cluster://"):
        from .cluster_store import ClusterStore

        return ClusterStore(url, **options)
    if url.startswith(("redis://", "rediss://", "unix://", "redis+sentinel://")):
        from .redis_store import RedisStore

        return RedisStore(url, **options)
    raise InvalidArgument(
        f"unknown store URL {url!r}: use memory://, redis://host:port, redis+sentinel://host:port/name "
        "or redis+cluster://host:port,host:port"
    )
