"""KVCacheManager: sequences, prefix sharing, copy-on-write, the host tier,
swapping and token budgets, over two BlockPools (device and host).

Pure Python bookkeeping. Bytes move through a `BlockMover` that the manager
calls at the moment it decides a move, so moves run in decision order (an
offload always reads a device block before anything overwrites it). The
benchmarks drive this class with a mover that does nothing.

A sequence's cache, in positions (block_size 4, 10 tokens, one block shared):

    table:     [ b7 (shared, full) | b2 (full) | b9 (partial) ]
    positions:   0  1  2  3          4  5  6  7  8  9  .  .
    keys:      [ k0               | k1        | None         ]   # full blocks only
                                                 ^ cache_len = 10, next write at b9[2]

Only full blocks get keys. Writing into a partial block that another sequence
also references (after fork) copies it first. With a token budget, dropped
middle blocks leave the table, `cache_len` counts the kept tokens and
`num_tokens` the logical length; the key chain ends at the first drop.

Without prefix caching no block gets a key, so the token ids are never read: a
prefill then only counts its tokens (`num_elided_tokens`) instead of copying
hundreds of ints into the sequence and dropping them again at free, and while
a decode group holds, its step count is every member's count of decoded tokens
(`Sequence.decode_group`): a step touches only the members that open a block.

Appends come in two shapes: `reserve(seq, tokens)` (a prefill; returns the
first new position) and `reserve_tokens(seqs, tokens)` (a decode step, one
token per sequence, the whole batch in one call). `append()` and
`append_tokens()` do the same and also list each token's slot. A decode step
keeps its batch as the manager's decode group: when the next step names the
same sequences (the usual case), it skips the lookups and checks, appends the
tokens in one C-level pass, and knows from the group's schedule which members
cross a block boundary this step (about batch / block_size of them); only
those run Python code. Any other change to a member drops the group.

Not thread-safe by itself: the engine holds one lock around every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from operator import attrgetter, itemgetter
from types import ModuleType
from typing import NamedTuple, Protocol

from ..protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    SequenceNotFound,
)
from ..protos.keys import block_hasher, chain_keys, root_key
from .block_core import get_core
from .block_pool import BlockPool
from .eviction import EvictionPolicy, make_policy

DEVICE, HOST = "device", "host"


class BlockMover(Protocol):
    def copy_blocks(self, src_tier: str, src: list[int], dst_tier: str, dst: list[int]) -> None:
        """Copy whole blocks (every layer, K and V) from src to dst, pairwise, now."""


class NullMover:
    """Moves nothing: for bookkeeping-only use (benchmarks, the coordinator's simulations)."""

    def copy_blocks(self, src_tier: str, src: list[int], dst_tier: str, dst: list[int]) -> None:
        pass


class OpenResult(NamedTuple):
    num_cached_tokens: int  # prefix tokens the sequence starts with (device + host hits)
    num_host_hit_tokens: int  # of those, tokens copied back from the host tier


class Slots(NamedTuple):
    """Where the appended tokens' K/V go: token i -> (blocks[i], offsets[i])."""

    blocks: list[int]
    offsets: list[int]


class BlockEvent(NamedTuple):
    kind: str  # STORED (the key is now held by this node) or REMOVED (it no longer is)
    key: bytes


class EventBatch(NamedTuple):
    """Drained events as two aligned sequences: kinds[i] happened to keys[i], in order.
    Read-only: an empty drain returns one shared batch of two empty tuples."""

    kinds: Seq[str]
    keys: Seq[bytes]


STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True)
class HeldBlocks:
    """Full blocks [first, first + len(blocks)) of seq, keyed but not yet findable."""

    seq: Sequence
    first: int
    blocks: tuple[int, ...]


_NO_HIT = OpenResult(0, 0)
_ENTRY_POINTS = ("open", "reserve", "reserve_token_pairs", "take_event_batch", "free")  # compiled when native
_NO_EVENTS = EventBatch((), ())
_PAIR_LENGTH = frozenset((2,))  # a decode step's (seq_id, token) pairs
_NO_MEMBERS: list[int] = []  # a decode step that opens no block here (never mutated)
# Runs an iterator of side effects to its end, in C.
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend
_new_tuple = tuple.__new__  # _new_tuple(BlockEvent, (kind, key)): a BlockEvent without a Python frame
# C-level field reads for the batched decode step (map() over a batch, no Python frame per sequence).
_TOKENS, _TABLE, _IS_SIMPLE = attrgetter("tokens"), attrgetter("table"), attrgetter("simple")
_LAST = itemgetter(-1)


def _as_events(kinds: list[str], keys: list[bytes]) -> list[BlockEvent]:
    """Aligned kinds and keys -> [BlockEvent(kind, key), ...], in one C-level pass."""
    return list(map(_new_tuple, repeat(BlockEvent, len(keys)), zip(kinds, keys, strict=True)))


@dataclass(frozen=True)
class Budget:
    max_tokens: int
    sink_blocks: int = 1
    recent_blocks: int = 4


@dataclass(eq=False, slots=True)
class Sequence:
    seq_id: str
    root: bytes
    tokens: list[int]  # the ids; always empty without prefix caching (see the module docstring)
    table: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)  # aligned with table
    scores: list[float] = field(default_factory=list)  # attention mass per kept block
    num_dropped_tokens: int = 0  # tokens a budget dropped (whole blocks): cache_len = num_tokens - this
    host_table: list[int] | None = None  # set while swapped out
    budget: Budget | None = None
    chain_intact: bool = True  # False after a budget drop: later blocks get no keys
    # Keys open() already computed for the prompt it was given, reused when the
    # appended tokens turn out to be that prompt (the usual case): no double hashing.
    hint: tuple[list[int], list[bytes]] | None = None
    # True when appending one token needs neither copy-on-write nor a budget
    # check (the decode fast path). fork() and set_budget() clear it; the
    # general append path sets it again. Checked by check_integrity().
    simple: bool = True
    # Without prefix caching (always 0 / None with it): the tokens counted but not listed in
    # `tokens`, and the decode group whose num_steps are the tokens decoded since this sequence
    # joined it (added to num_elided_tokens when the group is dropped).
    num_elided_tokens: int = 0
    decode_group: _DecodeGroup | None = None

    @property
    def num_tokens(self) -> int:
        group = self.decode_group
        return len(self.tokens) + self.num_elided_tokens + (group.num_steps if group is not None else 0)

    @property
    def cache_len(self) -> int:
        """Tokens held in the table. Derived, so a decode step only appends the token."""
        return self.num_tokens - self.num_dropped_tokens

    @property
    def is_swapped(self) -> bool:
        return self.host_table is not None


def _empty_sequence(seq_id: str, root: bytes) -> Sequence:
    """A sequence that holds nothing yet (what open() makes without a cached prefix); the
    compiled twin is block_core's new_sequence(_EMPTY_SEQUENCE, seq_id, root)."""
    return Sequence(seq_id, root, [], [], [], [])


_EMPTY_SEQUENCE = _empty_sequence("", b"")  # new_sequence's template: its slots, fresh lists


class _DecodeGroup:
    """The batch of the last decode step, kept so the next step with the same
    sequences skips the lookups and checks, and knows without looking which
    members cross a block boundary. Every member is simple and gets exactly one
    token per step; any other change to a member (free, swap, fork, budget, a
    reserve()) drops the group (KVCacheManager._drop_group())."""

    __slots__ = ("ids", "members", "batch", "token_lists", "by_fill", "num_steps")

    def __init__(
        self,
        ids: tuple[str, ...],
        members: frozenset[str],
        batch: list[Sequence],
        block_size: int,
        core: ModuleType | None,
        counts: bool,
    ) -> None:
        """`counts`: the group counts its members' decoded tokens (no prefix caching): each
        member's decode_group becomes this group. `core`: the compiled loops, or None."""
        self.ids = ids
        self.members = members  # frozenset(ids)
        self.batch = batch
        self.token_lists = list(map(_TOKENS, batch))
        self.num_steps = 0
        # by_fill[r]: indices of the members whose length % block_size was r when the group formed.
        if core is not None:  # the loop below, in C
            self.by_fill: list[list[int]] = core.group_fills(batch, block_size, self if counts else None)
            return
        self.by_fill = [[] for _ in range(block_size)]
        for i, seq in enumerate(batch):  # num_tokens, no group counting them yet
            self.by_fill[(len(seq.tokens) + seq.num_elided_tokens) % block_size].append(i)
        if counts:
            for seq in batch:
                seq.decode_group = self


@dataclass
class Counters:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_host_hit_tokens: int = 0
    evicted_to_host: int = 0
    evicted_device_dropped: int = 0
    evicted_host_dropped: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    cow_copies: int = 0
    budget_dropped_blocks: int = 0
    window_released_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        policy: str | EvictionPolicy = "lru",
        enable_prefix_caching: bool = True,
        mover: BlockMover | None = None,
        record_events: bool = False,
        native: bool = True,
    ) -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        # native=False keeps every loop in Python (the reference the compiled loops are tested against).
        self.device = BlockPool(
            num_blocks, make_policy(policy, num_blocks, native=native), tier=DEVICE, native=native
        )
        self.host = BlockPool(
            num_host_blocks, make_policy("lru", num_host_blocks, native=native), tier=HOST, native=native
        )
        self._core = self.device._c  # the compiled decode step, with the LRU policy
        # One block's key straight from the token list (no slice, no packing) when compiled.
        core = get_core()[0] if native else None
        self._c_block_key = core.block_key if core is not None and core.has_chain else None
        # open()'s empty sequence by one compiled copy of a template (no generated __init__).
        self._new_sequence: Callable[[str, bytes], Sequence] = (
            partial(core.new_sequence, _EMPTY_SEQUENCE) if core is not None else _empty_sequence
        )
        self.policy_name = policy if isinstance(policy, str) else policy.name
        self.enable_prefix_caching = enable_prefix_caching
        self.mover: BlockMover = mover if mover is not None else NullMover()
        self.record_events = record_events
        # Events recorded as two aligned lists (no tuple per event on the hot paths,
        # a block's worth of keys added in one extend); take_events() builds BlockEvents.
        self._event_kinds: list[str] = []
        self._event_keys: list[bytes] = []
        self.seqs: dict[str, Sequence] = {}
        self.counters = Counters()
        self._roots: dict[bytes, bytes] = {}
        self._pinned: dict[bytes, int] = {}  # key -> pin count held by pin()
        # Shared prefixes: for a held key (device or host tier) that a prompt hit,
        # the (tokens, keys) lists of that prompt, so the next prompt with the
        # same prefix takes the keys after one list comparison instead of
        # hashing every block again (a 1024-token system prompt: 64 blake2b ->
        # 1). Only hit chains get an entry, so prompts that share nothing (and
        # the sequences behind them) are not retained; entries go with REMOVED.
        # keys[i] covers tokens[i * bs : (i + 1) * bs], and keys are only taken
        # for token blocks equal to those they were computed from, so the
        # result is exactly chain_keys'.
        self._origin: dict[bytes, tuple[list[int], list[bytes]]] = {}
        self._offsets = list(range(block_size)) * 16  # offsets of consecutive slots: p % bs
        self._block_key = block_hasher(block_size)
        self._num_swapped = 0  # sequences with a host_table: decode batches skip the check while 0
        self._group: _DecodeGroup | None = None  # the last decode step's batch, while it holds
        # While hold_publish is set, blocks that become full get their keys in seq.keys but are not
        # yet findable (no key map entry, no STORED event): a node that writes K/V layer by layer
        # reserves at layer 0 and publishes after the last layer (publish_held), so no other
        # sequence can hit a block whose later layers are still unwritten.
        self.hold_publish = False
        self._held: list[HeldBlocks] = []
        # The compiled entry points (block_core.c's Entries; LRU only, like the compiled loops):
        # open, reserve, reserve_token_pairs, take_event_batch and free run their common case
        # without a Python frame and hand every other case, unchanged, to the methods below.
        # A subclass that overrides one of them keeps all five in Python.
        if self._core is not None and all(
            getattr(type(self), name) is getattr(KVCacheManager, name) for name in _ENTRY_POINTS
        ):
            methods = tuple(getattr(self, name) for name in _ENTRY_POINTS)
            entries = self._core.Entries(self, methods, _EMPTY_SEQUENCE, _NO_HIT, _NO_EVENTS)
            for name in _ENTRY_POINTS:
                setattr(self, name, getattr(entries, name))

    # -- lookups ------------------------------------------------------------------

    def get(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise SequenceNotFound(seq_id)
        return seq

    def _active(self, seq_id: str) -> Sequence:
        seq = self.get(seq_id)
        if seq.host_table is not None:
            raise FailedPrecondition(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def _root(self, salt: bytes) -> bytes:
        root = self._roots.get(salt)
        if root is None:
            root = self._roots[salt] = root_key(salt)
        return root

    def block_keys(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """Keys of every full block of `token_ids` under `salt`. Pure."""
        return chain_keys(self._root(salt), token_ids, self.block_size)

    def match(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """The longest cached chain: device blocks first, then host blocks that
        continue it. Changes nothing."""
        if not keys or (keys[0] not in self.device.block_of_key and keys[0] not in self.host.block_of_key):
            return [], []  # a miss on the first block (most prompts that share nothing)
        dev = list(map(self.device.block_of_key.get, keys))  # type: ignore[arg-type]
        if None in dev:
            del dev[dev.index(None) :]
        host: list[int] = []
        if len(dev) < len(keys) and self.host.block_of_key:
            host = list(map(self.host.block_of_key.get, keys[len(dev) :]))  # type: ignore[arg-type]
            if None in host:
                del host[host.index(None) :]  # type: ignore[arg-type]
        return dev, host  # type: ignore[return-value]

    def num_cached_tokens(self, token_ids: list[int], salt: bytes = b"") -> int:
        """How many leading tokens of `token_ids` are cached (device or host). Changes nothing."""
        dev, host = self.match(self.block_keys(token_ids, salt))
        return (len(dev) + len(host)) * self.block_size

    # -- sequence lifecycle -------------------------------------------------------

    def open(
        self, seq_id: str, token_ids: list[int], salt: bytes = b"", max_cached_tokens: int | None = None
    ) -> OpenResult:
        """Create a sequence that starts with the longest cached prefix of `token_ids`.

        At most `max_cached_tokens` (default len(token_ids) - 1, so the caller
        always computes at least the last token) are reused, in whole blocks.
        The sequence then holds only those tokens; the caller appends the rest.
        Host-tier hits are copied back while device room allows (never failing
        for lack of it: they just count as misses).
        """
        seqs = self.seqs
        if seq_id in seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already exists")
        root = self._roots.get(salt) or self._root(salt)
        self.counters.prefix_query_tokens += len(token_ids)
        if not self.enable_prefix_caching:  # nothing to look up
            seqs[seq_id] = self._new_sequence(seq_id, root)
            return _NO_HIT
        bs = self.block_size
        limit = len(token_ids) - 1 if max_cached_tokens is None else min(max_cached_tokens, len(token_ids))
        limit = max(limit, 0)
        if limit < bs:  # not a whole block to look up
            seqs[seq_id] = self._new_sequence(seq_id, root)
            return _NO_HIT
        dev: list[int] = []
        host: list[int] = []
        keys: list[bytes] = []
        hashed: list[int] = []
        unindexed = 0
        device = self.device
        if self.enable_prefix_caching and limit >= bs:
            hashed = token_ids[: limit - limit % bs]  # a copy: the hint must not alias the caller's list
            keys, unindexed = self._prompt_keys(root, hashed)
            dev, host = self.match(keys)
            if host:
                # Reviving evictable device hits shrinks what promotion can allocate.
                policy = device.policy
                room = device.num_available - sum(1 for b in dev if b in policy)
                del host[max(room, 0) :]
        if dev:
            refcount, lru = device.refcount, device._lru
            if lru is not None:  # revive: C-level pops (held or pinned hits are absent); LRU has no touch()
                deque(map(lru.pop, dev, repeat(None, len(dev))), maxlen=0)
                for b in dev:
                    refcount[b] += 1
            else:
                touch = device.policy.touch
                for b in dev:
                    device.incref(b)
                    touch(b)
        table = dev
        if host:
            table = dev + self._promote(host, keys[len(dev) : len(dev) + len(host)])
        n = len(table)
        cache_len = n * bs
        seq_keys: list[bytes | None] = list(keys[:n])
        seq = Sequence(seq_id, root, token_ids[:cache_len], table, seq_keys, [0.0] * n)
        if len(keys) > n:
            seq.hint = (hashed, keys)
        if n > unindexed:  # a hit on a prefix the index does not cover yet: index it with this prompt
            origin, run = self._origin, (hashed, keys)
            for key in keys[unindexed:n]:
                origin[key] = run
        self.seqs[seq_id] = seq
        counters = self.counters
        counters.prefix_hit_tokens += cache_len
        counters.prefix_host_hit_tokens += len(host) * bs
        return OpenResult(cache_len, len(host) * bs)

    def _prompt_keys(self, root: bytes, tokens: list[int]) -> tuple[list[bytes], int]:
        """chain_keys(root, tokens): the same keys, hashing only blocks that no
        shared prefix (self._origin) already covers with equal tokens. Also
        returns the index of the first key that has no origin entry."""
        bs = self.block_size
        nblocks = len(tokens) // bs
        origin = self._origin
        if not origin:  # no shared prefix indexed: hash them all
            return chain_keys(root, tokens, bs), 0
        keys: list[bytes] = []
        parent = root
        i = 0
        while i < nblocks:
            key = self._block_key(parent, tokens[i * bs : (i + 1) * bs])
            keys.append(key)
            i += 1
            run = origin.get(key)
            if run is None:  # no shared prefix continues from here: hash the rest
                if i < nblocks:
                    keys += chain_keys(key, tokens[i * bs : nblocks * bs], bs)
                return keys, i - 1
            run_tokens, run_keys = run
            hi = min(nblocks, len(run_keys))
            if i > hi or run_keys[i - 1] != key:  # not the same chain position (never, short of a collision)
                parent = key
                continue
            while hi > i and run_keys[hi - 1] is None:  # the run's unfinished tail
                hi -= 1
            if hi > i:
                # Blocks [i, hi) of the run continue this prompt while their tokens agree.
                if tokens[i * bs : hi * bs] == run_tokens[i * bs : hi * bs]:
                    same = hi
                else:  # binary search for the first block that differs
                    same, bad = i, hi
                    while bad - same > 1:
                        mid = (same + bad) // 2
                        if tokens[same * bs : mid * bs] == run_tokens[same * bs : mid * bs]:
                            same = mid
                        else:
                            bad = mid
                if same > i:
                    keys += run_keys[i:same]  # type: ignore[arg-type]
                    i = same
            parent = keys[-1]
        return keys, nblocks

    def _promote(self, host_blocks: list[int], keys: list[bytes]) -> list[int]:
        """Copy host-cached blocks back to new device blocks (keys move with them)."""
        for hb in host_blocks:  # hold them so device offloads cannot evict them meanwhile
            self.host.incref(hb)
        dev_blocks = self._allocate_device(len(host_blocks))
        self.mover.copy_blocks(HOST, host_blocks, DEVICE, dev_blocks)
        self.host.free(host_blocks)
        for hb in host_blocks:
            self.host.drop(hb)
        for db, key in zip(dev_blocks, keys, strict=True):
            self.device.publish(db, key)
        return dev_blocks

    def _allocate_device(self, n: int) -> list[int]:
        evicted_keys: list[bytes] = []
        blocks = self.device.take(n, evicted_keys)
        if evicted_keys:
            self._offload(blocks[len(blocks) - len(evicted_keys) :], evicted_keys)
        return blocks

    def _offload(self, blocks: list[int], keys: list[bytes]) -> None:
        """Evicted device blocks go to the host tier while it has room, else out."""
        host, counters = self.host, self.counters
        if host.num_blocks == 0:  # no host tier: every evicted key leaves the node
            counters.evicted_device_dropped += len(keys)
            if self._origin:
                _consume(map(self._origin.pop, keys, repeat(None, len(keys))))
            if self.record_events:
                self._event_kinds += [REMOVED] * len(keys)
                self._event_keys += keys
            return
        for block, key in zip(blocks, keys, strict=True):
            if host.num_available == 0:
                counters.evicted_device_dropped += 1
                self._removed(key)
                continue
            hb, lost = host.allocate_one()
            if lost is not None:
                counters.evicted_host_dropped += 1
                self._removed(lost.key)
            self.mover.copy_blocks(DEVICE, [block], HOST, [hb])
            host.publish(hb, key)
            host.free([hb])
            counters.evicted_to_host += 1

    def _removed(self, key: bytes) -> None:
        """`key` left the node (no tier holds it any more)."""
        self._origin.pop(key, None)
        if self.record_events:
            self._event_kinds.append(REMOVED)
            self._event_keys.append(key)

    def take_events(self) -> list[BlockEvent]:
        """Drain the stored/removed events recorded since the last call, in order."""
        kinds, keys = self._event_kinds, self._event_keys
        self._event_kinds, self._event_keys = [], []
        return _as_events(kinds, keys)

    def take_event_batch(self) -> EventBatch:
        """take_events() without a tuple per event: the two recorded lists
        themselves, for a node that streams many events per step."""
        if not self._event_kinds:  # most decode steps (every one without prefix caching)
            return _NO_EVENTS
        batch = _new_tuple(EventBatch, (self._event_kinds, self._event_keys))  # no Python-level __new__
        self._event_kinds, self._event_keys = [], []
        return batch  # type: ignore[no-any-return]

    @property
    def num_pending_events(self) -> int:
        """How many events take_events() would drain now (a length read: no copy, no lock needed)."""
        return len(self._event_kinds)

    @property
    def events(self) -> list[BlockEvent]:
        """The events take_events() would drain now. Changes nothing."""
        return _as_events(self._event_kinds, self._event_keys)

    def append(self, seq_id: str, token_ids: list[int]) -> Slots:
        """reserve(), then where the appended tokens' K/V go (token i -> slot i)."""
        start = self.reserve(seq_id, token_ids)
        return self._slots(self.seqs[seq_id].table, start, len(token_ids))

    def reserve(self, seq_id: str, token_ids: list[int]) -> int:
        """Reserve room for `token_ids` at the end of the sequence; returns the
        position (in the table) of the first of them. Allocates blocks as
        boundaries are crossed, copies a shared partial last block first
        (copy-on-write), and publishes blocks that become full. Raises
        (changing nothing) when the device lacks room. Token ids must be ints
        (the engine checks what comes off the wire)."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.host_table is not None:
            seq = self._active(seq_id)  # raises the precise error
        n = len(token_ids)
        if n == 0:
            return seq.cache_len
        group = self._group
        if group is not None and seq_id in group.members:
            self._drop_group()
        bs, device = self.block_size, self.device
        core = self._core
        if core is not None and seq.budget is None:  # the steps below, in C, unless it must copy or evict
            caching = self.enable_prefix_caching
            start = core.prefill(seq, token_ids, bs, device._free, device.refcount, caching)
            if start is not None:
                if caching and seq.chain_intact and (start + n) // bs > start // bs:
                    self._publish_full(seq, start // bs, (start + n) // bs)
                return start  # type: ignore[no-any-return]
        # A budget makes room before the write (the new tokens are never dropped).
        # Whole blocks leave, so `need` is the same before and after the drop; the
        # drop only adds room, and happens once the append is known to fit.
        drop = self._budget_drop_plan(seq, n) if seq.budget is not None else []
        table = seq.table
        start = seq.cache_len
        fill = start % bs
        cow = fill != 0 and device.refcount[table[-1]] > 1
        need = (start + n + bs - 1) // bs - len(table) + cow
        if need:
            room = len(device._free) + len(device.policy)
            if drop:
                room += self._num_released(seq, drop)
            if need > room:
                raise CapacityExceeded(f"append {n} tokens to sequence {seq_id!r}", need, room)
        if drop:
            self._drop_blocks(seq, drop)
            start = seq.cache_len
            table = seq.table
        if cow:
            (dst,) = self._allocate_device(1)
            src = table[-1]
            self.mover.copy_blocks(DEVICE, [src], DEVICE, [dst])
            device.free([src])
            table[-1] = dst
            self.counters.cow_copies += 1
            need -= 1
        if need:
            table += self._allocate_device(need)
            seq.keys += [None] * need
            seq.scores += [0.0] * need
        if self.enable_prefix_caching:
            seq.tokens += token_ids
        else:
            seq.num_elided_tokens += n
        end = start + n
        first = start // bs
        if end // bs > first and seq.chain_intact and self.enable_prefix_caching:
            self._publish_full(seq, first, end // bs)
        seq.simple = seq.budget is None  # the last block is private now (copied or fresh if it was shared)
        return start

    def _slots(self, table: list[int], start: int, n: int) -> Slots:
        """Slots of table positions [start, start + n)."""
        if n == 0:
            return Slots([], [])
        bs = self.block_size
        fill, end = start % bs, start + n
        first, last = start // bs, (end - 1) // bs
        offsets = self._offsets
        if fill + n > len(offsets):  # the repeating 0..bs-1 pattern, grown to the longest append seen
            offsets += list(range(bs)) * ((fill + n - len(offsets)) // bs + 1)
        if first == last:
            blocks = [table[first]] * n
        elif last - first >= bs // 2:  # many blocks: bs strided C-level copies beat a loop per block
            blocks = [0] * ((last - first + 1) * bs)
            run = table[first : last + 1]
            for j in range(bs):
                blocks[j::bs] = run
            del blocks[fill + n :]
            del blocks[:fill]
        else:
            #   table[first]        table[first+1 .. last-1]     table[last]
            #   [fill, bs)          [0, bs) each                 [0, end - last * bs)
            blocks = [table[first]] * (bs - fill)
            for b in table[first + 1 : last]:
                blocks += [b] * bs
            blocks += [table[last]] * (end - last * bs)
        return Slots(blocks, offsets[fill : fill + n])

    def _publish_full(self, seq: Sequence, first: int, stop: int) -> None:
        """Key blocks [first, stop) of the table, which just became full."""
        bs = self.block_size
        tokens = seq.tokens
        new_keys: list[bytes] = []
        hint = seq.hint
        if hint is not None:  # reuse open()'s keys while the tokens agree
            hint_tokens, hint_keys = hint
            top = min(stop, len(hint_keys))
            if top <= first:
                same = False
            elif first == 0 and top == len(hint_keys):  # a whole prompt after a miss: one slice
                same = tokens[: top * bs] == hint_tokens
            else:
                same = tokens[first * bs : top * bs] == hint_tokens[first * bs : top * bs]
            if same:
                new_keys = hint_keys[first:top]
            else:
                i = first
                while i < top and tokens[i * bs : (i + 1) * bs] == hint_tokens[i * bs : (i + 1) * bs]:
                    new_keys.append(hint_keys[i])
                    i += 1
            if first + len(new_keys) < stop or stop >= len(hint_keys):  # diverged, or used up
                seq.hint = None
        if first + len(new_keys) < stop:
            j = first + len(new_keys)
            parent = new_keys[-1] if new_keys else (seq.keys[j - 1] if j else seq.root)
            assert parent is not None
            if stop - j == 1:  # a decode step filled one block
                new_keys.append(self._block_key(parent, tokens[j * bs : stop * bs]))
            else:
                new_keys += chain_keys(parent, tokens[j * bs : stop * bs], bs)
        num_new = len(new_keys)
        seq.keys[first : first + num_new] = new_keys
        if self.hold_publish:
            self._held.append(HeldBlocks(seq, first, tuple(seq.table[first : first + num_new])))
            return
        self._register(seq, first, new_keys)

    def _register(self, seq: Sequence, first: int, new_keys: list[bytes]) -> None:
        """Make blocks [first, first + len(new_keys)) of seq findable under their keys."""
        device, table = self.device, seq.table
        key_of, block_of_key = device.key_of, device.block_of_key
        host_keys = self.host.block_of_key
        record = self.record_events
        num_new = len(new_keys)
        blocks = table[first : first + num_new]
        if (
            not host_keys
            and block_of_key.keys().isdisjoint(new_keys)
            and [key_of[b] for b in blocks].count(None) == num_new
        ):  # the usual case: every block takes its key, as in the loop below, with fewer checks
            for b, key in zip(blocks, new_keys, strict=True):
                key_of[b] = key
            block_of_key.update(zip(new_keys, blocks, strict=True))
            if record:
                self._event_kinds += [STORED] * num_new
                self._event_keys += new_keys
            return
        for key, b in zip(new_keys, blocks, strict=True):
            if key_of[b] is not None or key in block_of_key:  # BlockPool.publish() refusing
                continue
            key_of[b] = key
            block_of_key[key] = b
            hb = host_keys.get(key) if host_keys else None
            if hb is None:  # new to the node
                if record:
                    self._event_kinds.append(STORED)
                    self._event_keys.append(key)
            else:  # the node held it on the host already; the device copy replaces it
                self.host.drop(hb)

    def take_held(self) -> list[HeldBlocks]:
        """The blocks that became full while hold_publish was set, not yet findable."""
        held, self._held = self._held, []
        return held

    def publish_held(self, held: list[HeldBlocks]) -> None:
        """Make held blocks findable now (their K/V is complete). Entries whose sequence was
        freed, swapped, or no longer holds those blocks are skipped: their blocks went back
        unkeyed, never cached with partial contents."""
        for h in held:
            seq = h.seq
            a, blocks = h.first, h.blocks
            if (
                self.seqs.get(seq.seq_id) is not seq
                or seq.host_table is not None
                or tuple(seq.table[a : a + len(blocks)]) != blocks
            ):
                continue
            keys = seq.keys[a : a + len(blocks)]
            if None in keys:
                continue
            self._register(seq, a, keys)  # type: ignore[arg-type]

    def append_tokens(self, seq_ids: Seq[str], token_ids: Seq[int]) -> Slots:
        """reserve_tokens(), then each sequence's new slot (sequence i -> slot i)."""
        batch = self._reserve_step(seq_ids, token_ids)
        bs = self.block_size
        blocks = list(map(_LAST, map(_TABLE, batch)))  # the new token is always in the last block
        offsets = [(seq.cache_len - 1) % bs for seq in batch]
        return Slots(blocks, offsets)

    def reserve_tokens(self, seq_ids: Seq[str], token_ids: Seq[int]) -> None:
        """One token for each of many sequences (a decode step): the batched form
        of reserve(seq_id, [token]), for the whole batch in one call. The batch is
        checked as a whole first, so an unknown or swapped-out sequence, one listed
        twice, a token count that differs from the sequence count, or too little
        room for the step raises and changes nothing."""
        group, core = self._group, self._core
        if group is not None and core is not None:
            device = self.device
            if (
                len(seq_ids) == len(token_ids) <= len(device._free) + len(device._lru)  # type: ignore[arg-type]
                and (seq_ids if type(seq_ids) is tuple else tuple(seq_ids)) == group.ids
            ):  # the group's usual step, with room for a block each: as _reserve_step() takes it
                self._step_group(group, token_ids)
                return
        self._reserve_step(seq_ids, token_ids)

    def reserve_token_pairs(self, pairs: Seq[tuple[str, int]]) -> None:
        """reserve_tokens() for a decode step given as (seq_id, token) pairs, the
        shape a scheduler's running batch often has: the same checks and effects as
        reserve_tokens([s for s, _ in pairs], [t for _, t in pairs]). When the pairs
        name the current decode group in order, the compiled step checks and appends
        them without building the two lists."""
        group, core = self._group, self._core
        if group is not None and core is not None:
            d = self.device
            left = core.step_pairs(group, pairs, d._free, d.refcount, d._lru, self.enable_prefix_caching)
            if left is not None:  # the step is in; left: the members whose open evicts (Python, in order)
                if left or self.enable_prefix_caching:  # else nothing is left to do
                    self._finish_step(group, group.num_steps, left or _NO_MEMBERS)
                return
        columns = core.split_pairs(pairs) if core is not None else None  # None: not all 2-tuples
        if columns is None:
            if not _PAIR_LENGTH.issuperset(map(len, pairs)):
                raise InvalidArgument("a decode step's pairs must each be (seq_id, token)")
            columns = zip(*pairs, strict=True) if pairs else ((), ())  # the two columns, as tuples
        seq_ids, token_ids = columns
        self._reserve_step(seq_ids, token_ids)

    def _reserve_step(self, seq_ids: Seq[str], token_ids: Seq[int]) -> list[Sequence]:
        n = len(seq_ids)
        if n != len(token_ids):
            raise InvalidArgument(f"a decode batch of {n} sequences got {len(token_ids)} tokens")
        ids = seq_ids if type(seq_ids) is tuple else tuple(seq_ids)
        group = self._group
        device = self.device
        if group is not None and ids == group.ids:  # the batch of the last step (the usual case)
            if n > len(device._free) + len(device.policy):
                self._check_decode_room(group.batch)
            self._step_group(group, token_ids)
            return group.batch
        seqs = self.seqs
        try:
            batch = list(map(seqs.__getitem__, ids))
        except KeyError:
            for sid in ids:  # the first bad id, in order, raises its precise error
                self._active(sid)
            raise
        if self._num_swapped:
            for sid in ids:
                self._active(sid)
        members = frozenset(ids)
        if len(members) != n:
            raise InvalidArgument("a decode batch lists a sequence more than once")
        if n > len(device._free) + len(device.policy):  # else every sequence surely finds its block
            self._check_decode_room(batch)
        bs = self.block_size
        self._drop_group()
        if bs > 1 and all(map(_IS_SIMPLE, batch)):
            caching = self.enable_prefix_caching
            self._group = group = _DecodeGroup(ids, members, batch, bs, self._core, not caching)
            self._step_group(group, token_ids)
            return batch
        # copy-on-write, a budget, or one-token blocks: one append per sequence
        for seq, token in zip(batch, token_ids, strict=True):
            self.reserve(seq.seq_id, [token])
        return batch

    def _step_group(self, group: _DecodeGroup, token_ids: Seq[int]) -> None:
        """A decode step for a group of simple sequences, with no Python work per
        token: the tokens go in by one C-level pass, and only the sequences that
        cross a block boundary (about len(batch) / block_size of them), found by
        the group's schedule, take a Python branch. Room was checked."""
        t = group.num_steps + 1
        # A member that had length L when the group formed has L + t now: its token
        # opened a new block when (L + t) % bs == 1, and filled its block when it is 0.
        opened = group.by_fill[(1 - t) % self.block_size]
        core, keep_ids = self._core, self.enable_prefix_caching
        if core is not None:
            free, refcount = self.device._free, self.device.refcount
            if len(opened) <= len(free):  # the tokens, then the opens off the free list, in C
                core.step(group.token_lists, token_ids, group.batch, opened, free, refcount, keep_ids)
                opened = _NO_MEMBERS
            else:  # the opens evict (events, offloads): Python, in batch order
                core.step(group.token_lists, token_ids, group.batch, _NO_MEMBERS, free, refcount, keep_ids)
        elif keep_ids:  # else the step count below is the new tokens
            _consume(map(list.append, group.token_lists, token_ids))
        group.num_steps = t
        self._finish_step(group, t, opened)

    def _finish_step(self, group: _DecodeGroup, t: int, opened: list[int]) -> None:
        """After step t's tokens are in: open a block for the members in `opened` and key
        the blocks the step filled. Opens taken off the free list beforehand (no eviction,
        so no event, nothing a publish reads) are not listed: their order does not matter."""
        bs = self.block_size
        filled = group.by_fill[-t % bs] if self.enable_prefix_caching else ()
        if not (opened or filled):
            return
        batch = group.batch
        core = self._core
        if core is not None and not self.host.num_blocks and not self.hold_publish:  # the loop below, in C
            device = self.device
            evicted = core.finish_step(
                batch,
                opened,
                filled or _NO_MEMBERS,
                bs,
                device._free,
                device.refcount,
                device.key_of,
                device.block_of_key,
                device._lru,
                self._origin,
                self._event_kinds if self.record_events else None,
                self._event_keys,
                STORED,
                REMOVED,
            )
            if evicted is not None:  # None: a member reuses its prompt's keys (changed nothing)
                if evicted:
                    device.num_evictions += evicted
                    self.counters.evicted_device_dropped += evicted
                return
        if opened and filled:  # both kinds in one step: in batch order, as one-token appends would
            for i in sorted(opened + filled):  # type: ignore[operator]
                if i in opened:
                    self._open_block(batch[i])
                elif batch[i].chain_intact:
                    self._publish_one(batch[i], len(batch[i].tokens) // bs - 1)
            return
        for i in opened:
            self._open_block(batch[i])
        for i in filled:
            seq = batch[i]
            if seq.chain_intact:
                self._publish_one(seq, len(seq.tokens) // bs - 1)

    def _open_block(self, seq: Sequence) -> None:
        """Give a decoding sequence its next block (its new token sits at offset 0)."""
        core, device = self._core, self.device
        if core is not None and not self.host.num_blocks and (device._free or device._lru):
            # The steps below in C: a free block, else the LRU's oldest, whose key is dropped here.
            lost = core.open_block(
                seq, device._free, device.refcount, device.key_of, device.block_of_key, device._lru
            )
            if lost is not None:
                device.num_evictions += 1
                self.counters.evicted_device_dropped += 1
                self._removed(lost)
            return
        free = self.device._free
        if free:
            block = free.pop()
            self.device.refcount[block] = 1
        else:
            block = self._take_one_device()
        seq.table.append(block)
        seq.keys.append(None)
        seq.scores.append(0.0)

    def _take_one_device(self) -> int:
        """_allocate_device(1) for the decode path: one block, evicting if needed."""
        block, lost = self.device.take_one()
        if lost is not None:
            if self.host.num_blocks:
                self._offload([block], [lost])
            else:  # _offload() for one block without a host tier
                self.counters.evicted_device_dropped += 1
                self._removed(lost)
        return block

    def _publish_one(self, seq: Sequence, i: int) -> None:
        """_publish_full(seq, i, i + 1) for a decode step that filled block i."""
        if seq.hint is not None:
            self._publish_full(seq, i, i + 1)
            return
        bs = self.block_size
        keys, tokens = seq.keys, seq.tokens
        parent = keys[i - 1] if i else seq.root
        assert parent is not None
        c_block_key = self._c_block_key
        if c_block_key is not None:
            key = keys[i] = c_block_key(parent, tokens, i * bs, bs)
        else:
            key = keys[i] = self._block_key(parent, tokens[i * bs : (i + 1) * bs])
        block = seq.table[i]
        if self.hold_publish:
            self._held.append(HeldBlocks(seq, i, (block,)))
            return
        device = self.device
        if device.key_of[block] is not None or key in device.block_of_key:  # BlockPool.publish() refusing
            return
        device.key_of[block] = key
        device.block_of_key[key] = block
        host_keys = self.host.block_of_key
        hb = host_keys.get(key) if host_keys else None
        if hb is None:  # new to the node
            if self.record_events:
                self._event_kinds.append(STORED)
                self._event_keys.append(key)
        else:  # the node held it on the host already; the device copy replaces it
            self.host.drop(hb)

    def _drop_group(self) -> None:
        """Forget the decode group (a change to a member other than a step). Without
        prefix caching its members' decoded tokens, counted by the group's steps
        until now, move into their num_elided_tokens."""
        group = self._group
        if group is None:
            return
        self._group = None
        if not self.enable_prefix_caching:
            steps = group.num_steps
            for seq in group.batch:
                seq.num_elided_tokens += steps
                seq.decode_group = None

    def _check_decode_room(self, batch: list[Sequence]) -> None:
        """Raise CapacityExceeded unless every sequence of the batch, served in
        order, finds its block: a budget sequence's drop only helps those after it."""
        device = self.device
        room = available = len(device._free) + len(device.policy)
        need = 0
        short = False
        bs, refcount = self.block_size, device.refcount
        for seq in batch:
            if seq.budget is not None:
                released = self._num_released(seq, self._budget_drop_plan(seq, 1))
                room += released
                available += released
            if seq.cache_len % bs == 0 or refcount[seq.table[-1]] > 1:
                need += 1
                room -= 1
                short = short or room < 0
        if short:
            raise CapacityExceeded(f"decode step for {len(batch)} sequences", need, available)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; the shared partial last
        block is copied on the first write to it (by either)."""
        if child_id in self.seqs:
            raise InvalidArgument(f"sequence {child_id!r} already exists")
        parent = self._active(parent_id)
        self._drop_group()
        for b in parent.table:
            self.device.incref(b)
        parent.simple = False  # the partial last block is shared now
        self.seqs[child_id] = Sequence(
            child_id,
            parent.root,
            list(parent.tokens),
            list(parent.table),
            list(parent.keys),
            list(parent.scores),
            parent.num_dropped_tokens,
            None,
            parent.budget,
            parent.chain_intact,
            None,
            False,
            parent.num_elided_tokens,
        )

    def free(self, seq_id: str) -> None:
        """Release the sequence. Its keyed blocks stay cached; tail blocks go
        first into the eviction order so the shared prefix outlives them."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise SequenceNotFound(seq_id)
        if self._group is not None:
            self._drop_group()
        if seq.host_table is not None:
            self._num_swapped -= 1
            self.host.free_tail_first(seq.host_table)
        else:
            self.device.free_tail_first(seq.table)

    # -- swapping -----------------------------------------------------------------

    def swap_out(self, seq_id: str) -> int:
        """Move the whole sequence to host blocks and free its device blocks.
        Returns the number of blocks moved. Raises CapacityExceeded (changing
        nothing) when the host tier cannot hold it."""
        seq = self._active(seq_id)
        n = len(seq.table)
        if n > self.host.num_available:
            raise CapacityExceeded(f"swap out sequence {seq_id!r} to host", n, self.host.num_available)
        self._drop_group()
        host_blocks, lost = self.host.allocate(n)
        for ev in lost:
            self.counters.evicted_host_dropped += 1
            self._removed(ev.key)
        self.mover.copy_blocks(DEVICE, seq.table, HOST, host_blocks)
        self.device.free(seq.table[::-1])
        seq.host_table = host_blocks
        seq.table = []
        self._num_swapped += 1
        self.counters.swap_out_blocks += n
        return n

    def swap_in(self, seq_id: str) -> int:
        """Bring a swapped sequence back, byte-exact. Full blocks whose key is
        still cached on the device are revived instead of copied. Returns the
        number of blocks copied. Raises CapacityExceeded (changing nothing) when
        the device lacks room."""
        seq = self.get(seq_id)
        if seq.host_table is None:
            raise FailedPrecondition(f"sequence {seq_id!r} is not swapped out")
        device = self.device
        revive = [device.block_of_key.get(k) if k is not None else None for k in seq.keys]
        need = sum(1 for b in revive if b is None)
        room = device.num_available - sum(1 for b in revive if b is not None and b in device.policy)
        if need > room:
            raise CapacityExceeded(f"swap in sequence {seq_id!r}", need, max(room, 0))
        self._drop_group()
        for b in revive:
            if b is not None:
                device.incref(b)
        fresh = self._allocate_device(need)
        it = iter(fresh)
        table = [b if b is not None else next(it) for b in revive]
        copy_src = [hb for hb, b in zip(seq.host_table, revive, strict=True) if b is None]
        self.mover.copy_blocks(HOST, copy_src, DEVICE, fresh)
        self.host.free(seq.host_table[::-1])
        seq.table, seq.host_table = table, None
        self._num_swapped -= 1
        self.counters.swap_in_blocks += need
        return need

    # -- pins, scores, budgets ----------------------------------------------------

    def pin(self, token_ids: list[int], salt: bytes = b"") -> int:
        """Pin the device-cached prefix of `token_ids`: never evicted until unpinned.
        Returns the number of tokens pinned (whole blocks)."""
        dev, _ = self.match(self.block_keys(token_ids, salt))
        for b in dev:
            key = self.device.key_of[b]
            assert key is not None
            self.device.pin(b)
            self._pinned[key] = self._pinned.get(key, 0) + 1
        return len(dev) * self.block_size

    def unpin(self, token_ids: list[int], salt: bytes = b"") -> int:
        """Undo one pin() of the same prefix. Returns the tokens unpinned."""
        keys = self.block_keys(token_ids, salt)
        pinned = [k for k in keys if self._pinned.get(k)]
        if not pinned:
            raise InvalidArgument("no pinned prefix matches these token ids")
        for key in pinned:
            self.device.unpin(self.device.block_of_key[key])
            if self._pinned[key] == 1:
                del self._pinned[key]
            else:
                self._pinned[key] -= 1
        return len(pinned) * self.block_size

    def add_attention_mass(self, seq_id: str, mass: list[float]) -> None:
        """Credit each kept block of the sequence with the attention mass it received."""
        seq = self.get(seq_id)
        policy = self.device.policy
        for i, (b, m) in enumerate(zip(seq.table, mass, strict=False)):
            seq.scores[i] += m
            policy.add_mass(b, m)

    def set_budget(self, seq_id: str, budget: Budget | None) -> None:
        """Opt the sequence into a lossy token budget (None turns it off)."""
        seq = self.get(seq_id)
        if budget is not None:
            bs = self.block_size
            floor = (budget.sink_blocks + budget.recent_blocks) * bs
            if budget.sink_blocks < 0 or budget.recent_blocks < 1 or budget.max_tokens < floor:
                raise InvalidArgument(
                    f"budget needs sink_blocks >= 0, recent_blocks >= 1 and max_tokens >= "
                    f"(sink + recent) * block_size = {floor}; got {budget}"
                )
        seq.budget = budget
        self._drop_group()
        seq.simple = False  # the general append path re-derives it
        if budget is not None and seq.host_table is None and seq.cache_len > budget.max_tokens:
            self._enforce_budget(seq)

    def _enforce_budget(self, seq: Sequence, incoming: int = 0) -> None:
        """Drop the lowest-score middle blocks (never the sink or recent window)
        until the sequence plus `incoming` tokens fits its budget. Runs before an
        append, so the tokens being written in this step are never dropped (their
        other layers' K/V may still be on the way). Shared blocks lose one
        reference; their bytes are untouched."""
        drop = self._budget_drop_plan(seq, incoming)
        if drop:
            self._drop_blocks(seq, drop)

    def _budget_drop_plan(self, seq: Sequence, incoming: int) -> list[int]:
        """Table indices _enforce_budget would drop, ascending. Changes nothing."""
        budget = seq.budget
        assert budget is not None
        excess = seq.cache_len + incoming - budget.max_tokens
        if excess <= 0:
            return []
        excess_blocks = -(-excess // self.block_size)
        lo, hi = budget.sink_blocks, len(seq.table) - budget.recent_blocks
        scores = seq.scores
        middle = sorted(range(lo, max(hi, lo)), key=lambda i: (scores[i], i))
        return sorted(middle[:excess_blocks])

    def _num_released(self, seq: Sequence, drop: list[int]) -> int:
        """Blocks that dropping table indices `drop` would make allocatable."""
        device = self.device
        refcount, key_of, pins = device.refcount, device.key_of, device.pins
        n = 0
        for i in drop:
            b = seq.table[i]
            n += refcount[b] == 1 and (key_of[b] is None or b not in pins)
        return n

    def _drop_blocks(self, seq: Sequence, drop: list[int]) -> None:
        gone = set(drop)
        bs = self.block_size
        self.device.free([seq.table[i] for i in reversed(drop)])
        seq.table = [b for i, b in enumerate(seq.table) if i not in gone]
        seq.scores = [s for i, s in enumerate(seq.scores) if i not in gone]
        first = drop[0]
        seq.keys = [k if i < first else None for i, k in enumerate(seq.keys) if i not in gone]

        seq.chain_intact = False
        seq.num_dropped_tokens += len(drop) * bs
        self.counters.budget_dropped_blocks += len(drop)

    def release_leading(self, seq_id: str, num_blocks: int) -> int:
        """Give back the first `num_blocks` blocks of an active sequence, which no later query
        reads (a sliding window moved past them: cache_node/windows.py decides how many). They
        leave the table as a budget's drop does (cache_len counts the kept tokens, later blocks
        get no keys); shared ones lose a reference, keyed ones stay cached for prefix hits. The
        last block always stays. Returns the number released; the decode group holds."""
        seq = self._active(seq_id)
        n = min(num_blocks, len(seq.table) - 1)
        if n <= 0:
            return 0
        self.device.free(seq.table[n - 1 :: -1])
        del seq.table[:n], seq.keys[:n], seq.scores[:n]
        seq.chain_intact = False
        seq.num_dropped_tokens += n * self.block_size
        self.counters.window_released_blocks += n
        return n

    # -- invariants ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError with the numbers that disagree."""
        dev_refs: dict[int, int] = {}
        host_refs: dict[int, int] = {}
        problems: list[str] = []
        bs = self.block_size
        for seq in self.seqs.values():
            if seq.host_table is not None:
                for b in seq.host_table:
                    host_refs[b] = host_refs.get(b, 0) + 1
                blocks = len(seq.host_table)
            else:
                for b in seq.table:
                    dev_refs[b] = dev_refs.get(b, 0) + 1
                blocks = len(seq.table)
            if blocks != -(-seq.cache_len // bs) or len(seq.keys) != blocks or len(seq.scores) != blocks:
                problems.append(
                    f"sequence {seq.seq_id!r}: {blocks} blocks, {len(seq.keys)} keys, "
                    f"{len(seq.scores)} scores for cache_len {seq.cache_len}"
                )
        self.device.check_integrity(dev_refs)
        self.host.check_integrity(host_refs)
        refcount = self.device.refcount
        for seq in self.seqs.values():
            if seq.simple and seq.host_table is None:  # the decode fast path must be safe for it
                shared_tail = seq.cache_len % bs != 0 and refcount[seq.table[-1]] != 1
                if seq.budget is not None or shared_tail:
                    problems.append(f"sequence {seq.seq_id!r}: simple, yet has a budget or shared tail")
        group = self._group
        if group is not None:  # the cached decode batch must still describe its members
            for i, (sid, seq) in enumerate(zip(group.ids, group.batch, strict=True)):
                fill = next(r for r, members in enumerate(group.by_fill) if i in members)
                if self.seqs.get(sid) is not seq or not seq.simple or seq.host_table is not None:
                    problems.append(f"decode group member {sid!r} is gone, swapped or not simple")
                elif (
                    seq.tokens is not group.token_lists[i]
                    or (fill + group.num_steps) % bs != seq.num_tokens % bs
                ):
                    problems.append(f"decode group member {sid!r}: {seq.num_tokens} tokens off its schedule")
        counted = group.batch if group is not None and not self.enable_prefix_caching else []
        for seq in self.seqs.values():  # only the current group's members, and only without caching
            if (seq.decode_group is not None) != (seq in counted) or seq.decode_group not in (None, group):
                problems.append(f"sequence {seq.seq_id!r}: its tokens are counted by the wrong decode group")
        num_swapped = sum(1 for s in self.seqs.values() if s.host_table is not None)
        if num_swapped != self._num_swapped:
            problems.append(f"{num_swapped} sequences swapped out, but {self._num_swapped} counted")
        both = self.device.block_of_key.keys() & self.host.block_of_key.keys()
        if both:
            problems.append(f"{len(both)} keys held by both tiers")
        for key, count in self._pinned.items():
            pinned = self.device.block_of_key.get(key)
            if pinned is None or self.device.pins.get(pinned, 0) < count:
                problems.append(f"pinned key {key.hex()} lost its pinned device block")
        if problems:
            raise IntegrityError("; ".join(problems))

    def stats(self) -> dict[str, int]:
        d, h = self.device, self.host
        return {
            "num_blocks": d.num_blocks,
            "free_blocks": d.num_free,
            "cached_blocks": d.num_cached,
            "used_blocks": d.num_used,
            "host_blocks": h.num_blocks,
            "host_free_blocks": h.num_free,
            "host_cached_blocks": h.num_cached,
            "host_used_blocks": h.num_used,
            "num_sequences": len(self.seqs),
            "num_swapped": sum(1 for s in self.seqs.values() if s.host_table is not None),
            "device_evictions": d.num_evictions,
            "host_evictions": h.num_evictions,
            **vars(self.counters),
        }
