"""MemoryStore: the embedded, in-process Store (no Redis).

Same contract as RedisStore (one contract suite runs both). One lock makes every
method atomic, which is the in-process counterpart of one Lua script per call.
TTLs run on a monotonic clock, injectable so tests can move time by hand.
State dies with the process: this backend is for a single coordinator
(`pagedkv up` without Redis) and tests, never for replicas.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from pagedkv.protos.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    SequenceNotFound,
)

from .placement import NodeCandidate, Placement, place
from .records import (
    NOT_LIVE,
    EventRun,
    Extent,
    NewSequence,
    NodeInfo,
    NodeNotLive,
    PurgeResult,
    SequenceExists,
    SequenceRecord,
    check_count,
    check_events,
    check_key,
    check_keys,
    check_load,
    check_name,
    check_ordinal,
    check_policy,
    check_runs,
    check_sequence_fields,
    check_ttl,
)
from .store import Store, TailMoved

SALT_BYTES = 16


class MemoryStore(Store):
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # first uncached key of an open in flight -> (its node, its prompt's key count, expiry)
        self._pending: dict[bytes, tuple[str, int, float]] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._deadline_s: dict[str, float] = {}  # node -> clock() value its TTL lapses at
        self._holders: dict[bytes, set[str]] = {}  # block key -> nodes
        self._keys: dict[str, set[bytes]] = {}  # node -> block keys (reverse index, for purges)
        self._applied: dict[str, int] = {}  # node -> last event seq applied of this registration
        self._host: dict[str, set[bytes]] = {}  # node -> those of its keys on its host tier
        self._seqs: dict[str, SequenceRecord] = {}
        self._node_seqs: dict[str, set[str]] = {}  # node -> seq ids with an extent there
        self._salts: dict[str, bytes] = {}
        self._usage: dict[str, int] = {}
        self._lost_expiry: dict[str, float] = {}  # lost seq id -> clock() value its record goes at
        self._leases: dict[str, tuple[str, float]] = {}  # role -> (holder, clock() it lapses at)

    # ---- membership ---------------------------------------------------------------------------

    def _is_live(self, node_id: str) -> bool:
        return node_id in self._nodes and self._clock() < self._deadline_s[node_id]

    def _purge(self, node_id: str, reason: str) -> PurgeResult:
        """Drop the node's keys and mark its sequences lost; the caller holds the lock."""
        was_registered = node_id in self._nodes
        keys = self._keys.pop(node_id, set())
        self._host.pop(node_id, None)
        for key in keys:
            holders = self._holders[key]
            holders.discard(node_id)
            if not holders:
                del self._holders[key]
        lost: list[str] = []
        for seq_id in sorted(self._node_seqs.pop(node_id, set())):
            record = self._seqs.get(seq_id)
            if record is None:
                continue
            if record.state != "lost":
                self._seqs[seq_id] = replace(record, state="lost", lost_reason=reason)
            lost.append(seq_id)
        return PurgeResult(node_id, was_registered, len(keys), tuple(lost))

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
        check_name("node_id", node_id)
        check_name("address", address)
        check_count("num_blocks", num_blocks)
        check_policy(policy)
        ttl_s = check_ttl(ttl_s)
        with self._lock:
            result = self._purge(node_id, f"node {node_id} re-registered (restarted; its blocks are gone)")
            self._nodes[node_id] = NodeInfo(
                node_id, address, dict(spec), num_blocks, {}, policy, check_count("epoch", epoch)
            )
            self._deadline_s[node_id] = self._clock() + ttl_s
            self._applied[node_id] = 0
            return result

    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        check_name("node_id", node_id)
        load = check_load(load)
        ttl_s = check_ttl(ttl_s)
        with self._lock:
            if node_id not in self._nodes:  # a lapsed but unremoved node is revived
                return False
            self._deadline_s[node_id] = self._clock() + ttl_s
            self._nodes[node_id] = replace(self._nodes[node_id], load=load)
            return True

    def live_nodes(self) -> list[NodeInfo]:
        with self._lock:
            # Copies: the records' dicts must not alias the store's own.
            return [
                replace(info, spec=dict(info.spec), load=dict(info.load))
                for n, info in sorted(self._nodes.items())
                if self._is_live(n)
            ]

    def live_node(self, node_id: str) -> NodeInfo | None:
        check_name("node_id", node_id)
        with self._lock:
            info = self._nodes.get(node_id)
            if info is None or not self._is_live(node_id):
                return None
            return replace(info, spec=dict(info.spec), load=dict(info.load))

    def expired_nodes(self) -> list[str]:
        with self._lock:
            return [n for n in sorted(self._nodes) if not self._is_live(n)]

    def remove_node(self, node_id: str, *, require_expired: bool = False) -> PurgeResult:
        check_name("node_id", node_id)
        with self._lock:
            if node_id not in self._nodes:
                return PurgeResult(node_id, False, 0, ())
            if require_expired and self._is_live(node_id):
                raise FailedPrecondition(f"node {node_id!r} is live (heartbeat renewed); not removed")
            result = self._purge(node_id, f"node {node_id} died")
            del self._nodes[node_id], self._deadline_s[node_id], self._applied[node_id]
            return result

    def try_lead(self, role: str, holder: str, ttl_s: float) -> bool:
        check_name("role", role)
        check_name("holder", holder)
        ttl_s = check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            current = self._leases.get(role)
            if current is not None and current[0] != holder and now < current[1]:
                return False
            self._leases[role] = (holder, now + ttl_s)
            return True

    # ---- prefix index -------------------------------------------------------------------------

    def apply_events(
        self,
        node_id: str,
        stored: Sequence[bytes],
        removed: Sequence[bytes],
        offloaded: Sequence[bytes] = (),
    ) -> None:
        check_name("node_id", node_id)
        stored, removed, offloaded = check_events(stored, removed, offloaded)
        with self._lock:
            if not self._is_live(node_id):
                raise NodeNotLive(node_id, "events ignored; register again")
            self._apply(node_id, stored, removed, offloaded)

    def _apply(
        self, node_id: str, stored: Sequence[bytes], removed: Sequence[bytes], offloaded: Sequence[bytes]
    ) -> None:
        """apply_events' changes for checked lists; the caller holds the lock."""
        held = self._keys.setdefault(node_id, set())
        host = self._host.setdefault(node_id, set())
        pending = self._pending
        for key in stored:
            held.add(key)
            host.discard(key)
            self._holders.setdefault(key, set()).add(node_id)
            if pending:  # an in-flight marker on a key now stored: its wait is over
                pending.pop(key, None)
        for key in offloaded:  # still held, on the host tier
            held.add(key)
            host.add(key)
            self._holders.setdefault(key, set()).add(node_id)
        for key in removed:
            host.discard(key)
            if key in held:
                held.discard(key)
                holders = self._holders[key]
                holders.discard(node_id)
                if not holders:
                    del self._holders[key]
        if not held:
            del self._keys[node_id]
        if not host:
            del self._host[node_id]

    def apply_event_runs(self, runs: Sequence[EventRun]) -> list[int]:
        checked = check_runs(runs)
        with self._lock:  # the whole call at once: no parts (event_runs.py)
            return [self._apply_run(run) for run in checked]

    def _apply_run(self, run: EventRun) -> int:
        """One checked run (event_run_scripts.py says why an overlapping one applies whole)."""
        applied = self._applied_under(run.node_id, run.epoch)
        gap = run.first_seq > max(applied, run.base_seq) + 1
        if applied == NOT_LIVE or not applied < run.last_seq or gap:
            return applied  # not live, a replay or a gap: nothing changes
        self._apply(run.node_id, run.stored, run.removed, run.offloaded)
        self._applied[run.node_id] = run.last_seq
        return run.last_seq

    def _applied_under(self, node_id: str, epoch: int) -> int:
        if not self._is_live(node_id) or self._nodes[node_id].epoch != epoch:
            return NOT_LIVE
        return self._applied[node_id]

    def applied_seq(self, node_id: str, epoch: int) -> int:
        check_name("node_id", node_id)
        check_ordinal("epoch", epoch)
        with self._lock:
            return self._applied_under(node_id, epoch)

    def match_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        keys = check_keys(keys)
        with self._lock:
            return self._match([n for n in sorted(self._nodes) if self._is_live(n)], keys)

    def _match(self, active: list[str], keys: Sequence[bytes]) -> dict[str, int]:
        """Leading keys each of `active` holds; the caller holds the lock."""
        counts: dict[str, int] = {}
        for i, key in enumerate(keys):
            holders = self._holders.get(key, set())
            for node_id in active:
                if node_id not in holders:
                    counts[node_id] = i
            active = [n for n in active if n in holders]
            if not active:
                break
        for node_id in active:
            counts[node_id] = len(keys)
        return counts

    def nodes_holding(self, key: bytes) -> set[str]:
        check_key(key)
        with self._lock:
            return set(self._holders.get(key, ()))

    def keys_of(self, node_id: str) -> set[bytes]:
        check_name("node_id", node_id)
        with self._lock:
            return set(self._keys.get(node_id, ()))

    # ---- page tables --------------------------------------------------------------------------

    def _check_live_nodes(self, record: SequenceRecord) -> None:
        for node_id in record.node_ids:
            if not self._is_live(node_id):
                raise NodeNotLive(node_id, f"cannot place sequence {record.seq_id!r} there")

    def create_sequence(self, record: SequenceRecord) -> None:
        if not isinstance(record, SequenceRecord):
            raise InvalidArgument(f"expected a SequenceRecord, got {type(record).__name__}")
        with self._lock:
            self._sweep_lost()
            if record.seq_id in self._seqs:
                raise SequenceExists(record.seq_id)
            self._check_live_nodes(record)
            self._seqs[record.seq_id] = record
            for node_id in record.node_ids:
                self._node_seqs.setdefault(node_id, set()).add(record.seq_id)

    def open_sequence(self, new: NewSequence) -> Placement:
        if not isinstance(new, NewSequence):
            raise InvalidArgument(f"expected a NewSequence, got {type(new).__name__}")
        with self._lock:
            self._sweep_lost()
            live = [c for c in new.candidates if self._is_live(c.node_id)]
            keys = new.key_list()
            counts = self._match([c.node_id for c in live], keys)
            candidates = []
            for c in live:
                cached, host = self._tiers(c.node_id, keys, counts[c.node_id])
                candidates.append(
                    NodeCandidate(
                        c.node_id,
                        cached,
                        c.free_blocks,
                        c.total_blocks,
                        c.evictable_blocks,
                        self._pending_on(c.node_id, keys, cached),
                        c.recent_opens / new.opens_scale,
                        c.active_blocks,
                        host,
                    )
                )
            placement = place(
                candidates,
                new.num_blocks,
                new.block_size,
                new.weights,
                keys[0] if keys else b"",
                new.scan_classes,
            )
            used = self._usage.get(new.tenant, 0)
            if new.quota is not None and used + new.num_blocks > new.quota:
                raise QuotaExceeded(new.tenant, requested=new.num_blocks, quota=new.quota, used=used)
            if new.seq_id in self._seqs:
                raise SequenceExists(new.seq_id)
            extents = (Extent(placement.node_id, 0, new.num_blocks),)
            self._seqs[new.seq_id] = SequenceRecord(
                new.seq_id,
                new.tenant,
                extents,
                new.num_tokens,
                request_id=new.request_id,
                num_cached_blocks=placement.cached_blocks,
            )
            self._node_seqs.setdefault(placement.node_id, set()).add(new.seq_id)
            if new.quota is not None and new.num_blocks:
                self._usage[new.tenant] = used + new.num_blocks
            if new.pending_ttl_ms and placement.cached_blocks < len(keys):
                now = self._clock()
                expiry = now + new.pending_ttl_ms / 1000
                if len(self._pending) > 4096:  # markers nobody asked about again: drop the lapsed ones
                    self._pending = {k: m for k, m in self._pending.items() if m[2] > now}
                self._pending[keys[placement.cached_blocks]] = (placement.node_id, len(keys), expiry)
            return placement

    def _tiers(self, node_id: str, keys: list[bytes], held: int) -> tuple[int, int]:
        """(cached, host) of the node's `held` leading keys as the node serves them: its device
        run, then the host run that continues it (a device key after a host run is not reached);
        the caller holds the lock."""
        host_keys = self._host.get(node_id)
        if not host_keys:
            return held, 0
        device = next((i for i in range(held) if keys[i] in host_keys), held)
        end = next((i for i in range(device, held) if keys[i] not in host_keys), held)
        return end, end - device

    def _pending_on(self, node_id: str, keys: list[bytes], cached: int) -> int:
        """Blocks after the node's cached prefix that an open in flight brings it (placement.py's
        in-flight marker on the first uncached key); the caller holds the lock."""
        if cached >= len(keys):
            return 0
        marker = self._pending.get(keys[cached])
        if marker is None or marker[0] != node_id:
            return 0
        if marker[2] <= self._clock():
            del self._pending[keys[cached]]
            return 0
        return max(0, min(marker[1], len(keys)) - cached)

    def get_sequence(self, seq_id: str) -> SequenceRecord:
        check_name("seq_id", seq_id)
        with self._lock:
            self._sweep_lost()
            if seq_id not in self._seqs:
                raise SequenceNotFound(seq_id)
            return self._seqs[seq_id]

    def update_sequence(
        self, seq_id: str, *, expect_tail: tuple[str, int] | None = None, **fields: Any
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        fields = check_sequence_fields(fields)
        with self._lock:
            self._sweep_lost()
            old = self._seqs.get(seq_id)
            if old is None:
                raise SequenceNotFound(seq_id)
            tail = old.extents[-1]
            if expect_tail is not None and (tail.node_id, tail.first_logical_block) != tuple(expect_tail):
                raise TailMoved(old, expect_tail)
            new = replace(old, **fields)
            if "extents" in fields:
                self._check_live_nodes(new)
                self._unlink(old)
                for node_id in new.node_ids:
                    self._node_seqs.setdefault(node_id, set()).add(seq_id)
            self._seqs[seq_id] = new
            return new

    def _unlink(self, record: SequenceRecord) -> None:
        for node_id in record.node_ids:
            seqs = self._node_seqs.get(node_id)
            if seqs is not None:
                seqs.discard(record.seq_id)
                if not seqs:
                    del self._node_seqs[node_id]

    def delete_sequence(
        self, seq_id: str, *, tenant: str | None = None, require_live: bool = False
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        if tenant is not None:
            check_name("tenant", tenant)
        with self._lock:
            self._sweep_lost()
            record = self._seqs.get(seq_id)
            if record is None:
                raise SequenceNotFound(seq_id)
            if tenant is not None and record.tenant != tenant:
                raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant")
            if require_live and record.state != "lost":
                for node_id in record.node_ids:
                    if not self._is_live(node_id):
                        raise NodeNotLive(node_id, f"sequence {seq_id!r} is kept until its node's verdict")
            del self._seqs[seq_id]
            self._unlink(record)
            return record

    def mark_lost(self, seq_id: str, reason: str, ttl_s: float) -> SequenceRecord | None:
        check_name("seq_id", seq_id)
        if not isinstance(reason, str):
            raise InvalidArgument(f"reason must be a str, got {reason!r}")
        ttl = check_ttl(ttl_s)
        with self._lock:
            self._sweep_lost()
            record = self._seqs.get(seq_id)
            if record is None or record.state == "lost":
                return None
            self._unlink(record)
            self._seqs[seq_id] = replace(record, state="lost", lost_reason=reason)
            self._lost_expiry[seq_id] = self._clock() + ttl
            return record

    def expire_lost(self, seq_ids: Sequence[str], ttl_s: float) -> int:
        ttl = check_ttl(ttl_s)
        ids = [check_name("seq_id", s) for s in seq_ids]
        with self._lock:
            self._sweep_lost()
            lost = [s for s in ids if s in self._seqs and self._seqs[s].state == "lost"]
            for seq_id in lost:
                self._lost_expiry[seq_id] = self._clock() + ttl
            return len(lost)

    def _sweep_lost(self) -> None:
        """Drop the lost records whose expiry passed (under the lock)."""
        if not self._lost_expiry:
            return
        now = self._clock()
        for seq_id in [s for s, at in self._lost_expiry.items() if at <= now]:
            del self._lost_expiry[seq_id]
            record = self._seqs.get(seq_id)
            if record is not None and record.state == "lost":
                del self._seqs[seq_id]
                self._unlink(record)

    def sequences_of_node(self, node_id: str) -> list[SequenceRecord]:
        check_name("node_id", node_id)
        with self._lock:
            self._sweep_lost()
            return [self._seqs[s] for s in sorted(self._node_seqs.get(node_id, ()))]

    # ---- tenants ------------------------------------------------------------------------------

    def tenant_salt(self, tenant: str) -> bytes:
        check_name("tenant", tenant)
        with self._lock:
            return self._salts.setdefault(tenant, os.urandom(SALT_BYTES))

    def reserve_blocks(self, tenant: str, n: int, quota: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        check_count("quota", quota)
        with self._lock:
            used = self._usage.get(tenant, 0)
            if used + n > quota:
                raise QuotaExceeded(tenant, requested=n, quota=quota, used=used)
            self._usage[tenant] = used + n
            return used + n

    def release_blocks(self, tenant: str, n: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        with self._lock:
            used = self._usage.get(tenant, 0)
            if n > used:
                raise InvalidArgument(f"tenant {tenant!r}: cannot release {n} blocks, only {used} reserved")
            if used == n:
                self._usage.pop(tenant, None)
            else:
                self._usage[tenant] = used - n
            return used - n

    def tenant_usage(self, tenant: str) -> int:
        check_name("tenant", tenant)
        with self._lock:
            return self._usage.get(tenant, 0)

    def ping(self) -> None:
        return None
