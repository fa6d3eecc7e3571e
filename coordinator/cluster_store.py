"""ClusterStore: the Store on Redis Cluster (redis-py's RedisCluster), the control plane's
scale-out path. URL: redis+cluster://host:port[,host:port...] (any masters; the client finds
the rest).

Layout: every key carries a hash tag, so each script touches one slot (cluster_scripts.py
declares them all in KEYS[]):

    P{nodes}                 set   registered node ids
    P{n:<id>}node / alive / nkeys / hkeys / nseqs
                                   a node's record (with its applied event seq), lease, keys
                                   (and those on its host tier), sequences: one slot per node
    P{i:<b>}idx:<key>        set   node ids holding the key: the prefix index, sharded by the
    P{i:<b>}pend:<key>       str   key's first byte <b> (256 slots); the key's in-flight marker
    P{s:<seq_id>}            hash  a sequence's record
    P{t:<tenant>}salt/usage        a tenant's salt and quota: one slot per tenant
    P{lead:<role>}           str   a role's lease

What a single Redis does in one script is here a few one-slot steps, in an order chosen so
that a reader in between sees a miss, never a wrong hit. The consistency rule:

- A node's own keys (nkeys) are the truth for what it holds; the index is written after them
  when keys are stored and cleared after them when keys go (events, purges). A match reads
  the first key's holders from the index and each holder's run from its nkeys, so an entry
  not yet written costs one open a hit, a stale one a lookup: never a block it lacks.
- An open reads (liveness, holders, runs, markers) and places by placement.place in the
  coordinator, then reserves the quota (the tenant's slot), then writes the page table (the
  sequence's slot, refused if the id is taken: the reservation is given back), then the node's
  link. Two replicas may place concurrent opens on one snapshot (as two single-Redis opens
  ordered one after the other by their arrival would not); quota is never exceeded, and a
  crash between the reservation and the write leaves the tenant charged for blocks no
  sequence holds until an operator resets usage (the single-Redis store has no such window).
- A numbered event run (apply_event_runs) is checked and applied in the node's slot, which
  records its applied seq, then its index writes follow as for events. So the node's slot is
  exact however replicas race, but the index is not: a crash in between, or two replicas'
  index writes landing out of order, leaves entries missing or stale (a miss or a lookup, by
  the rule above) until the keys' next events or a purge (a resend of the run is a replay).
- A purge (register again, remove) clears the node's slot first (its sequences unlinked, its
  keys gone), then the index entries and marks its sequences lost: in between, opens find
  the node holding nothing.

Per call costs in round trips (a cluster pipeline is one per master it touches): an open is
4-6, a close 2; membership calls 1-2 plus one per purged sequence.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from pagedkv.protos.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    PermissionDenied,
    QuotaExceeded,
    SequenceNotFound,
    Unavailable,
)

from . import cluster_scripts as cl
from . import event_run_scripts as runs_lua
from . import redis_scripts as lua
from .cluster_pipeline import run_scripts
from .event_runs import run_parts
from .placement import NodeCandidate, Placement, place
from .records import (
    BeatLoads,
    EventRun,
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
    check_name,
    check_ordinal,
    check_registration,
    check_runs,
    check_sequence_fields,
    check_ttl,
)
from .redis_store import SALT_BYTES, RedisStoreConfig, _encode_field, _node_info, _record, _s, expect_tail_arg
from .store import Store, TailMoved

SCHEME = "redis+cluster://"


def startup_nodes(url: str) -> list[ClusterNode]:
    """redis+cluster://host:port,host:port -> the nodes the client asks for the slot map."""
    if not url.startswith(SCHEME):
        raise InvalidArgument(f"a cluster URL starts with {SCHEME}, got {url!r}")
    nodes = []
    for part in url[len(SCHEME) :].rstrip("/").split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise InvalidArgument(f"bad redis cluster URL {url!r}: {part!r} is not host:port")
        nodes.append(ClusterNode(host, int(port)))
    return nodes


class ClusterStore(Store):
    def __init__(self, url: str, config: RedisStoreConfig | None = None, **options: Any) -> None:
        """url: redis+cluster://host:port[,host:port...]. options: RedisStoreConfig fields."""
        self.config = config or RedisStoreConfig(**options)
        self._beat_loads = BeatLoads()  # (an idle node's beat encodes nothing again)
        if "{" in self.config.prefix or "}" in self.config.prefix:
            raise InvalidArgument(
                f"a cluster prefix must not hold braces (hash tags), got {self.config.prefix!r}"
            )
        self._p = self.config.prefix.encode()
        try:
            self._redis = RedisCluster(
                startup_nodes=startup_nodes(url),
                decode_responses=False,
                socket_timeout=self.config.socket_timeout_s,
                socket_connect_timeout=self.config.socket_connect_timeout_s,
                max_connections=self.config.max_connections,
            )
        except redis.RedisError as e:
            raise Unavailable(f"redis cluster {url!r} unreachable: {e}") from e
        reg = self._redis.register_script
        self._register, self._remove, self._heartbeat = reg(cl.REGISTER), reg(cl.REMOVE), reg(cl.HEARTBEAT)
        self._events, self._mark_lost = reg(cl.EVENTS), reg(cl.MARK_LOST)
        self._create_seq, self._update_seq, self._delete_seq = (
            reg(cl.CREATE_SEQ),
            reg(cl.UPDATE_SEQ),
            reg(cl.DELETE_SEQ),
        )
        self._live_node, self._try_lead = reg(lua.LIVE_NODE), reg(lua.TRY_LEAD)
        self._apply_run, self._applied_seq = reg(runs_lua.CLUSTER_APPLY_EVENT_RUN), reg(runs_lua.APPLIED_SEQ)
        self._lose_seq = reg(cl.LOSE_SEQ)
        self._reserve, self._release, self._expire_lost = (
            reg(lua.RESERVE),
            reg(lua.RELEASE),
            reg(lua.EXPIRE_LOST),
        )

    def __repr__(self) -> str:
        return f"ClusterStore({self._redis.get_nodes()!r}, prefix={self.config.prefix!r})"

    observer: Callable[[str, float, bool], None] | None = None  # as RedisStore.observer

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start, ok = time.perf_counter(), False
        try:
            result = fn(*args, **kwargs)
            ok = True
            return result
        except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError) as e:
            raise Unavailable(f"redis cluster unreachable during {what}: {e}") from e
        except redis.ResponseError as e:
            if str(e).startswith(("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")):
                raise Unavailable(f"redis cluster busy during {what}: {e}") from e
            raise IntegrityError(f"redis cluster rejected {what} (a pagedkv bug): {e}") from e
        except redis.RedisError as e:
            raise Unavailable(f"redis cluster error during {what}: {e}") from e
        finally:
            if self.observer is not None:
                self.observer(what, time.perf_counter() - start, ok)

    # ---- key names (one hash tag each: see the module docstring) --------------------------------

    def _node(self, node_id: str, what: bytes) -> bytes:
        return self._p + b"{n:" + node_id.encode() + b"}" + what

    def _node_keys(self, node_id: str) -> list[bytes]:
        return [self._node(node_id, w) for w in (b"node", b"alive", b"nkeys", b"hkeys", b"nseqs")]

    def _idx(self, key: bytes) -> bytes:
        return self._p + b"{i:" + key[:1].hex().encode() + b"}idx:" + key

    def _pend(self, key: bytes) -> bytes:
        return self._p + b"{i:" + key[:1].hex().encode() + b"}pend:" + key

    def _seq(self, seq_id: str) -> bytes:
        return self._p + b"{s:" + seq_id.encode() + b"}"

    def _tenant(self, tenant: str, what: bytes) -> bytes:
        return self._p + b"{t:" + tenant.encode() + b"}" + what

    def _nodes_set(self) -> bytes:
        return self._p + b"{nodes}"

    def _pipeline(self, what: str, commands: Callable[[Any], object]) -> list[Any]:
        def run() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            commands(pipe)
            return pipe.execute()  # type: ignore[no-any-return]

        return self._call(what, run)  # type: ignore[no-any-return]

    # ---- membership ---------------------------------------------------------------------------

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
        spec_json, ttl_ms = check_registration(node_id, address, spec, num_blocks, ttl_s, epoch, policy)
        args = [address, spec_json, num_blocks, ttl_ms, epoch, policy]
        was, keys, seqs = self._call(
            "register_node", self._register, keys=self._node_keys(node_id), args=args
        )
        self._call("register_node", self._redis.sadd, self._nodes_set(), node_id)
        reason = f"node {node_id} re-registered (restarted; its blocks are gone)"
        return self._purge(node_id, bool(was), keys, seqs, reason)

    def _purge(
        self, node_id: str, was: bool, keys: list[bytes], seqs: list[bytes], reason: str
    ) -> PurgeResult:
        """The index entries and sequences of a node whose own slot was just cleared."""
        if keys:
            self._pipeline("purge", lambda pipe: [pipe.srem(self._idx(k), node_id) for k in keys])
        lost = []
        for s in seqs:
            seq_id = _s(s)
            if self._call("purge", self._mark_lost, keys=[self._seq(seq_id)], args=[reason]):
                lost.append(seq_id)
        return PurgeResult(node_id, was, len(keys), tuple(sorted(lost)))

    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        return self.heartbeats([(node_id, load)], ttl_s)[0]

    def heartbeats(self, beats: Sequence[tuple[str, Mapping[str, int]]], ttl_s: float) -> list[bool]:
        ttl = str(max(1, round(check_ttl(ttl_s) * 1000)))
        calls = [
            (self._heartbeat, self._node_keys(n)[:2], [load, ttl]) for n, load in self._beat_loads(beats)
        ]
        return [bool(r) for r in self._call("heartbeat", run_scripts, self._redis, calls)]

    def _registered(self) -> list[str]:
        return sorted(_s(m) for m in self._call("live_nodes", self._redis.smembers, self._nodes_set()))

    def _alive(self, node_ids: Sequence[str]) -> list[bool]:
        flags = self._pipeline("alive", lambda pipe: [pipe.exists(self._node(n, b"alive")) for n in node_ids])
        return [bool(f) for f in flags]

    def live_nodes(self) -> list[NodeInfo]:
        ids = self._registered()
        fields = ("address", "spec", "num_blocks", "load", "policy", "epoch")

        def commands(pipe: Any) -> None:
            for n in ids:
                pipe.exists(self._node(n, b"alive"))
                pipe.hmget(self._node(n, b"node"), *fields)

        replies = self._pipeline("live_nodes", commands)
        nodes = []
        for i, node_id in enumerate(ids):
            live, h = replies[2 * i], replies[2 * i + 1]
            if live and h[0] is not None:
                nodes.append(_node_info(node_id, h[0], h[1], h[2], h[3], h[4] or b"", h[5] or b"0"))
        return nodes

    def live_node(self, node_id: str) -> NodeInfo | None:
        check_name("node_id", node_id)
        row = self._call("live_node", self._live_node, keys=self._node_keys(node_id)[:2])
        return _node_info(node_id, *row) if row else None

    def expired_nodes(self) -> list[str]:
        ids = self._registered()
        return [n for n, live in zip(ids, self._alive(ids), strict=True) if not live]

    def remove_node(self, node_id: str, *, require_expired: bool = False) -> PurgeResult:
        check_name("node_id", node_id)
        args = ["1" if require_expired else "0"]
        code, keys, seqs = self._call("remove_node", self._remove, keys=self._node_keys(node_id), args=args)
        if code == -1:
            raise FailedPrecondition(f"node {node_id!r} is live (heartbeat renewed); not removed")
        self._call("remove_node", self._redis.srem, self._nodes_set(), node_id)
        return self._purge(node_id, bool(code), keys, seqs, f"node {node_id} died")

    def try_lead(self, role: str, holder: str, ttl_s: float) -> bool:
        check_name("role", role)
        check_name("holder", holder)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        key = self._p + b"{lead:" + role.encode() + b"}"
        return bool(self._call("try_lead", self._try_lead, keys=[key], args=[holder, ttl_ms]))

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
        keys = self._node_keys(node_id)[1:4]
        args = [len(stored), len(offloaded), *stored, *offloaded, *removed]
        reply = self._call("apply_events", self._events, keys=keys, args=args)
        if not reply[0]:
            raise NodeNotLive(node_id, "events ignored; register again")
        if stored or offloaded or reply[1]:
            self._pipeline("apply_events", lambda p: self._index(p, node_id, stored, offloaded, reply[1]))

    def _index(
        self, pipe: Any, node_id: str, stored: Sequence[bytes], offloaded: Sequence[bytes], gone: list[bytes]
    ) -> None:
        """Queue the index writes that follow a node-slot apply (the module's rule)."""
        for k in (*stored, *offloaded):
            pipe.sadd(self._idx(k), node_id)
        for k in stored:  # its in-flight marker's wait is over
            pipe.delete(self._pend(k))
        for k in gone:
            pipe.srem(self._idx(k), node_id)

    def apply_event_runs(self, runs: Sequence[EventRun]) -> list[int]:
        parts = run_parts(check_runs(runs))
        calls = [(self._apply_run, self._node_keys(p.run.node_id)[:4], p.args) for p in parts]
        replies = self._call("apply_event_runs", run_scripts, self._redis, calls)
        done = [(p, r[2]) for p, r in zip(parts, replies, strict=True) if r[1]]

        def commands(pipe: Any) -> None:  # in run order: one key's writes land in its order
            for p, gone in done:
                self._index(pipe, p.run.node_id, p.stored, p.offloaded, gone)

        if any(p.stored or p.offloaded or gone for p, gone in done):
            self._pipeline("apply_event_runs", commands)
        return [int(r[0]) for p, r in zip(parts, replies, strict=True) if p.ends]

    def applied_seq(self, node_id: str, epoch: int) -> int:
        check_name("node_id", node_id)
        args = [str(check_ordinal("epoch", epoch))]
        keys = self._node_keys(node_id)[:2]
        return int(self._call("applied_seq", self._applied_seq, keys=keys, args=args))

    def _runs(self, node_ids: Sequence[str], keys: list[bytes]) -> dict[str, tuple[int, int]]:
        """{node: (cached, host)} for these nodes that the index lists for keys[0]: their
        leading run as the node serves it (device run, then the host run continuing it)."""
        if not keys or not node_ids:
            return {}
        holders = {_s(m) for m in self._call("match", self._redis.smembers, self._idx(keys[0]))}
        ids = [n for n in node_ids if n in holders]

        def commands(pipe: Any) -> None:
            for n in ids:
                pipe.smismember(self._node(n, b"nkeys"), keys)
                pipe.smismember(self._node(n, b"hkeys"), keys)

        replies = self._pipeline("match", commands) if ids else []
        runs = {}
        for i, n in enumerate(ids):
            held_flags, host_flags = replies[2 * i], replies[2 * i + 1]
            held = next((j for j, f in enumerate(held_flags) if not f), len(keys))
            device = next((j for j in range(held) if host_flags[j]), held)
            end = next((j for j in range(device, held) if not host_flags[j]), held)
            runs[n] = (end, end - device)
        return runs

    def match_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        key_list = check_keys(keys)
        ids = self._registered()
        live = [n for n, ok in zip(ids, self._alive(ids), strict=True) if ok]
        if not key_list:
            return dict.fromkeys(live, 0)
        holders = {_s(m) for m in self._call("match", self._redis.smembers, self._idx(key_list[0]))}
        held = [n for n in live if n in holders]
        replies = self._pipeline(
            "match", lambda pipe: [pipe.smismember(self._node(n, b"nkeys"), key_list) for n in held]
        )
        out = dict.fromkeys(live, 0)
        for n, flags in zip(held, replies, strict=True):
            out[n] = next((j for j, f in enumerate(flags) if not f), len(key_list))
        return out

    def nodes_holding(self, key: bytes) -> set[str]:
        members = self._call("nodes_holding", self._redis.smembers, self._idx(check_key(key)))
        return {_s(m) for m in members}

    def keys_of(self, node_id: str) -> set[bytes]:
        check_name("node_id", node_id)
        return set(self._call("keys_of", self._redis.smembers, self._node(node_id, b"nkeys")))

    # ---- page tables --------------------------------------------------------------------------

    def _write_record(self, what: str, seq_id: str, fields: Mapping[str, Any]) -> bool:
        flat = [x for kv in fields.items() for x in kv]
        return bool(self._call(what, self._create_seq, keys=[self._seq(seq_id)], args=flat))

    def _link(self, what: str, seq_id: str, node_ids: Sequence[str], add: bool = True) -> None:
        if node_ids:
            op = "sadd" if add else "srem"
            self._pipeline(
                what, lambda pipe: [getattr(pipe, op)(self._node(n, b"nseqs"), seq_id) for n in node_ids]
            )

    def create_sequence(self, record: SequenceRecord) -> None:
        if not isinstance(record, SequenceRecord):
            raise InvalidArgument(f"expected a SequenceRecord, got {type(record).__name__}")
        nodes = list(record.node_ids)
        for n, live in zip(nodes, self._alive(nodes), strict=True):
            if not live:
                raise NodeNotLive(n, f"cannot place sequence {record.seq_id!r} there")
        fields = {
            "tenant": record.tenant,
            "extents": _encode_field("extents", record.extents),
            "num_tokens": record.num_tokens,
            "state": record.state,
            "lost_reason": record.lost_reason,
        }
        if not self._write_record("create_sequence", record.seq_id, fields):
            raise SequenceExists(record.seq_id)
        self._link("create_sequence", record.seq_id, nodes)

    def open_sequence(self, new: NewSequence) -> Placement:
        if not isinstance(new, NewSequence):
            raise InvalidArgument(f"expected a NewSequence, got {type(new).__name__}")
        keys = new.key_list()
        ids = [c.node_id for c in new.candidates]
        live = [c for c, ok in zip(new.candidates, self._alive(ids), strict=True) if ok]
        runs = self._runs([c.node_id for c in live], keys)
        # Markers on the first key each node lacks: read once per distinct position.
        wanted = sorted({runs.get(c.node_id, (0, 0))[0] for c in live} - {len(keys)})
        got = self._pipeline("open_sequence", lambda pipe: [pipe.get(self._pend(keys[i])) for i in wanted])
        markers = dict(zip(wanted, got, strict=True))
        candidates = []
        for c in live:
            cached, host = runs.get(c.node_id, (0, 0))
            pending, marker = 0, markers.get(cached)
            if marker is not None:
                count, _, owner = _s(marker).partition(":")
                if owner == c.node_id:
                    pending = max(0, min(int(count), len(keys)) - cached)
            candidates.append(
                NodeCandidate(
                    c.node_id, cached, c.free_blocks, c.total_blocks, c.evictable_blocks, pending,
                    c.recent_opens / new.opens_scale, c.active_blocks, host,
                )
            )  # fmt: skip
        tie = keys[0] if keys else b""
        placement = place(candidates, new.num_blocks, new.block_size, new.weights, tie, new.scan_classes)
        if new.quota is not None:
            if new.num_blocks:
                self.reserve_blocks(new.tenant, new.num_blocks, new.quota)
            elif (used := self.tenant_usage(new.tenant)) > new.quota:
                raise QuotaExceeded(new.tenant, requested=0, quota=new.quota, used=used)
        fields = {
            "tenant": new.tenant,
            "extents": json.dumps([[placement.node_id, 0, new.num_blocks]]),
            "num_tokens": new.num_tokens,
            "state": "active",
            "lost_reason": "",
            "req": new.request_id,
            "cached": placement.cached_blocks,
        }
        if not self._write_record("open_sequence", new.seq_id, fields):
            if new.quota is not None and new.num_blocks:
                self.release_blocks(new.tenant, new.num_blocks)  # the id was taken: give it back
            raise SequenceExists(new.seq_id)
        self._link("open_sequence", new.seq_id, [placement.node_id])
        if new.pending_ttl_ms and placement.cached_blocks < len(keys):
            marker_key = self._pend(keys[placement.cached_blocks])
            value = f"{len(keys)}:{placement.node_id}"
            self._call("open_sequence", self._redis.set, marker_key, value, px=new.pending_ttl_ms)
        return placement

    def get_sequence(self, seq_id: str) -> SequenceRecord:
        check_name("seq_id", seq_id)
        h = self._call("get_sequence", self._redis.hgetall, self._seq(seq_id))
        if not h:
            raise SequenceNotFound(seq_id)
        return _record(seq_id, [x for kv in h.items() for x in kv])

    def update_sequence(
        self, seq_id: str, *, expect_tail: tuple[str, int] | None = None, **fields: Any
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        fields = check_sequence_fields(fields)
        nodes = list(dict.fromkeys(e.node_id for e in fields.get("extents", ())))
        if "extents" in fields:
            for n, live in zip(nodes, self._alive(nodes), strict=True):
                if not live:
                    raise NodeNotLive(n, f"cannot move sequence {seq_id!r} there")
        flat = [x for name, value in fields.items() for x in (name, _encode_field(name, value))]
        if expect_tail is not None:
            flat = [lua.EXPECT_TAIL, expect_tail_arg(expect_tail), *flat]
        reply = self._call("update_sequence", self._update_seq, keys=[self._seq(seq_id)], args=flat)
        if reply[0] == 0:
            raise SequenceNotFound(seq_id)
        if reply[0] == -2:
            raise TailMoved(_record(seq_id, reply[2]), expect_tail or ("", 0))
        if "extents" in fields:
            before = [e[0] for e in json.loads(reply[1])]
            self._link("update_sequence", seq_id, [n for n in before if n not in nodes], add=False)
            self._link("update_sequence", seq_id, nodes)
        return _record(seq_id, reply[2])

    def delete_sequence(
        self, seq_id: str, *, tenant: str | None = None, require_live: bool = False
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        if tenant is not None:
            check_name("tenant", tenant)
        if require_live:
            # Liveness lives in the nodes' slots, so it is read just before the delete, not in
            # it: a node that lapses in between is as after any close (reconcile.py frees what
            # it still holds if it comes back; its record is gone either way).
            h = self._call("delete_sequence", self._redis.hgetall, self._seq(seq_id))
            if h and h.get(b"state") != b"lost" and (tenant is None or _s(h.get(b"tenant", b"")) == tenant):
                nodes = list(_record(seq_id, [x for kv in h.items() for x in kv]).node_ids)
                for n, live in zip(nodes, self._alive(nodes), strict=True):
                    if not live:
                        raise NodeNotLive(n, f"sequence {seq_id!r} is kept until its node's verdict")
        flat = self._call("delete_sequence", self._delete_seq, keys=[self._seq(seq_id)], args=[tenant or ""])
        if not flat:
            raise SequenceNotFound(seq_id)
        if len(flat) == 1:
            raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant")
        record = _record(seq_id, flat)
        self._link("delete_sequence", seq_id, list(record.node_ids), add=False)
        return record

    def mark_lost(self, seq_id: str, reason: str, ttl_s: float) -> SequenceRecord | None:
        check_name("seq_id", seq_id)
        if not isinstance(reason, str):
            raise InvalidArgument(f"reason must be a str, got {reason!r}")
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        flat = self._call("mark_lost", self._lose_seq, keys=[self._seq(seq_id)], args=[reason, ttl_ms])
        if not flat:
            return None
        record = _record(seq_id, flat)
        self._link("mark_lost", seq_id, list(record.node_ids), add=False)
        return record

    def expire_lost(self, seq_ids: Sequence[str], ttl_s: float) -> int:
        ids = [check_name("seq_id", s) for s in seq_ids]
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        return sum(
            int(self._call("expire_lost", self._expire_lost, keys=[self._seq(s)], args=[ttl_ms])) for s in ids
        )

    def sequences_of_node(self, node_id: str) -> list[SequenceRecord]:
        check_name("node_id", node_id)
        ids = sorted(
            _s(s)
            for s in self._call("sequences_of_node", self._redis.smembers, self._node(node_id, b"nseqs"))
        )
        rows = self._pipeline("sequences_of_node", lambda pipe: [pipe.hgetall(self._seq(s)) for s in ids])
        return [_record(s, [x for kv in h.items() for x in kv]) for s, h in zip(ids, rows, strict=True) if h]

    # ---- tenants ------------------------------------------------------------------------------

    def tenant_salt(self, tenant: str) -> bytes:
        check_name("tenant", tenant)
        fresh = os.urandom(SALT_BYTES)
        old = self._call(
            "tenant_salt", self._redis.set, self._tenant(tenant, b"salt"), fresh, nx=True, get=True
        )
        return fresh if old is None else bytes(old)

    def reserve_blocks(self, tenant: str, n: int, quota: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        check_count("quota", quota)
        key = self._tenant(tenant, b"usage")
        ok, used = self._call("reserve_blocks", self._reserve, keys=[key], args=[n, quota])
        if not ok:
            raise QuotaExceeded(tenant, requested=n, quota=quota, used=int(used))
        return int(used)

    def release_blocks(self, tenant: str, n: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        key = self._tenant(tenant, b"usage")
        ok, used = self._call("release_blocks", self._release, keys=[key], args=[n])
        if not ok:
            raise InvalidArgument(f"tenant {tenant!r}: cannot release {n} blocks, only {used} reserved")
        return int(used)

    def tenant_usage(self, tenant: str) -> int:
        check_name("tenant", tenant)
        value = self._call("tenant_usage", self._redis.get, self._tenant(tenant, b"usage"))
        return int(value) if value is not None else 0

    # ---- operations ---------------------------------------------------------------------------

    def ping(self) -> None:
        self._call("ping", self._redis.ping, target_nodes=RedisCluster.PRIMARIES)

    def close(self) -> None:
        self._redis.close()
