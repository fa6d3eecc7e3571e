"""Coordinator: the control plane's domain logic (no gRPC servicer code here).

It places sequences, keeps their page tables and the global prefix index in a
Store, tracks membership, and drives the nodes' control rpcs (Open, Fork, Free,
SwapOut/In, Pin) over the protos stubs. It never touches KV bytes or torch.

An open, in round trips to the store (Redis):

    salt, root  tenant_salt      0 (cached in process: a salt never changes, nor its root key)
    keys        chain_keys       0 (joined into one bytes: one argument on the wire)
    open        open_sequence    1 (one script: match the prefix on the nodes the index
                                    lists for its first key, O(holders x keys) (store.py),
                                    placement.place ported to Lua, the tenant's quota,
                                    the page table; the candidates' rows are kept between
                                    opens and ranked there (node_rooms.py, room_index.py))
    node        CacheNode.Open   0 on the critical path: sent as a future after the
                                   page table is written, and never waited for

So an open answers after one client RPC and one Redis round trip; the client
gets the placement and M, the cached-token count from the exact prefix index. The opens
a framed loop's turn takes together (open_many) share that round trip: their scripts go
in one pipelined write, each weighing what the batch's earlier opens placed.
The node Open carries M as an exact expectation (expect_cached_tokens): the node
takes exactly M cached tokens or fails (PrefixEvicted, when it evicted some since
the index was read). A failed node open is never lost: the node keeps a tombstone
so the client's first data call gets that error (OpenFailed), and the completion
callback here deletes the page table and releases the quota. A data call that
overtakes the node Open waits on the node for a short grace. Coordinator calls on
a sequence whose node call is in flight (fork, swaps; a reopen of the same id)
wait for it first (`_inflight`, where an open enters before its script runs, so a
concurrent close always finds it); close does not wait: it deletes the record (one
round trip, tenant-checked in the script) and chains the node Free after the open. A
client's close frees the sequence on its nodes itself first (freed_extents): then the
coordinator sends those no Free, only one after its own Open when that is still in flight.

Node calls sent without waiting (the node Open, the Free of a close) are in deferred.py;
placement's view of each node (load, recent opens, the candidate rows) is node_rooms.py.
Membership (register, heartbeat, the reaper thread, the node cache) is in
membership.py, mixed into Coordinator; the reaper's verdicts come from liveness.py (a
lapsed lease, a grace, a failed direct probe, never during or just after a store
outage), heartbeats carrying a node's held sequence ids go through reconcile.py
(orphans freed, ghosts marked lost), and lost records expire (lost_ttl_s).

Idempotency: close of an id without a page table succeeds (a retried close); close of a
lost sequence raises SequenceLost once and drops its record; close of a sequence whose
node is a suspect raises Unavailable and changes nothing (a retry gets the verdict); an
open retried with the same request id (same seq id) gets the first answer back (the page
table's placement).
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import grpc
import numpy as np

from ..protos import pagedkv_pb2 as pb
from ..protos import pagedkv_pb2_grpc as pb_grpc
from ..protos.attention import from_messages
from ..protos.errors import (
    InvalidArgument,
    NodeNotLive,
    PagedKVError,
    PermissionDenied,
    PrefixUnknown,
    SequenceExists,
    SequenceLost,
    SequenceNotFound,
    Unavailable,
)
from ..protos.keys import KEY_BYTES, chain_keys, root_key
from ..protos.serving import name_os_thread
from ..protos.status import error_from_rpc
from .auth import ClusterAccess
from .deferred import DeferredCalls, NodeCall, node_open_request, order_prompt
from .event_applier import EventApplier, split_net
from .extents import Extents
from .failures import Failures
from .key_cache import ChainKeyCache
from .liveness import Liveness, LivenessConfig
from .membership import Membership
from .misses import REASONS, MissExplanation, NodePolicies, RemovedKeys, explain
from .missing import MissingChecks
from .node_calls import NodeCalls
from .node_rooms import NodeRooms
from .placement import Placement, PlacementWeights
from .prompt_refs import PromptRefs
from .reconcile import Reconciler
from .records import EventRun, Extent, NewSequence, NodeInfo, SequenceRecord, spec_text, spec_view
from .reuse import ReuseClasses, ReuseConfig
from .store import Store

log = logging.getLogger("pagedkv.coordinator")


@dataclass(frozen=True)
class CoordinatorConfig:
    lease_ttl_s: float = 3.0
    node_rpc_timeout_s: float = 5.0
    free_retries: int = 3  # a failed asynchronous node Free is sent again this often (then counted)
    quotas: Mapping[str, int] = field(default_factory=dict)  # tenant -> max blocks; absent = unlimited
    weights: PlacementWeights = field(default_factory=PlacementWeights)
    # Placement's balance counts each node's opens with this half-life (in opens, cluster-wide).
    balance_half_life_opens: float = 512.0
    reuse: ReuseConfig = field(default_factory=ReuseConfig)  # which run sizes are scans (reuse.py)
    access: ClusterAccess = field(default_factory=ClusterAccess)  # the cluster secret, TLS to nodes
    reconcile_grace_s: float | None = None  # reconcile.py's grace (None: two leases)
    lost_ttl_s: float = 3600.0  # a lost record is garbage-collected this long after the loss
    probe_timeout_s: float = 1.0  # liveness.py's direct probe of a suspect node
    event_flush_s: float = 0.01  # event_applier.py: a stream of reports is applied this often
    # lease_scale.py: the lease doubles while the fleet's beats would pass this (0: fixed lease),
    # up to max_lease_s (None: 16 leases)
    max_beats_per_s: float = 500.0
    max_lease_s: float | None = None

    def __post_init__(self) -> None:
        if not self.lease_ttl_s > 0:
            raise InvalidArgument(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if not (self.max_beats_per_s >= 0 and math.isfinite(self.max_beats_per_s)):
            raise InvalidArgument(f"max_beats_per_s must be a finite number >= 0, got {self.max_beats_per_s}")
        if self.max_lease_s is not None and not (self.lease_ttl_s <= self.max_lease_s < math.inf):
            raise InvalidArgument(
                f"max_lease_s must be finite and >= lease_ttl_s ({self.lease_ttl_s}), got {self.max_lease_s}"
            )
        if not self.balance_half_life_opens > 0:
            raise InvalidArgument(f"balance_half_life_opens must be > 0, got {self.balance_half_life_opens}")

    @property
    def heartbeat_interval_s(self) -> float:
        """A quarter lease: the lease survives three lost beats, and the node's fence
        (a lease minus one beat after its last renewal) comes before any reaper's verdict."""
        return self.lease_ttl_s / 4

    @property
    def lease_cap_s(self) -> float:
        """The longest lease handed out (lease_scale.py)."""
        return 16 * self.lease_ttl_s if self.max_lease_s is None else self.max_lease_s

    def liveness(self) -> LivenessConfig:
        return LivenessConfig(self.lease_ttl_s, probe_timeout_s=self.probe_timeout_s)


@dataclass(frozen=True)
class OpenResult:
    seq_id: str
    node_id: str
    address: str
    num_cached_tokens: int
    placement: Placement
    num_host_hit_tokens: int = 0
    num_blocks: int = 0  # swap_in: blocks copied back
    miss: MissExplanation | None = None  # open: why its first block not on the device missed it
    record: SequenceRecord | None = None  # fork, swap_in: the page table (every extent)
    node_open: pb.SignedOpen | None = None  # open with worker_opens: the node Open the worker sends
    num_pending_tokens: int = 0  # open: of the rest, tokens an open in flight is computing on that node
    prompt_ref: bytes = b""  # open with a carried prompt: names its first prompt_ref_tokens (prompt_refs.py)
    prompt_ref_tokens: int = 0
    block_size: int = 0  # open: the block size of its node's model


class OpenArgs(NamedTuple):
    """One open of Coordinator.open_many: Coordinator.open's arguments (wait aside)."""

    tenant: str
    token_ids: Sequence[int]
    seq_id: str
    max_cached_tokens: int | None = None
    spec: Mapping[str, Any] | None = None
    attention: Sequence[pb.LayerAttention] = ()
    request_id: str = ""
    worker_opens: bool = False
    carried_prompt: bool = False
    # With carried_prompt: the prompt's first prefix_tokens tokens are those the ref names
    # (prompt_refs.py) and token_ids holds the rest.
    prefix_ref: bytes = b""
    prefix_tokens: int = 0


class CloseArgs(NamedTuple):
    """One close of Coordinator.close_many: Coordinator.close's arguments."""

    tenant: str
    seq_id: str
    keep_prefix: int | None = None
    freed_extents: int = 0


class _Opening(NamedTuple):
    """An open between its two halves (Coordinator._begin_open, _end_open)."""

    args: OpenArgs
    new: NewSequence
    call: NodeCall
    keys: bytes
    salt: bytes
    block_size: int
    quota: int | None


class Coordinator(DeferredCalls, Failures, Membership, NodeRooms, Extents, MissingChecks):
    def __init__(self, store: Store, config: CoordinatorConfig | None = None) -> None:
        self.store = store
        self.config = config or CoordinatorConfig()
        self._salts: dict[str, tuple[bytes, bytes]] = {}  # tenant -> (salt, root key): never change
        self._nodes: dict[str, NodeInfo] = {}
        # Recent opens per node, decayed: node -> opens * growth at their time; value / growth now.
        self._recent_opens: dict[str, float] = {}
        self._open_growth = 1.0
        # The live nodes' blocks and scaled recent opens, summed for a registration's fair share
        # without a pass over every node (O(N) a registration made 1,000 of them O(N^2)); None:
        # to sum again (after a refresh of the node list, a revival, a rescale of the counts).
        self._fleet_sums: tuple[int, float] | None = None
        # Placement's load: blocks of the sequences this coordinator opened on each node and has
        # not closed (exact at once, where a node's report is up to a heartbeat old).
        self._active_blocks: dict[str, int] = {}
        self._init_rooms()
        self._reuse = ReuseClasses(self.config.reuse)
        self._stubs: dict[str, tuple[grpc.Channel, pb_grpc.CacheNodeStub]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._holder = uuid.uuid4().hex
        self._inflight: dict[str, NodeCall] = {}  # seq id -> its node Open not yet settled
        # Cleanups after failed node opens and Free retries: Redis and sleeps, never
        # on gRPC's callback thread.
        self._background = ThreadPoolExecutor(2, thread_name_prefix="coord-bg", initializer=name_os_thread)
        self._node_calls = NodeCalls(self.config.node_rpc_timeout_s, self.config.access)
        self.counters = {
            "opens": 0,
            "cached_tokens": 0,
            "prompt_tokens": 0,
            "nodes_reaped": 0,
            "reaps_held": 0,  # reaper ticks that held a mass expiry (membership.py)
            "open_failures": 0,  # asynchronous node opens that failed (page table dropped)
            "free_failures": 0,  # node Frees given up after free_retries
            # Why an open's first uncached block missed (the prompt's own, tenant-salted keys):
            # (misses.py: host_tier, in_flight, other_node, evicted, not_cached; none is not counted)
            **{"misses_" + reason: 0 for reason in REASONS[1:]},
            "scan_opens": 0,  # opens placed as scans (placement.py)
            "host_hit_tokens": 0,  # of cached_tokens, those on the chosen node's host tier
            "spills": 0,  # extents added to sequences on another node (extents.py)
            "ref_opens": 0,  # opens that named their prompt's start by a ref (prompt_refs.py)
            "ref_tokens": 0,  # the prompt tokens those refs named instead of sending them
            "ref_unknown": 0,  # refs not held (a restart, or a worker switching replicas): sent again
        }
        # Recently removed keys (REMOVED events) and their node: tells "evicted" from "never cached".
        self._removed = RemovedKeys()
        self._chain_keys = ChainKeyCache()  # prompts' keys, reused by opens sharing their prefix
        self._prompt_refs = PromptRefs()  # prompts a worker may name instead of sending (prompt_refs.py)
        # Numbered event reports, applied in batches
        self.events = EventApplier(store, self._events_applied, interval_s=self.config.event_flush_s)
        self.liveness = Liveness(self.config.liveness(), self._probe)
        self._lease_s = self.config.lease_ttl_s  # handed out now (membership.py: lease_s)
        grace = self.config.reconcile_grace_s
        self.reconciler = Reconciler(
            store,
            2 * self.config.lease_ttl_s if grace is None else grace,
            self.config.lost_ttl_s,
            release=self._release_lost,
        )

    # -- lifecycle ----------------------------------------------------------------

    def start(self, interval_s: float | None = None) -> Coordinator:
        """Start the reaper: a tick every `interval_s`, by default a quarter of the lease handed
        out at the time (lease_scale.py)."""
        self._reaper = threading.Thread(
            target=self._reap_loop, args=(interval_s,), name="reaper", daemon=True
        )
        self._reaper.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5)
        self.events.stop()
        self._background.shutdown(wait=True, cancel_futures=False)
        self._node_calls.close()
        for channel, _ in self._stubs.values():
            channel.close()

    @property
    def node_calls(self) -> NodeCalls:
        """The node calls sent without waiting (a servicer holds them back while it replies)."""
        return self._node_calls

    def report_numbered(
        self, node_id: str, epoch: int, first_seq: int, events: Sequence[tuple[int, bytes]], base_seq: int = 0
    ) -> tuple[int, int]:
        """A numbered report (event_applier.py): queued, applied in batches; (applied, next_seq)."""
        return self.events.offer(node_id, epoch, first_seq, events, base_seq)

    def events_acknowledged(self, node_id: str, epoch: int) -> tuple[int, int] | None:
        """How far a node's numbered events got (event_applier.py): (applied, next_seq), None
        when it is not live under `epoch`."""
        return self.events.acknowledge(node_id, epoch)

    def _events_applied(self, runs: Sequence[EventRun]) -> None:
        with self._lock:
            for run in runs:
                self._removed.discard(run.stored)
                self._removed.add(run.node_id, run.removed)

    def report_events(self, node_id: str, events: Sequence[tuple[int, bytes]]) -> int:
        """Apply a node's ordered stored/offloaded/removed events; each key's last event wins
        (an unknown kind counts as removed: the index never claims a block it cannot vouch for)."""
        stored, removed, offloaded = split_net({key: kind for kind, key in events})
        self.store.apply_events(node_id, stored, removed, offloaded)
        with self._lock:
            self._removed.discard(stored)
            self._removed.add(node_id, removed)
        return len(events)

    def _cached_node(self, node_id: str) -> NodeInfo | None:
        """A node in this coordinator's cache of live nodes (O(1), no store call)."""
        with self._lock:
            return self._nodes.get(node_id)

    # -- helpers ------------------------------------------------------------------

    def _salt(self, tenant: str) -> tuple[bytes, bytes]:
        """The tenant's salt and the root key derived from it (one hash saved per call)."""
        entry = self._salts.get(tenant)
        if entry is None:
            salt = self.store.tenant_salt(tenant)
            entry = self._salts[tenant] = (salt, root_key(salt))
        return entry

    def node(self, node_id: str) -> NodeInfo | None:
        """A live node as this coordinator last saw it (None when it is not live)."""
        if not self._nodes:
            self.refresh_nodes()
        return self._cached_node(node_id)

    def _stub(self, address: str) -> pb_grpc.CacheNodeStub:
        with self._lock:
            entry = self._stubs.get(address)
            if entry is None:
                channel = self.config.access.channel(address)
                entry = self._stubs[address] = (channel, pb_grpc.CacheNodeStub(channel))
            return entry[1]

    def _call(self, node: NodeInfo, method: str, request: Any) -> Any:
        try:
            return getattr(self._stub(node.address), method)(
                request,
                timeout=self.config.node_rpc_timeout_s,
                metadata=self.config.access.node_metadata(node),
            )
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"node {node.node_id} ({node.address})") from None

    def _nodes_for(self, spec: Mapping[str, Any] | None) -> dict[str, NodeInfo]:
        with self._lock:
            nodes = dict(self._nodes)
        if not nodes:
            nodes = {n.node_id: n for n in self.refresh_nodes()}
        if spec:
            want = spec_view(spec)
            nodes = {k: n for k, n in nodes.items() if n.spec == want}
        return nodes

    def _served_specs(self) -> str:
        """'; live nodes serve [...]': what a refused spec could have been (for its error)."""
        specs = {spec_text(n.spec): None for n in self._nodes_for(None).values()}
        return f"; live nodes serve [{', '.join(specs)}]" if specs else ""

    def _record(self, tenant: str, seq_id: str) -> SequenceRecord:
        record = self.store.get_sequence(seq_id)
        if record.tenant != tenant:
            raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant")
        return record

    def _live_node_of(self, record: SequenceRecord) -> NodeInfo:
        """The live node of a sequence; SequenceLost when its record is lost, Unavailable
        while its node is a suspect (see `_suspect`)."""
        node_id = record.extents[0].node_id
        if record.state == "lost":
            lost = self.lost_node_of(record)  # a sharded sequence's tail may be the one lost
            raise SequenceLost(record.seq_id, record.lost_reason or f"node {lost} died", lost)
        # (the cache lags a registration taken by another replica: the store says, O(1))
        node = self._cached_node(node_id) or self.live_node(node_id)
        if node is None:
            raise self._suspect(record.seq_id, node_id)
        return node

    def _suspect(self, seq_id: str, node_id: str) -> Unavailable:
        """A sequence whose record is not lost on a node whose lease lapsed: the node is a
        suspect, not a corpse (a stall, an outage, or a lapse while no coordinator ran), so
        the answer is Unavailable, nothing changed: a retry gets the verdict, the sequence
        back when the node beats again, SequenceLost once it is declared dead."""
        bound = self.config.liveness().detection_bound_s
        return Unavailable(
            f"sequence {seq_id!r}: node {node_id} missed its lease (a suspect, not declared dead): "
            f"retry; it is kept if the node beats again, lost if it is declared dead (within "
            f"{bound:.1f} s of its last beat)"
        )

    # -- control calls ------------------------------------------------------------

    def lookup(
        self, tenant: str, token_ids: Sequence[int], spec: Mapping[str, Any] | None = None
    ) -> tuple[int, str]:
        """(cached tokens on the best node, that node's id). Changes nothing."""
        nodes = self._nodes_for(spec)
        bs = self._block_size(spec)
        keys = chain_keys(self._salt(tenant)[1], np.asarray(token_ids), bs)
        counts = {k: v for k, v in self.store.match_prefix(keys).items() if k in nodes}
        if not counts:
            return 0, ""
        best = min(counts, key=lambda k: (-counts[k], k))
        return counts[best] * bs, best if counts[best] else ""

    def open(
        self,
        tenant: str,
        token_ids: Sequence[int],
        *,
        seq_id: str = "",
        max_cached_tokens: int | None = None,
        spec: Mapping[str, Any] | None = None,
        wait: bool = False,
        attention: Sequence[pb.LayerAttention] = (),
        request_id: str = "",
        worker_opens: bool = False,
        carried_prompt: bool = False,
        prefix_ref: bytes = b"",
        prefix_tokens: int = 0,
    ) -> OpenResult:
        """Place the sequence and write its page table (one store call), then send the
        node Open without waiting for it (see the module docstring); num_cached_tokens
        is M, what the node will take exactly. `wait=True` also waits for the node (its
        failure is raised here, and num_host_hit_tokens is known): for tests and tools only.
        `attention` (one LayerAttention per layer, or none) is checked before placing and
        travels to the node's Open. `request_id`: an open retried with the same one (and
        seq id) returns the first answer, from the page table, instead of SequenceExists.
        `worker_opens`: nothing is sent; the result carries the node Open, signed for the
        node (`node_open`), for the worker to send (CacheNode.OpenSigned). A worker that
        dies first leaves a page table its node does not hold: reconcile.py marks it lost.
        `carried_prompt` (with worker_opens): the worker attaches the prompt to that Open, so
        the order names it by its cached prefix's last key instead of holding it; the answer
        then carries a ref to the prompt (`prompt_ref`), which a later open of the tenant may
        pass as `prefix_ref` with `prefix_tokens` of it, and only the rest as `token_ids`."""
        seq_id = seq_id or uuid.uuid4().hex
        self._settle(seq_id, raise_error=False)  # a reopen of this id waits for its last node call
        o = OpenArgs(tenant, token_ids, seq_id, max_cached_tokens, spec, attention, request_id, worker_opens)
        o = o._replace(carried_prompt=carried_prompt, prefix_ref=prefix_ref, prefix_tokens=prefix_tokens)
        return self._open_alone(o, wait)

    def _open_alone(self, o: OpenArgs, wait: bool = False) -> OpenResult:
        opening = self._begin_open(o)
        try:
            placement: Placement | PagedKVError = self.store.open_sequence(opening.new)
        except PagedKVError as exc:
            placement = exc
        return self._end_open(opening, placement, wait)

    def open_many(self, opens: Sequence[OpenArgs]) -> list[OpenResult | PagedKVError]:
        """Several opens (a framed loop's turn took them together) with their store writes in
        one round trip where the store weighs a batch's earlier placements (Store.open_sequences,
        `weighs_batches`), else one after the other: each its open's answer or error, placed
        where it would be alone after the earlier ones. The caller makes sure no node call of
        their ids is in flight and no id comes twice (nothing here waits)."""
        out: list[OpenResult | PagedKVError | None] = [None] * len(opens)
        if not self.store.weighs_batches:  # each placed after the last one's accounting
            for i, o in enumerate(opens):
                try:
                    out[i] = self._open_alone(o)
                except PagedKVError as exc:
                    out[i] = exc
            return out  # type: ignore[return-value]  # (every slot set)
        begun: list[tuple[int, _Opening]] = []
        for i, o in enumerate(opens):
            try:
                begun.append((i, self._begin_open(o)))
            except PagedKVError as exc:
                out[i] = exc
        if begun:
            placed: Sequence[Placement | PagedKVError]
            try:
                placed = self.store.open_sequences([opening.new for _, opening in begun])
            except PagedKVError as exc:  # (the store failed them all)
                placed = [exc] * len(begun)
            for (i, opening), placement in zip(begun, placed, strict=True):
                try:
                    out[i] = self._end_open(opening, placement, False)
                except PagedKVError as exc:
                    out[i] = exc
        return out  # type: ignore[return-value]  # (every slot set)

    def _begin_open(self, o: OpenArgs) -> _Opening:
        """An open up to its store call: checked, hashed, its NewSequence built, and in
        `_inflight` (a close that finds its page table finds the call)."""
        tenant, token_ids, seq_id, max_cached_tokens, spec, attention, request_id = o[:7]
        if not self.num_live_nodes():
            self.refresh_nodes()
        candidates = self._candidates(spec)  # kept between opens (node_rooms.py)
        if not candidates:
            raise Unavailable(
                "no live cache node"
                + (f" serves model spec {spec_text(spec)}" if spec else "")
                + self._served_specs()
            )
        bs = self._block_size(spec)
        if attention:  # the node's Open is not awaited: refuse here what it would refuse
            depths = {int(n.spec["num_layers"]) for n in self._nodes_for(spec).values()}
            if len(depths) > 1:
                raise InvalidArgument(f"nodes serve models of {sorted(depths)} layers: name the model spec")
            from_messages(attention, depths.pop())
        salt, root = self._salt(tenant)
        num_tokens = o.prefix_tokens + len(token_ids)
        limit = num_tokens - 1 if max_cached_tokens is None else min(max_cached_tokens, num_tokens)
        tokens = np.asarray(token_ids)  # one C-level copy; slicing a protobuf field makes a list
        if o.prefix_ref:  # the prompt's start named by a ref (prompt_refs.py)
            if not (o.worker_opens and o.carried_prompt):
                raise InvalidArgument("prefix_ref needs worker_opens and carries_prompt")
            try:
                keys = self._prompt_refs.keys(
                    seq_id, root, bs, o.prefix_ref, o.prefix_tokens, tokens, max(limit, 0) // bs
                )
            except PrefixUnknown:
                self.counters["ref_unknown"] += 1
                raise
            self.counters["ref_opens"] += 1
            self.counters["ref_tokens"] += o.prefix_tokens
        elif o.prefix_tokens:
            raise InvalidArgument("prefix_tokens without a prefix_ref")
        else:  # a prefix shared with a recent prompt is not hashed again (key_cache.py)
            keys = self._chain_keys.keys(root, tokens[: max(limit, 0) // bs * bs], bs)
        num_blocks = max(1, -(-num_tokens // bs))
        with self._lock:
            opens_scale = self._open_growth  # the rows' counts are scaled by it
            scan_classes = self._reuse.scan_classes()
        quota = self.config.quotas.get(tenant)
        new = NewSequence(
            seq_id,
            tenant,
            num_tokens,
            num_blocks,
            bs,
            keys,
            candidates,
            self.config.weights,
            quota,
            scan_classes=scan_classes,
            request_id=request_id,
            opens_scale=opens_scale,
        )
        # In `_inflight` before the page table exists: a close that finds the record finds the call.
        call = NodeCall(seq_id)
        with self._lock:
            self._inflight[seq_id] = call
        return _Opening(o, new, call, keys, salt, bs, quota)

    def _end_open(self, opening: _Opening, placement: Placement | PagedKVError, wait: bool) -> OpenResult:
        """An open after its store call (`placement`, or the error it raised): its answer."""
        o, new, call, keys, salt, bs, quota = opening
        tenant, token_ids, seq_id, _, _, attention, request_id, worker_opens, carried_prompt = o[:9]
        num_tokens, num_blocks = new.num_tokens, new.num_blocks
        if isinstance(placement, PagedKVError):
            exc = placement
            call.finish(None)  # nothing was sent: what waits on it (a close's Free) goes ahead
            self._settled(call)
            if isinstance(exc, SequenceExists) and request_id:
                first = self._first_answer(tenant, seq_id, request_id, exc)
                if worker_opens:  # its first answer never reached the worker: sign the Open again
                    cached = first.num_cached_tokens
                    prompt = order_prompt(token_ids, num_tokens, keys, cached, bs, carried_prompt)
                    request = node_open_request(
                        seq_id, prompt, salt, first.num_cached_tokens, attention, request_id
                    )
                    if quota is not None:
                        request.max_blocks = first.placement.cached_blocks + first.placement.new_blocks
                    node = self._cached_node(first.node_id) or self.live_node(first.node_id)
                    if node is not None:
                        first = replace(first, node_open=self.config.access.sign_open(request, node))
                return first
            raise exc
        num_cached = placement.cached_tokens
        node = self._cached_node(placement.node_id) or self.live_node(placement.node_id)
        if node is None:  # it left since its row was read: as a node Open that failed
            call.finish(Unavailable(f"node {placement.node_id} left while a sequence was placed on it"))
            call.mark_recorded()
            self._background.submit(self._drop_failed_open, call, tenant if quota is not None else None)
            raise call.error  # type: ignore[misc]
        call.mark_recorded()
        carried = worker_opens and carried_prompt
        prompt = order_prompt(token_ids, num_tokens, keys, num_cached, bs, carried)
        request = node_open_request(seq_id, prompt, salt, num_cached, attention, request_id)
        if quota is not None:  # the sequence may hold what was reserved; more through Reserve
            request.max_blocks = num_blocks
        node_open = None
        if worker_opens:  # nothing in flight here: what waits on this id goes ahead
            node_open = self.config.access.sign_open(request, node)
            call.finish(None)
            self._settled(call)
        else:
            self._send_open(node, request, call, tenant if quota is not None else None)
        self._account(node.node_id, placement.new_blocks + placement.host_blocks)
        self._count_open(node.node_id, num_blocks)
        self._learn(placement, keys)
        with self._lock:
            miss = explain(placement, keys, self._removed, NodePolicies(self._nodes))
        if miss.reason != "none":
            self.counters["misses_" + miss.reason] += 1
        self.counters["opens"] += 1
        self.counters["prompt_tokens"] += num_tokens
        self.counters["cached_tokens"] += num_cached
        self.counters["scan_opens"] += placement.is_scan
        num_host_hit = placement.host_blocks * bs  # what the index says; the node's own figure with wait
        self.counters["host_hit_tokens"] += num_host_hit
        if wait:
            call.settled.result()  # raises the node's error (the page table is gone by then)
            num_host_hit = call.host_hit_tokens
        where = (seq_id, node.node_id, node.address, num_cached, placement, num_host_hit)
        pending = min(placement.pending_blocks * bs, num_tokens - num_cached)
        ref = self._prompt_refs.keep(self._salt(tenant)[1], bs, keys) if carried else b""
        return OpenResult(
            *where,
            miss=miss,
            node_open=node_open,
            num_pending_tokens=pending,
            prompt_ref=ref,
            prompt_ref_tokens=len(keys) // KEY_BYTES * bs if ref else 0,
            block_size=bs,
        )

    def _learn(self, placement: Placement, keys: bytes) -> None:
        """Feed the open to the reuse classes (reuse.py): the keys it hit on its node, the first
        key of the run it computes, and that run's size as placement classed it."""
        cached = placement.cached_blocks
        run = placement.cached_blocks + placement.new_blocks - max(cached, placement.cached_elsewhere_blocks)
        with self._lock:
            self._reuse.observe(keys, cached, run)

    def fork(self, tenant: str, parent_id: str, child_id: str = "") -> OpenResult:
        self._settle(parent_id)
        parent = self._record(tenant, parent_id)
        placed = self.extent_nodes(parent)  # the child shares every extent's blocks, on its node
        node = placed[0][1]
        child_id = child_id or uuid.uuid4().hex
        # The child counts against the quota like any sequence (its close releases it).
        quota = self.config.quotas.get(tenant)
        if quota is not None:
            self.store.reserve_blocks(tenant, parent.num_blocks, quota)
        try:
            request = pb.ForkRequest(parent_id=parent_id, child_id=child_id)
            forked: list[NodeInfo] = []
            record = SequenceRecord(child_id, tenant, parent.extents, parent.num_tokens, parent.state)
            try:
                for ext, on in placed:
                    if quota is not None:  # each extent's own allowance: they sum to what was reserved
                        request.max_blocks = ext.num_blocks
                    self._call(on, "Fork", request)
                    forked.append(on)
                self.store.create_sequence(record)
            except PagedKVError:
                for on in forked:
                    self._call(on, "Free", pb.SeqRequest(seq_id=child_id))
                raise
            if record.state == "active":  # its close releases them
                self._add_active(node.node_id, parent.num_blocks)
        except PagedKVError:
            if quota is not None:
                self.store.release_blocks(tenant, parent.num_blocks)
            raise
        placement = Placement(node.node_id, 0, 0, 0)
        return OpenResult(child_id, node.node_id, node.address, 0, placement, record=record)

    def close(
        self, tenant: str, seq_id: str, keep_prefix: int | None = None, *, freed_extents: int = 0
    ) -> None:
        """Drop the page table (one round trip, tenant-checked) and free the sequence on
        its node without waiting: after its node Open when that is still in flight, with
        retries when it fails. Closing a sequence whose node open failed raises that
        open's error (its page table is already gone). Idempotent: an id without a page
        table (closed already) succeeds; a lost one raises SequenceLost, once (its record
        is dropped with it; reconcile.py frees whatever a crash left on a node).

        freed_extents: the worker freed it on the nodes of its first that many extents
        already (its close heard each node's answer, so a loss reaches it:
        client/closing.py); they get no Free, except the first after this coordinator's own
        node Open of it while that is in flight (the worker's Free may have come first);
        later extents (added since the worker's handle learned them) are freed here. A
        suspect node does not hold the close: the node answered the worker after the lease
        this coordinator counts.

        Without it, while the sequence's node is a suspect (its lease lapsed, not declared
        dead) the close changes nothing and raises Unavailable: answering OK would hide a
        loss that the verdict may still declare. Retried, it gets the verdict: OK and the
        Free when the node beat again, SequenceLost once it was declared dead. Nothing leaks
        either way: the record stays until then, and a lost one expires (lost_ttl_s).

        keep_prefix: the node drops the cached blocks past that many tokens (KVCacheManager.free)."""
        c = CloseArgs(tenant, seq_id, keep_prefix, freed_extents)
        call = self._begin_close(c)
        try:
            # A suspect node keeps the record (NodeNotLive): the close answers its verdict.
            record: SequenceRecord | PagedKVError = self.store.delete_sequence(
                seq_id, tenant=tenant, require_live=not freed_extents
            )
        except PagedKVError as exc:
            record = exc
        self._end_close(c, call, record, True)

    def close_many(self, closes: Sequence[CloseArgs]) -> list[PagedKVError | None]:
        """Several closes (a framed loop's turn took them together) with their deletes in one
        store round trip (Store.delete_sequences): each None (closed) or its error. Nothing
        here waits: later extents are freed from a background thread (_end_close, may_wait=False)."""
        out: list[PagedKVError | None] = [None] * len(closes)
        begun: list[tuple[int, CloseArgs, NodeCall | None]] = []
        for i, c in enumerate(closes):
            try:
                begun.append((i, c, self._begin_close(c)))
            except PagedKVError as exc:
                out[i] = exc
        if begun:
            deletes = [(c.seq_id, c.tenant, not c.freed_extents) for _, c, _ in begun]
            records: Sequence[SequenceRecord | PagedKVError]
            try:
                records = self.store.delete_sequences(deletes)
            except PagedKVError as exc:  # (the store failed them all)
                records = [exc] * len(begun)
            for (i, c, call), record in zip(begun, records, strict=True):
                try:
                    self._end_close(c, call, record, False)
                except PagedKVError as exc:
                    out[i] = exc
        return out

    def _begin_close(self, c: CloseArgs) -> NodeCall | None:
        """A close up to its store call: checked; the node call of its id in flight, if any."""
        if c.keep_prefix is not None and c.keep_prefix < 0:  # checked here: the node's Free runs later
            raise InvalidArgument(f"keep_prefix must be >= 0 tokens, got {c.keep_prefix}")
        with self._lock:
            return self._inflight.get(c.seq_id)

    def _end_close(
        self, c: CloseArgs, call: NodeCall | None, record: SequenceRecord | PagedKVError, may_wait: bool
    ) -> None:
        """A close after its delete (`record`, or the error it raised). may_wait=False: later
        extents are freed from a background thread, after the answer (nothing waits on a node)."""
        tenant, seq_id, keep_prefix, freed_extents = c
        if isinstance(record, SequenceNotFound):
            if call is not None and call.is_finished and call.error is not None:
                raise call.error from None
            return
        if isinstance(record, NodeNotLive):
            raise self._suspect(seq_id, record.node_id) from None
        if isinstance(record, PagedKVError):
            raise record
        if record.state == "lost":  # its quota was released when it was lost
            later = record.extents[freed_extents:] if len(record.extents) > 1 else ()
            self._free_extents(later, seq_id, may_wait)  # what the live nodes still hold of it
            node_id = self.lost_node_of(record)
            raise SequenceLost(seq_id, record.lost_reason or f"node {node_id} died", node_id)
        if tenant in self.config.quotas:
            self.store.release_blocks(tenant, record.num_blocks)
        self._free_extents(record.extents[max(1, freed_extents) :], seq_id, may_wait)  # (Extend's)
        node_id = record.extents[0].node_id
        node = self._cached_node(node_id) or self.live_node(node_id)
        if node is None:  # it lapsed since the delete: reconcile.py frees the orphan if it comes back
            return
        # Freed by the worker: only after our own Open still in flight (it may land after that Free).
        if not freed_extents or (call is not None and not call.is_finished):
            self._send_free(node, seq_id, after=call, keep_prefix=keep_prefix)
        self._account(node.node_id, -record.num_blocks)
        if record.state == "active":  # a swapped one left the device's load at swap_out
            self._release_active(node.node_id, record.num_blocks)

    def _free_extents(self, extents: Sequence[Extent], seq_id: str, may_wait: bool) -> None:
        """Free these extents of a closed sequence on their nodes: now, or from a background thread."""
        for ext in extents:
            if may_wait:
                self._free_extent(ext.node_id, seq_id)
            else:
                self._background.submit(self._free_extent, ext.node_id, seq_id)

    def is_in_flight(self, seq_id: str) -> bool:
        """Whether a node call of `seq_id` sent by this process has not settled (an open of
        the id would wait for it)."""
        with self._lock:
            return seq_id in self._inflight

    def swap_out(self, tenant: str, seq_id: str) -> int:
        self._settle(seq_id)
        record = self._record(tenant, seq_id)
        placed = self.extent_nodes(record)
        node = placed[0][1]
        moved = self.swap_extents(seq_id, placed, "SwapOut", "SwapIn")
        self.store.update_sequence(seq_id, state="swapped")
        if record.state == "active":
            self._release_active(node.node_id, record.num_blocks)
        return moved

    def swap_in(self, tenant: str, seq_id: str) -> OpenResult:
        self._settle(seq_id)
        record = self._record(tenant, seq_id)
        placed = self.extent_nodes(record)
        node = placed[0][1]
        moved = self.swap_extents(seq_id, placed, "SwapIn", "SwapOut")
        self.store.update_sequence(seq_id, state="active")
        if record.state == "swapped":
            self._add_active(node.node_id, record.num_blocks)
        placement = Placement(node.node_id, 0, 0, 0)
        return OpenResult(seq_id, node.node_id, node.address, 0, placement, num_blocks=moved, record=record)

    def describe(self, tenant: str, seq_id: str) -> tuple[SequenceRecord, NodeInfo]:
        """The page table and the live node of a sequence (any worker can find it by id).
        Raises SequenceLost when its node died."""
        record = self._record(tenant, seq_id)
        return record, self._live_node_of(record)

    def pin(self, tenant: str, token_ids: Sequence[int], spec: Mapping[str, Any] | None = None) -> int:
        """Pin the prefix on every node caching part of it. Returns the most tokens pinned on one node."""
        return self._pin_call("Pin", tenant, token_ids, spec)

    def unpin(self, tenant: str, token_ids: Sequence[int], spec: Mapping[str, Any] | None = None) -> int:
        return self._pin_call("Unpin", tenant, token_ids, spec)

    def _pin_call(
        self, method: str, tenant: str, token_ids: Sequence[int], spec: Mapping[str, Any] | None
    ) -> int:
        nodes = self._nodes_for(spec)
        bs = self._block_size(spec)
        salt, root = self._salt(tenant)
        counts = self.store.match_prefix(chain_keys(root, token_ids, bs))
        holders = [nodes[n] for n, c in counts.items() if c and n in nodes]
        if not holders:
            raise InvalidArgument("no node caches any block of this prefix")
        request = pb.PinRequest(token_ids=list(token_ids), tenant_salt=salt)
        return max(int(self._call(node, method, request).num_tokens) for node in holders)

    def stats(self) -> tuple[dict[str, int], list[NodeInfo]]:
        nodes = self.refresh_nodes()
        counters = dict(self.counters)
        counters.update(self.reconciler.counters)  # orphans freed, ghosts lost: what crashes left
        counters["nodes_live"] = len(nodes)
        events = self.events  # numbered reports (event_applier.py)
        counters["events_queued"], counters["events_applied"] = events.num_queued, events.num_applied
        counters["event_flushes"], counters["event_reports_refused"] = events.num_flushes, events.num_refused
        return counters, nodes
