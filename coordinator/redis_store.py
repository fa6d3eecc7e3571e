"""RedisStore: the Store on Redis (redis-py, bytes in and out).

Layout, every key under a configurable prefix P (default "pkv:"):

    P nodes            set   registered node ids
    P node:<id>        hash  address, spec (JSON), num_blocks, load (JSON), policy, epoch,
                             applied (and run): its numbered events (event_run_scripts.py)
    P alive:<id>       str   liveness; PX TTL renewed by heartbeats (tooz style)
    P nkeys:<id>       set   block keys the node holds   (reverse index: purges)
    P hkeys:<id>       set   of those, the ones on its host tier
    P idx:<key16>      set   node ids holding the key    (the global prefix index)
    P nseqs:<id>       set   seq ids with an extent on the node
    P seq:<seq_id>     hash  tenant, extents (JSON), num_tokens, state, lost_reason
    P salt:<tenant>    str   16 random bytes, SET NX (first writer wins)
    P usage:<tenant>   int   blocks reserved
    P lead:<role>      str   the holder of a role's lease (the reaper), PX TTL
    P rooms:<t>:<set>  hash  one store's candidate rows, kept between opens (room_table.py)

Every multi-key update is one Lua script (atomic; one round trip; redis_scripts.py). Scripts build
key names from P inside Redis, so this targets a single Redis (or a primary with
replicas); on Redis Cluster use ClusterStore (cluster_store.py, redis+cluster:// URLs),
whose keys carry hash tags. A purge of a node with many keys runs in one script
and blocks Redis for its duration (~1 ms per 10k keys).

Errors: connection failures and timeouts become Unavailable. The client retries
(one Retry value, set below) on ConnectionError only: that covers a pooled
connection that died while Redis restarted; a timeout is not retried, because
the command may have run and not every call (reserve_blocks) is idempotent.
EVALSHA's NOSCRIPT after a Redis restart is handled by redis-py's Script (it
reloads and retries), so a store survives an outage without being recreated.
The per-request scripts (open_sequence, match_prefix, delete_sequence) and the pipelined
apply_event_runs go through KeptScripts (kept_script.py): the same EVALSHA, retry and NOSCRIPT handling on a
connection kept for them, without redis-py's per-call machinery.
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.commands.core import Script
from redis.retry import Retry

from pagedkv.protos.errors import (
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    PagedKVError,
    PermissionDenied,
    QuotaExceeded,
    SequenceNotFound,
    Unavailable,
)

from . import event_run_scripts as runs_lua
from . import redis_scripts as lua
from .event_runs import batch_parts, run_parts
from .kept_script import KeptScripts
from .placement import Placement, no_room
from .records import (
    BeatLoads,
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
    check_name,
    check_ordinal,
    check_registration,
    check_runs,
    check_sequence_fields,
    check_ttl,
    ids_have_separators,
)
from .room_table import RoomTables
from .sentinel import SCHEME as SENTINEL_SCHEME
from .sentinel import primary_client
from .shortlist import SIZE as SHORTLIST
from .shortlist import WEIGH_ALL, shortlist
from .store import Store, TailMoved

SALT_BYTES = 16


@dataclass(frozen=True)
class RedisStoreConfig:
    """Connection settings. Timeouts bound how long a call can hang when Redis is gone."""

    prefix: str = "pkv:"
    socket_timeout_s: float = 1.0
    socket_connect_timeout_s: float = 0.5
    retries: int = 2
    max_connections: int = 64

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise InvalidArgument(f"prefix must be a non-empty str, got {self.prefix!r}")
        for name in ("socket_timeout_s", "socket_connect_timeout_s"):
            if not isinstance(getattr(self, name), int | float) or getattr(self, name) <= 0:
                raise InvalidArgument(f"{name} must be > 0, got {getattr(self, name)!r}")
        check_count("retries", self.retries)
        if self.max_connections < 1:
            raise InvalidArgument(f"max_connections must be >= 1, got {self.max_connections!r}")


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _record(seq_id: str, flat: Sequence[bytes]) -> SequenceRecord:
    h = {_s(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}
    return SequenceRecord(
        seq_id=seq_id,
        tenant=_s(h["tenant"]),
        extents=tuple(Extent(n, f, b) for n, f, b in json.loads(h["extents"])),
        num_tokens=int(h["num_tokens"]),
        state=_s(h["state"]),
        lost_reason=_s(h.get("lost_reason", b"")),
        request_id=_s(h.get("req", b"")),
        num_cached_blocks=int(h.get("cached", 0)),
    )


def _node_info(
    node_id: str, addr: bytes, spec: bytes, nb: bytes, load: bytes, policy: bytes, epoch: bytes
) -> NodeInfo:
    return NodeInfo(node_id, _s(addr), json.loads(spec), int(nb), json.loads(load), _s(policy), int(epoch))


def _placement(new: NewSequence, reply: Sequence[Any]) -> Placement:
    """The open script's reply as a Placement, or the error it names."""
    code = reply[0]
    if code == 1:
        flat = reply[3]
        cached = int(reply[2])
        return Placement(
            node_id=_s(reply[1]),
            cached_blocks=cached,
            cached_tokens=cached * new.block_size,
            new_blocks=new.num_blocks - cached,
            scores={_s(flat[i]): float(flat[i + 1]) for i in range(0, len(flat), 2)},
            rejected=tuple(sorted(_s(n) for n in reply[4])),
            pending_blocks=int(reply[5]),
            cached_elsewhere_blocks=int(reply[6]),
            host_blocks=int(reply[7]),
            is_scan=bool(reply[8]),
            cached_elsewhere_node_id=_s(reply[9]),
        )
    if code == 0:
        raise Unavailable("no live cache node to place a sequence on")
    if code == -4:  # gone again right after it was sent whole: Redis is restarting
        raise Unavailable("redis lost the open's room table twice; retry")
    if code == -1:
        raise no_room(new.num_blocks, int(reply[1]), int(reply[2]))
    if code == -2:
        quota = new.quota or 0  # -2 only comes with a quota
        raise QuotaExceeded(new.tenant, requested=new.num_blocks, quota=quota, used=int(reply[1]))
    raise SequenceExists(new.seq_id)


def _deleted(seq_id: str, flat: Sequence[Any]) -> SequenceRecord:
    """The delete script's reply as the record it removed, or the error it names."""
    if not flat:
        raise SequenceNotFound(seq_id)
    if len(flat) == 1:
        raise PermissionDenied(f"sequence {seq_id!r} belongs to another tenant")
    if flat[0] == b"!live":
        raise NodeNotLive(_s(flat[1]), f"sequence {seq_id!r} is kept until its node's verdict")
    return _record(seq_id, flat)


def _purge_result(node_id: str, reply: Sequence[Any]) -> PurgeResult:
    return PurgeResult(node_id, bool(reply[0]), int(reply[1]), tuple(sorted(_s(s) for s in reply[2])))


def expect_tail_arg(expect_tail: tuple[str, int]) -> str:
    """update_sequence's expect_tail as the scripts compare it (lua.EXPECT_TAIL)."""
    node_id, first_block = expect_tail
    return f"{node_id}@{int(first_block)}"


def _encode_field(name: str, value: Any) -> str | int:
    if name == "extents":
        return json.dumps([list(e) for e in value])
    return value  # type: ignore[no-any-return]


class RedisStore(Store):
    def __init__(self, url: str, config: RedisStoreConfig | None = None, **options: Any) -> None:
        """url: redis://host:port/db, or redis+sentinel://host:port,.../mastername (sentinel.py).
        options: RedisStoreConfig fields (prefix=..., ...)."""
        self.config = config or RedisStoreConfig(**options)
        self._url = url
        self._beat_loads = BeatLoads()  # (an idle node's beat encodes nothing again)
        self._prefix = self.config.prefix
        # The one place transient failures are retried (see the module docstring).
        retry = Retry(
            ExponentialBackoff(cap=0.2, base=0.02),
            self.config.retries,
            supported_errors=(redis.ConnectionError,),
        )
        connect = primary_client if url.startswith(SENTINEL_SCHEME) else redis.Redis.from_url
        try:
            self._redis = connect(
                url,
                decode_responses=False,
                socket_timeout=self.config.socket_timeout_s,
                socket_connect_timeout=self.config.socket_connect_timeout_s,
                retry=retry,
                retry_on_error=[redis.ConnectionError],
                max_connections=self.config.max_connections,
            )
        except ValueError as e:
            raise InvalidArgument(f"bad redis URL {url!r}: {e}") from e
        reg = self._redis.register_script
        self._register = reg(lua.REGISTER)
        self._remove = reg(lua.REMOVE)
        self._heartbeat = reg(lua.HEARTBEAT)
        self._list_nodes = reg(lua.LIST_NODES)
        self._live_node = reg(lua.LIVE_NODE)
        self._try_lead = reg(lua.TRY_LEAD)
        self._apply_events = reg(lua.APPLY_EVENTS)
        self._apply_event_runs = reg(runs_lua.APPLY_EVENT_RUNS)
        self._applied_seq = reg(runs_lua.APPLIED_SEQ)
        self._match_prefix = reg(lua.MATCH_PREFIX)
        self._open_seq = reg(lua.OPEN_SEQ)
        self._drop_key = reg(lua.DROP_KEY)
        self._create_seq = reg(lua.CREATE_SEQ)
        self._update_seq = reg(lua.UPDATE_SEQ)
        self._delete_seq = reg(lua.DELETE_SEQ)
        self._seqs_of_node = reg(lua.SEQS_OF_NODE)
        self._reserve = reg(lua.RESERVE)
        self._expire_lost = reg(lua.EXPIRE_LOST)
        self._mark_lost = reg(lua.MARK_LOST)
        self._release = reg(lua.RELEASE)
        self._kept = KeptScripts(self._redis)
        self._rooms = RoomTables(self._prefix.encode())
        self._listed: dict[bytes, tuple[tuple[bytes, ...], NodeInfo]] = {}  # live_nodes' last rows

    def __repr__(self) -> str:
        return f"RedisStore({self._redis.connection_pool!r}, prefix={self._prefix!r})"

    # Called after every Redis call with (op, seconds, ok) when set (the coordinator's metrics).
    observer: Callable[[str, float, bool], None] | None = None

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one Redis call, translating redis-py's errors into the pagedkv hierarchy.

        Returns Any: redis-py's reply types are too loose to be useful here."""
        if self.observer is None:
            return self._call_redis(what, fn, *args, **kwargs)
        start, ok = time.perf_counter(), False
        try:
            result = self._call_redis(what, fn, *args, **kwargs)
            ok = True
            return result
        finally:
            self.observer(what, time.perf_counter() - start, ok)

    def _call_redis(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise Unavailable(f"redis unreachable during {what}: {e}") from e
        except (redis.ReadOnlyError, redis.exceptions.OutOfMemoryError) as e:
            raise Unavailable(f"redis refused {what}: {e}") from e
        except redis.ResponseError as e:
            if str(e).startswith(("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN")):
                raise Unavailable(f"redis busy during {what}: {e}") from e
            raise IntegrityError(f"redis rejected {what} (a pagedkv bug): {e}") from e
        except redis.RedisError as e:
            raise Unavailable(f"redis error during {what}: {e}") from e

    def _key(self, *parts: str | bytes) -> bytes:
        return self._prefix.encode() + b"".join(p.encode() if isinstance(p, str) else p for p in parts)

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
        reason = f"node {node_id} re-registered (restarted; its blocks are gone)"
        args = [
            self._prefix,
            node_id,
            address,
            spec_json,
            num_blocks,
            ttl_ms,
            reason,
            epoch,
            policy,
        ]
        reply = self._call("register_node", self._register, args=args)
        return _purge_result(node_id, reply)

    def heartbeat(self, node_id: str, load: Mapping[str, int], ttl_s: float) -> bool:
        return self.heartbeats([(node_id, load)], ttl_s)[0]

    def heartbeats(self, beats: Sequence[tuple[str, Mapping[str, int]]], ttl_s: float) -> list[bool]:
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        calls = [(self._heartbeat, [self._prefix, n, load, ttl_ms]) for n, load in self._beat_loads(beats)]
        return [bool(r) for r in self._call("heartbeat", self._kept.run_many, calls)]

    def live_nodes(self) -> list[NodeInfo]:
        rows = self._call("live_nodes", self._list_nodes, args=[self._prefix, "1"])
        # A row as it was last listed keeps its NodeInfo: a reaper tick lists every node (lease/4)
        # and most did not change; parsing 1,000 of them took ~20 ms of the tick.
        memo, kept = self._listed, {}
        nodes = []
        for row in rows:
            raw = tuple(row)  # (id, address, spec, num_blocks, load, policy, epoch)
            last = memo.get(raw[0])
            if last is None:
                node = _node_info(_s(raw[0]), *raw[1:])
            elif last[0] == raw:
                node = last[1]
            elif last[0][:4] == raw[:4] and last[0][5:] == raw[5:]:  # a beat changed its load only
                node = last[1].with_load(json.loads(raw[4]))
            else:
                node = _node_info(_s(raw[0]), *raw[1:])
            kept[raw[0]] = (raw, node)
            nodes.append(node)
        self._listed = kept
        return sorted(nodes, key=lambda n: n.node_id)

    def live_node(self, node_id: str) -> NodeInfo | None:
        check_name("node_id", node_id)
        keys = [self._key("node:", node_id), self._key("alive:", node_id)]
        row = self._call("live_node", self._live_node, keys=keys)
        if not row:
            return None
        return _node_info(node_id, *row)

    def try_lead(self, role: str, holder: str, ttl_s: float) -> bool:
        check_name("role", role)
        check_name("holder", holder)
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        return bool(
            self._call("try_lead", self._try_lead, keys=[self._key("lead:", role)], args=[holder, ttl_ms])
        )

    def expired_nodes(self) -> list[str]:
        rows = self._call("expired_nodes", self._list_nodes, args=[self._prefix, "0"])
        return sorted(_s(i) for i in rows)

    def remove_node(self, node_id: str, *, require_expired: bool = False) -> PurgeResult:
        check_name("node_id", node_id)
        args = [self._prefix, node_id, "1" if require_expired else "0", f"node {node_id} died"]
        reply = self._call("remove_node", self._remove, args=args)
        if reply[0] == -1:
            raise FailedPrecondition(f"node {node_id!r} is live (heartbeat renewed); not removed")
        return _purge_result(node_id, reply)

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
        args = [self._prefix, node_id, len(stored), len(offloaded), *stored, *offloaded, *removed]
        if not self._call("apply_events", self._kept.run, self._apply_events, args):
            raise NodeNotLive(node_id, "events ignored; register again")

    def apply_event_runs(self, runs: Sequence[EventRun]) -> list[int]:
        parts = run_parts(check_runs(runs))
        calls = [(self._apply_event_runs, [self._prefix, *args]) for args in batch_parts(parts)]
        replies = self._call("apply_event_runs", self._kept.run_many, calls)
        answers = [answer for reply in replies for answer in reply]  # (one a part, in order)
        return [int(answer) for part, answer in zip(parts, answers, strict=True) if part.ends]

    def applied_seq(self, node_id: str, epoch: int) -> int:
        check_name("node_id", node_id)
        keys = [self._key("node:", node_id), self._key("alive:", node_id)]
        args = [str(check_ordinal("epoch", epoch))]
        return int(self._call("applied_seq", self._applied_seq, keys=keys, args=args))

    def match_prefix(self, keys: Sequence[bytes]) -> dict[str, int]:
        keys = check_keys(keys)
        flat = self._call("match_prefix", self._kept.run, self._match_prefix, [self._prefix, b"".join(keys)])
        return {_s(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def nodes_holding(self, key: bytes) -> set[str]:
        members = self._call("nodes_holding", self._redis.smembers, self._key("idx:", check_key(key)))
        return {_s(m) for m in members}

    def keys_of(self, node_id: str) -> set[bytes]:
        check_name("node_id", node_id)
        return set(self._call("keys_of", self._redis.smembers, self._key("nkeys:", node_id)))

    # ---- page tables --------------------------------------------------------------------------

    def create_sequence(self, record: SequenceRecord) -> None:
        if not isinstance(record, SequenceRecord):
            raise InvalidArgument(f"expected a SequenceRecord, got {type(record).__name__}")
        args = [
            self._prefix,
            record.seq_id,
            record.tenant,
            _encode_field("extents", record.extents),
            record.num_tokens,
            record.state,
            record.lost_reason,
            *record.node_ids,
        ]
        reply = self._call("create_sequence", self._create_seq, args=args)
        if reply[0] == 0:
            raise SequenceExists(record.seq_id)
        if reply[0] == -1:
            raise NodeNotLive(_s(reply[1]), f"cannot place sequence {record.seq_id!r} there")

    def open_sequence(self, new: NewSequence) -> Placement:
        head = self._open_head(new)
        for _ in range(2):  # a second time, whole, when the room table was gone
            call, uses_table = self._open_call(new, head)
            try:
                reply = self._call("open_sequence", self._kept.run, self._open_seq, call)
            except Unavailable:
                if uses_table:
                    self._rooms.forget(new.candidates)  # it may not have been written
                raise
            if reply[0] != -4:
                break
            self._rooms.forget(new.candidates)
        return _placement(new, reply)

    weighs_batches = True

    def open_sequences(self, news: Sequence[NewSequence]) -> list[Placement | PagedKVError]:
        """Every open script sent in one write, the replies read in order (one round trip);
        one that found its room table gone is sent again alone, whole. The scripts share a
        hash of what the batch's earlier opens placed (the open script weighs it), and the
        i-th weighs a shortlist i longer: the batch spreads as opens one after the other."""
        if len(news) < 2:
            return super().open_sequences(news)
        out: list[Placement | PagedKVError | None] = [None] * len(news)
        sent: list[int] = []
        calls: list[tuple[Script, list[Any]]] = []
        batch = self._key("batch:", uuid.uuid4().hex)
        for i, new in enumerate(news):
            try:
                call, _ = self._open_call(new, self._open_head(new), batch, SHORTLIST + len(sent))
            except PagedKVError as exc:
                out[i] = exc
                continue
            sent.append(i)
            calls.append((self._open_seq, list(call)))
        try:
            calls.append((self._drop_key, [batch]))  # (its reply dropped)
            replies = self._call("open_sequence", self._kept.run_many, calls)[:-1]
        except PagedKVError as exc:
            for i in sent:
                self._rooms.forget(news[i].candidates)  # they may not have been written
                out[i] = exc
            return out  # type: ignore[return-value]  # (every slot set)
        for i, reply in zip(sent, replies, strict=True):
            try:
                if reply[0] == -4:
                    self._rooms.forget(news[i].candidates)
                    out[i] = self.open_sequence(news[i])
                else:
                    out[i] = _placement(news[i], reply)
            except PagedKVError as exc:
                out[i] = exc
        return out  # type: ignore[return-value]

    def _open_head(self, new: NewSequence) -> list[str | int | bytes]:
        """The open script's arguments every open sends (checked: InvalidArgument)."""
        if not isinstance(new, NewSequence):
            raise InvalidArgument(f"expected a NewSequence, got {type(new).__name__}")
        # A tab or line feed in a node id would shift the columns of the rows.
        if ids_have_separators(new.candidates):
            raise InvalidArgument("candidate node ids must not contain tabs or line feeds")
        w = new.weights
        return [
            self._prefix,
            new.seq_id,
            new.tenant,
            new.num_tokens,
            new.num_blocks,
            repr(float(w.overlap_weight)),
            repr(float(w.load_weight)),
            "" if new.quota is None else new.quota,
            new.keys,
            repr(float(w.balance_slack)) if math.isfinite(w.balance_slack) else "-1",
            new.pending_ttl_ms,
            repr(float(w.affinity_share)),
            repr(float(w.balance_margin)),
            repr(float(w.host_weight)),
            new.scan_classes,
        ]

    def _open_call(
        self, new: NewSequence, head: list[str | int | bytes], batch: bytes = b"", size: int = SHORTLIST
    ) -> tuple[tuple[Any, ...], bool]:
        """The open script's whole arguments (`batch`: its batch's hash, `size`: the shortlist's
        length); whether they took rows from the room table."""
        tail: tuple[Any, ...] = (batch,) if batch else ()
        if len(new.candidates) <= WEIGH_ALL:  # every row travels and is weighed
            rows = "".join(
                f"\n{c[0]}\t{c[1]}\t{c[2]}\t{c[3]}\t{c[4]!r}\t{-1 if c[5] is None else c[5]}"
                for c in new.candidates
            )
            tail = ("",) * 5 + tail if tail else ()
            return (*head, rows, new.request_id, repr(float(new.opens_scale)), *tail), False
        # the holders and a shortlist are weighed, from the room table (room_table.py)
        w = new.weights
        short = shortlist(
            new.candidates, new.num_blocks, w, new.keys[:16], new.scan_classes, size, new.opens_scale
        )
        table = self._rooms.args(new.candidates)
        call = (*head, table.rows, new.request_id, repr(float(new.opens_scale)), table.key)
        call += ("1" if table.full else "0", "\t".join(short.ids), repr(short.sum_opens), short.sum_total)
        return (*call, *tail), True

    def get_sequence(self, seq_id: str) -> SequenceRecord:
        check_name("seq_id", seq_id)
        h = self._call("get_sequence", self._redis.hgetall, self._key("seq:", seq_id))
        if not h:
            raise SequenceNotFound(seq_id)
        return _record(seq_id, [x for kv in h.items() for x in kv])

    def update_sequence(
        self, seq_id: str, *, expect_tail: tuple[str, int] | None = None, **fields: Any
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        fields = check_sequence_fields(fields)
        flat = [x for name, value in fields.items() for x in (name, _encode_field(name, value))]
        nodes = list(dict.fromkeys(e.node_id for e in fields.get("extents", ())))
        tail = [] if expect_tail is None else [lua.EXPECT_TAIL, expect_tail_arg(expect_tail)]
        args = [self._prefix, seq_id, len(flat) + len(tail), *tail, *flat, *nodes]
        reply = self._call("update_sequence", self._update_seq, args=args)
        if reply[0] == 0:
            raise SequenceNotFound(seq_id)
        if reply[0] == -1:
            raise NodeNotLive(_s(reply[1]), f"cannot move sequence {seq_id!r} there")
        if reply[0] == -2:
            raise TailMoved(_record(seq_id, reply[1]), expect_tail or ("", 0))
        return _record(seq_id, reply[1])

    def delete_sequence(
        self, seq_id: str, *, tenant: str | None = None, require_live: bool = False
    ) -> SequenceRecord:
        check_name("seq_id", seq_id)
        if tenant is not None:
            check_name("tenant", tenant)
        args = [self._prefix, seq_id, tenant or ""] + (["1"] if require_live else [])
        return _deleted(seq_id, self._call("delete_sequence", self._kept.run, self._delete_seq, args))

    def delete_sequences(
        self, deletes: Sequence[tuple[str, str | None, bool]]
    ) -> list[SequenceRecord | PagedKVError]:
        """Every delete script sent in one write, the replies read in order (one round trip)."""
        if len(deletes) < 2:
            return super().delete_sequences(deletes)
        out: list[SequenceRecord | PagedKVError | None] = [None] * len(deletes)
        sent: list[int] = []
        calls: list[tuple[Script, list[Any]]] = []
        for i, (seq_id, tenant, require_live) in enumerate(deletes):
            try:
                check_name("seq_id", seq_id)
                if tenant is not None:
                    check_name("tenant", tenant)
            except PagedKVError as exc:
                out[i] = exc
                continue
            sent.append(i)
            args = [self._prefix, seq_id, tenant or ""] + (["1"] if require_live else [])
            calls.append((self._delete_seq, args))
        try:
            replies = self._call("delete_sequence", self._kept.run_many, calls)
        except PagedKVError as exc:
            replies = [exc] * len(sent)
        for i, reply in zip(sent, replies, strict=True):
            try:
                out[i] = reply if isinstance(reply, PagedKVError) else _deleted(deletes[i][0], reply)
            except PagedKVError as exc:
                out[i] = exc
        return out  # type: ignore[return-value]  # (every slot set)

    def mark_lost(self, seq_id: str, reason: str, ttl_s: float) -> SequenceRecord | None:
        check_name("seq_id", seq_id)
        if not isinstance(reason, str):
            raise InvalidArgument(f"reason must be a str, got {reason!r}")
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        flat = self._call("mark_lost", self._mark_lost, args=[self._prefix, seq_id, reason, ttl_ms])
        return _record(seq_id, flat) if flat else None

    def expire_lost(self, seq_ids: Sequence[str], ttl_s: float) -> int:
        ids = [check_name("seq_id", s) for s in seq_ids]
        ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
        if not ids:
            return 0

        def run() -> list[int]:
            pipe = self._redis.pipeline(transaction=False)
            for seq_id in ids:
                self._expire_lost(keys=[self._key("seq:", seq_id)], args=[ttl_ms], client=pipe)
            return pipe.execute()  # type: ignore[no-any-return]

        return sum(int(x) for x in self._call("expire_lost", run))

    def sequences_of_node(self, node_id: str) -> list[SequenceRecord]:
        check_name("node_id", node_id)
        flat = self._call("sequences_of_node", self._seqs_of_node, args=[self._prefix, node_id])
        records = [_record(_s(flat[i]), flat[i + 1]) for i in range(0, len(flat), 2)]
        return sorted(records, key=lambda r: r.seq_id)

    # ---- tenants ------------------------------------------------------------------------------

    def tenant_salt(self, tenant: str) -> bytes:
        check_name("tenant", tenant)
        fresh = os.urandom(SALT_BYTES)
        # SET NX GET (Redis >= 7.0): one round trip; returns the old salt, or None if ours won.
        old = self._call("tenant_salt", self._redis.set, self._key("salt:", tenant), fresh, nx=True, get=True)
        return fresh if old is None else bytes(old)

    def reserve_blocks(self, tenant: str, n: int, quota: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        check_count("quota", quota)
        ok, used = self._call(
            "reserve_blocks", self._reserve, keys=[self._key("usage:", tenant)], args=[n, quota]
        )
        if not ok:
            raise QuotaExceeded(tenant, requested=n, quota=quota, used=int(used))
        return int(used)

    def release_blocks(self, tenant: str, n: int) -> int:
        check_name("tenant", tenant)
        check_count("n", n)
        ok, used = self._call("release_blocks", self._release, keys=[self._key("usage:", tenant)], args=[n])
        if not ok:
            raise InvalidArgument(f"tenant {tenant!r}: cannot release {n} blocks, only {used} reserved")
        return int(used)

    def tenant_usage(self, tenant: str) -> int:
        check_name("tenant", tenant)
        value = self._call("tenant_usage", self._redis.get, self._key("usage:", tenant))
        return int(value) if value is not None else 0

    # ---- operations ---------------------------------------------------------------------------

    def ping(self) -> None:
        self._call("ping", self._redis.ping)

    def close(self) -> None:
        self._kept.close()
        self._redis.close()
