"""The coordinator's records: what a Store keeps and returns.

Small frozen dataclasses, validated on construction, so a bad record is refused
before it reaches a backend (bad input raises InvalidArgument, never assert).
Both backends share the validators below, so they refuse exactly the same input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, NamedTuple

from pagedkv.protos.errors import InvalidArgument, NodeNotLive, SequenceExists
from pagedkv.protos.keys import KEY_BYTES

from .placement import PlacementWeights

__all__ = ["NodeNotLive", "SequenceExists"]  # (defined with every error in protos/errors.py)

SEQUENCE_STATES = ("active", "swapped", "lost")
UPDATABLE_SEQUENCE_FIELDS = ("extents", "num_tokens", "state", "lost_reason")


class Extent(NamedTuple):
    """Logical blocks [first_logical_block, first_logical_block + num_blocks) live on node_id."""

    node_id: str
    first_logical_block: int
    num_blocks: int


@dataclass(frozen=True)
class SequenceRecord:
    """A sequence's page-table entry.

    Extents tile the logical blocks from 0 with no gap or overlap, in order;
    most sequences have exactly one::

        logical block  0 1 2 3 4 5 6 7 8
                       [ n1: 0,6   ][n2: 6,3]
    """

    seq_id: str
    tenant: str
    extents: tuple[Extent, ...]
    num_tokens: int = 0
    state: str = "active"
    lost_reason: str = ""
    # What the open that wrote it said (open_sequence): a retry with this request id gets
    # the same answer (num_cached_blocks of the prompt cached on its node).
    request_id: str = ""
    num_cached_blocks: int = 0

    def __post_init__(self) -> None:
        check_name("seq_id", self.seq_id)
        check_name("tenant", self.tenant)
        object.__setattr__(self, "extents", check_extents(self.extents))
        check_count("num_tokens", self.num_tokens)
        check_count("num_cached_blocks", self.num_cached_blocks)
        check_request_id(self.request_id)
        if self.state not in SEQUENCE_STATES:
            raise InvalidArgument(f"state must be one of {SEQUENCE_STATES}, got {self.state!r}")
        if not isinstance(self.lost_reason, str):
            raise InvalidArgument(f"lost_reason must be a str, got {self.lost_reason!r}")

    @property
    def num_blocks(self) -> int:
        return sum(e.num_blocks for e in self.extents)

    @property
    def node_ids(self) -> tuple[str, ...]:
        """The distinct nodes holding this sequence, in extent order."""
        return tuple(dict.fromkeys(e.node_id for e in self.extents))


def spec_view(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A spec as specs are compared: `model` is "" where not said (a request or a registration
    from before ModelSpec named models)."""
    return {"model": "", **spec}


def spec_text(spec: Mapping[str, Any]) -> str:
    """A spec for an error message: the model only where one is named."""
    return str({k: v for k, v in spec.items() if k != "model" or v})


@dataclass(frozen=True)
class NodeInfo:
    """A registered node as the store knows it (load is what its last heartbeat said)."""

    node_id: str
    address: str
    spec: dict[str, Any]
    num_blocks: int
    load: dict[str, int] = field(default_factory=dict)
    policy: str = ""  # its eviction policy, as it registered ("": not said)
    epoch: int = 0  # this registration's: tickets name it (0: registered without one)

    def __post_init__(self) -> None:
        self.spec.setdefault("model", "")  # the view placement compares (spec_view)

    def with_load(self, load: dict[str, int]) -> NodeInfo:
        """This node with another load (a beat's, or placement's count until the next beat):
        dataclasses.replace's field walk was ~5 us of every heartbeat."""
        return NodeInfo(self.node_id, self.address, self.spec, self.num_blocks, load, self.policy, self.epoch)


@dataclass(frozen=True)
class PurgeResult:
    """What removing (or re-registering) a node wiped.

    was_registered: the node had a previous record (False: nothing to purge).
    num_keys_purged: its block keys dropped from the prefix index.
    lost_seq_ids: sequences with an extent on it, now in state "lost" (sorted).
    """

    node_id: str
    was_registered: bool
    num_keys_purged: int
    lost_seq_ids: tuple[str, ...]


# apply_event_runs / applied_seq: the node is not live, or is live under another epoch.
NOT_LIVE = -1
SEQ_LIMIT = 2**63  # epochs and event seqs stay below it (a Redis integer; exact as text in Lua)


@dataclass(frozen=True, slots=True)
class EventRun:
    """A node's events first_seq..last_seq of registration `epoch`, netted: each key's last event.

    A node numbers its block events per registration (1, 2, ...); the store records the last
    seq it applied (Store.apply_event_runs), so the node forgets what was applied and resends
    the rest. Validated by check_run, not on construction (the store refuses a bad run whole).
    """

    node_id: str
    epoch: int
    first_seq: int
    last_seq: int
    stored: Sequence[bytes]
    removed: Sequence[bytes]
    offloaded: Sequence[bytes] = ()
    # The node forgot its events through base_seq: a reply once said the store held them. A
    # store whose applied seq is below it lost them (a failover) and takes the run past the
    # gap, since they cannot be resent; otherwise it changes nothing (applied >= base_seq).
    base_seq: int = 0


class NodeRoom(NamedTuple):
    """A node an open may go on, with the room the coordinator's node cache gives it:
    free_blocks never keyed, evictable_blocks cached but unheld (room, not idle capacity),
    recent_opens the opens the coordinator placed there lately (decayed; placement's balance),
    active_blocks the blocks of its sequences open there (placement's load; None: the rest
    of total_blocks after free and evictable)."""

    node_id: str
    free_blocks: int
    total_blocks: int
    evictable_blocks: int = 0
    recent_opens: float = 0.0
    active_blocks: int | None = None


_DEFAULT_WEIGHTS = PlacementWeights()


def is_checked_room(c: Any) -> bool:
    """Whether c is a NodeRoom NewSequence takes as it is (every check below in one expression)."""
    return bool(
        type(c) is NodeRoom
        and type(c[0]) is str
        and c[0]
        and type(c[1]) is type(c[2]) is type(c[3]) is int
        and c[1] >= 0
        and c[3] >= 0
        and c[1] + c[3] <= c[2]
        and type(c[4]) is float
        and 0 <= c[4] < math.inf
        and (c[5] is None or (type(c[5]) is int and c[5] >= 0))
    )


class CheckedRooms(tuple):  # type: ignore[type-arg]
    """Candidates that passed is_checked_room one by one, in node_id order, distinct (made by
    room_index.RoomIndex only): NewSequence takes them without a pass over every row."""

    def node_ids(self) -> tuple[str, ...]:
        return tuple(r[0] for r in self)

    def has_separators(self) -> bool:
        return has_separators(self.node_ids())


def node_ids(candidates: Sequence[Any]) -> tuple[str, ...]:
    """The candidates' node ids in their order (one tuple per membership for a RoomIndex's)."""
    if isinstance(candidates, CheckedRooms):
        return candidates.node_ids()
    return tuple(c[0] for c in candidates)


def ids_have_separators(candidates: Sequence[Any]) -> bool:
    """has_separators of the candidates' ids (kept per membership by a RoomIndex snapshot)."""
    if isinstance(candidates, CheckedRooms):
        return candidates.has_separators()
    return has_separators(node_ids(candidates))


@lru_cache(maxsize=8)
def has_separators(ids: tuple[str, ...]) -> bool:
    """Whether a node id holds a tab or a line feed (which would shift the columns of a row
    sent as text). Cached: a RoomIndex hands out one ids tuple per membership."""
    return any("\t" in i or "\n" in i for i in ids)


@dataclass(frozen=True)
class NewSequence:
    """What Store.open_sequence matches, places and writes for one open.

    keys: the prompt's block keys (16 bytes each) concatenated, as chain_keys
    gives them joined: one argument on the wire instead of one per key.
    candidates: the nodes it may go on (the caller's cached view of their room);
    normalised to node_id order, which is how ties resolve (smallest id wins).
    quota: the tenant's block quota, or None (unlimited).
    pending_ttl_ms: how long this open's in-flight marker steers opens of the same uncached
    prefix to its node (placement.py); 0: leave none.
    scan_classes: placement's bit mask of the run size classes placed as scans (reuse.py).
    request_id: the caller's id for this open, kept in the page table ("" : none).
    opens_scale: each candidate's recent_opens is this many times its decayed count (the
    coordinator keeps its counts scaled by a growing factor, so that a decay changes no
    candidate's row: stores that keep rows between opens send only the rows that changed).
    """

    seq_id: str
    tenant: str
    num_tokens: int
    num_blocks: int
    block_size: int
    keys: bytes
    candidates: tuple[NodeRoom, ...]
    weights: PlacementWeights = _DEFAULT_WEIGHTS
    quota: int | None = None
    pending_ttl_ms: int = 10_000
    scan_classes: int = 0
    request_id: str = ""  # kept in the page table: a retried open gets the first answer
    opens_scale: float = 1.0

    def __post_init__(self) -> None:
        check_name("seq_id", self.seq_id)
        check_name("tenant", self.tenant)
        check_request_id(self.request_id)
        check_count("num_tokens", self.num_tokens)
        check_count("num_blocks", self.num_blocks)
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise InvalidArgument(f"block_size must be an int > 0, got {self.block_size!r}")
        if not isinstance(self.keys, bytes) or len(self.keys) % KEY_BYTES:
            raise InvalidArgument(f"keys must be {KEY_BYTES}-byte block keys joined into one bytes")
        if not isinstance(self.weights, PlacementWeights):
            raise InvalidArgument(f"weights must be PlacementWeights, got {self.weights!r}")
        if self.quota is not None:
            check_count("quota", self.quota)
        check_count("pending_ttl_ms", self.pending_ttl_ms)
        scale = self.opens_scale
        if not isinstance(scale, int | float) or isinstance(scale, bool) or not 0 < scale < math.inf:
            raise InvalidArgument(f"opens_scale must be a finite number > 0, got {scale!r}")
        if check_count("scan_classes", self.scan_classes) >= 1 << 52:
            raise InvalidArgument(f"scan_classes must be a bit mask below 2**52, got {self.scan_classes!r}")
        if isinstance(self.candidates, CheckedRooms):  # checked row by row as they changed
            return
        rooms = []
        for c in self.candidates:
            # A well-formed NodeRoom passes in one expression; anything else takes the checks below.
            if is_checked_room(c):
                rooms.append(c)
                continue
            if not isinstance(c, tuple) or not 3 <= len(c) <= 6:
                raise InvalidArgument(
                    "a candidate must be (node_id, free_blocks, total_blocks[, evictable_blocks"
                    f"[, recent_opens[, active_blocks]]]), got {c!r}"
                )
            opens = c[4] if len(c) >= 5 else 0.0
            active = c[5] if len(c) == 6 else None
            if not isinstance(opens, int | float) or isinstance(opens, bool) or not 0 <= opens < math.inf:
                raise InvalidArgument(f"candidate recent_opens must be a finite number >= 0, got {opens!r}")
            room = NodeRoom(
                check_name("candidate node_id", c[0]),
                check_count("candidate free_blocks", c[1]),
                check_count("candidate total_blocks", c[2]),
                check_count("candidate evictable_blocks", c[3] if len(c) >= 4 else 0),
                float(opens),
                None if active is None else check_count("candidate active_blocks", active),
            )
            if room.free_blocks + room.evictable_blocks > room.total_blocks:
                raise InvalidArgument(
                    f"node {room.node_id!r}: free_blocks {room.free_blocks} + evictable_blocks "
                    f"{room.evictable_blocks} > total_blocks {room.total_blocks}"
                )
            rooms.append(room)
        rooms.sort(key=lambda r: r.node_id)
        for before, room in zip(rooms, rooms[1:], strict=False):
            if before.node_id == room.node_id:
                raise InvalidArgument(f"candidates must have distinct node ids, {room.node_id!r} repeats")
        object.__setattr__(self, "candidates", tuple(rooms))

    @property
    def num_keys(self) -> int:
        return len(self.keys) // KEY_BYTES

    def key_list(self) -> list[bytes]:
        return [self.keys[i : i + KEY_BYTES] for i in range(0, len(self.keys), KEY_BYTES)]


# ---- validators shared by every backend -------------------------------------------------------


def check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{what} must be a non-empty str, got {value!r}")
    return value


def check_request_id(value: object) -> str:
    if not isinstance(value, str) or len(value) > 128:
        raise InvalidArgument(f"request_id must be a str of at most 128 characters, got {value!r}")
    return value


def check_count(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgument(f"{what} must be an int >= 0, got {value!r}")
    return value


def check_ttl(ttl_s: object) -> float:
    if (
        not isinstance(ttl_s, int | float)
        or isinstance(ttl_s, bool)
        or not math.isfinite(ttl_s)
        or ttl_s < 0.001
    ):
        raise InvalidArgument(f"ttl_s must be a finite number >= 0.001, got {ttl_s!r}")
    return float(ttl_s)


def check_key(key: object, what: str = "a block key") -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise InvalidArgument(f"{what} must be {KEY_BYTES} bytes, got {key!r}")
    return key


def check_keys(keys: Sequence[bytes], what: str = "keys") -> list[bytes]:
    """The keys as a list; an error names `what` (the list's field) when it is not "keys"."""
    if isinstance(keys, bytes | str):
        raise InvalidArgument(f"{what} must be a sequence of block keys, not one bytes/str")
    checked = list(keys)
    for k in checked:
        if type(k) is not bytes or len(k) != KEY_BYTES:  # (the label only for the error)
            check_key(k, "a block key" if what == "keys" else f"a block key in {what}")
    return checked


def check_events(
    stored: Sequence[bytes], removed: Sequence[bytes], offloaded: Sequence[bytes] = ()
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """The lists validated; a key in two of them is refused (the node must send the net effect)."""
    stored_keys = check_keys(stored, "stored")
    removed_keys, offloaded_keys = check_keys(removed, "removed"), check_keys(offloaded, "offloaded")
    if bool(stored_keys) + bool(removed_keys) + bool(offloaded_keys) < 2:
        return stored_keys, removed_keys, offloaded_keys  # (one list: no key in two)
    s, r, o = set(stored_keys), set(removed_keys), set(offloaded_keys)
    both = (s & r) | (s & o) | (r & o)
    if both:
        raise InvalidArgument(
            f"{len(both)} key(s) in two of stored, removed and offloaded in one batch (e.g. "
            f"{min(both).hex()}): send each key's net effect (its last event) only"
        )
    return stored_keys, removed_keys, offloaded_keys


def check_ordinal(what: str, value: object) -> int:
    """An epoch or an event seq: an int (not a bool) >= 1 and below SEQ_LIMIT."""
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < SEQ_LIMIT:
        raise InvalidArgument(f"{what} must be an int >= 1 and < 2**63, got {value!r}")
    return value


def check_run(run: EventRun) -> EventRun:
    """A validated copy of `run` (its lists as tuples); InvalidArgument names the bad field."""
    if _is_sound(run):  # (an applier's run: already tuples, so it is its own copy)
        return run
    if not isinstance(run, EventRun):
        raise InvalidArgument(f"expected an EventRun, got {type(run).__name__}")
    check_name("node_id", run.node_id)
    check_ordinal("epoch", run.epoch)
    first, last = check_ordinal("first_seq", run.first_seq), check_ordinal("last_seq", run.last_seq)
    if last < first:
        raise InvalidArgument(f"last_seq must be >= first_seq ({first}), got {last}")
    base = run.base_seq
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base <= last:
        raise InvalidArgument(f"base_seq must be an int in [0, last_seq {last}], got {base!r}")
    stored, removed, offloaded = check_events(run.stored, run.removed, run.offloaded)
    lists = tuple(stored), tuple(removed), tuple(offloaded)
    return EventRun(run.node_id, run.epoch, first, last, *lists, base)


def _is_sound(run: EventRun) -> bool:
    """Whether `run` passes check_run as it is: its fields well-typed and in range, its key
    lists tuples of keys, at most one of them non-empty (nothing to cross-check). One pass
    with no calls, since each flush checks every dirty node's run (the slow path says why not)."""
    if type(run) is not EventRun:
        return False
    node_id, epoch, first, last, base = run.node_id, run.epoch, run.first_seq, run.last_seq, run.base_seq
    if not (
        type(node_id) is str
        and node_id
        and type(epoch) is int
        and type(first) is int
        and type(last) is int
        and type(base) is int
        and 1 <= epoch < SEQ_LIMIT
        and 1 <= first <= last < SEQ_LIMIT
        and 0 <= base <= last
    ):
        return False
    filled = 0
    for keys in (run.stored, run.removed, run.offloaded):
        if type(keys) is not tuple:
            return False
        if keys:
            filled += 1
            for k in keys:
                if type(k) is not bytes or len(k) != KEY_BYTES:
                    return False
    return filled <= 1


def check_runs(runs: Sequence[EventRun]) -> list[EventRun]:
    """Every run checked (check_run) before any is applied."""
    if isinstance(runs, EventRun | str | bytes) or not isinstance(runs, Sequence):
        raise InvalidArgument(f"runs must be a sequence of EventRun, got {type(runs).__name__}")
    return [check_run(r) for r in runs]


def check_policy(policy: object) -> str:
    """A node's eviction policy name as it registers: a short str ("" when not said)."""
    if not isinstance(policy, str) or len(policy) > 64:
        raise InvalidArgument(f"policy must be a str of at most 64 characters, got {policy!r}")
    return policy


def check_registration(
    node_id: str,
    address: str,
    spec: Mapping[str, Any],
    num_blocks: int,
    ttl_s: float,
    epoch: int,
    policy: str,
) -> tuple[str, int]:
    """A registration's arguments checked as the Redis stores write them: (the spec as sorted
    JSON, the lease in milliseconds)."""
    check_name("node_id", node_id)
    check_name("address", address)
    check_count("num_blocks", num_blocks)
    check_count("epoch", epoch)
    check_policy(policy)
    ttl_ms = max(1, round(check_ttl(ttl_s) * 1000))
    try:
        return json.dumps(dict(spec), sort_keys=True), ttl_ms
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"spec must be a JSON-able mapping: {e}") from e


class BeatLoads:
    """Each beat's node id and its load as the stores keep it (JSON, keys sorted), every beat
    checked before any is sent. A node's load as it last beat is kept with its JSON: an idle
    node's beat (the same load as its last) is neither checked nor encoded again (those were
    ~10 us of a ~100 us beat at 1,000 nodes). At most MAX_KEPT nodes' are kept."""

    MAX_KEPT = 1 << 16

    def __init__(self) -> None:
        self._last: dict[str, tuple[dict[str, int], str]] = {}

    def __call__(self, beats: Sequence[tuple[str, Mapping[str, int]]]) -> list[tuple[str, str]]:
        out = []
        last = self._last
        for node_id, load in beats:
            kept = last.get(node_id) if type(node_id) is str and type(load) is dict else None
            # equal to a checked load, and ints (True == 1, but a bool is refused): as valid
            if kept is not None and kept[0] == load and all(type(v) is int for v in load.values()):
                out.append((node_id, kept[1]))
                continue
            check_name("node_id", node_id)
            checked = check_load(load)
            encoded = json.dumps(checked, sort_keys=True)
            if len(last) >= self.MAX_KEPT:
                last.clear()
            last[node_id] = (checked, encoded)
            out.append((node_id, encoded))
        return out


def check_load(load: Mapping[str, int]) -> dict[str, int]:
    if not isinstance(load, Mapping):
        raise InvalidArgument(f"load must be a mapping of counters, got {load!r}")
    return {check_name("load field", k): check_count(f"load[{k!r}]", v) for k, v in load.items()}


def check_extents(extents: object) -> tuple[Extent, ...]:
    if isinstance(extents, str | bytes) or not isinstance(extents, Sequence | tuple):
        raise InvalidArgument(f"extents must be a sequence of (node_id, first, num_blocks), got {extents!r}")
    out: list[Extent] = []
    next_block = 0
    for raw in extents:
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes) or len(raw) != 3:
            raise InvalidArgument(
                f"an extent must be (node_id, first_logical_block, num_blocks), got {raw!r}"
            )
        ext = Extent(check_name("extent node_id", raw[0]), *(check_count("extent field", v) for v in raw[1:]))
        if ext.first_logical_block != next_block:
            raise InvalidArgument(
                f"extents must tile logical blocks from 0 in order: {ext} starts at "
                f"{ext.first_logical_block}, expected {next_block}"
            )
        next_block += ext.num_blocks
        out.append(ext)
    if not out:
        raise InvalidArgument("a sequence needs at least one extent")
    return tuple(out)


def check_sequence_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Validate update_sequence(**fields); returns them normalised (extents as a tuple of Extent)."""
    unknown = sorted(set(fields) - set(UPDATABLE_SEQUENCE_FIELDS))
    if unknown:
        raise InvalidArgument(f"cannot update {unknown}; updatable fields: {UPDATABLE_SEQUENCE_FIELDS}")
    if not fields:
        raise InvalidArgument("update_sequence needs at least one field")
    out = dict(fields)
    if "extents" in out:
        out["extents"] = check_extents(out["extents"])
    if "num_tokens" in out:
        check_count("num_tokens", out["num_tokens"])
    if "state" in out and out["state"] not in SEQUENCE_STATES:
        raise InvalidArgument(f"state must be one of {SEQUENCE_STATES}, got {out['state']!r}")
    if "lost_reason" in out and not isinstance(out["lost_reason"], str):
        raise InvalidArgument(f"lost_reason must be a str, got {out['lost_reason']!r}")
    return out
