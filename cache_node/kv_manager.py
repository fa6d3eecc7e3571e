"""KVCacheManager: sequences, prefix sharing, copy-on-write, the host tier, swapping and
token budgets, over two BlockPools (device and host).

Bookkeeping only: bytes move through a `BlockMover` that the manager calls at the moment
it decides a move (the benchmarks drive it with one that does nothing). This module is
the manager's public API and the sequences' lifecycle (open, append, fork, free, pins,
budgets, integrity); the parts live in cache_node/kv/:

    kv/sequence.py   Sequence and the value types (OpenResult, Slots, events, Budget)
    kv/prefix.py     block keys, finding a prompt's cached prefix, publishing full blocks
    kv/tiers.py      device allocation, the host tier, promotion, swapping, dropping on close
    kv/decode.py     batched decode steps and the decode group
    kv/budget.py     what a token budget drops
    kv/events.py     the STORED / REMOVED event queue
    kv/integrity.py  the invariants check_integrity() verifies
    kv/compiled.py   open, reserve and free in C for a manager without prefix caching

Appends come in two shapes: `reserve(seq, tokens)` (a prefill; returns the first new
position) and `reserve_tokens(seqs, tokens)` / `reserve_token_pairs(pairs)` (a decode
step, one token per sequence, the whole batch in one call). `append()` and
`append_tokens()` do the same and also list each token's slot. Writing into a partial
block that another sequence also references (after fork) copies it first.

Not thread-safe by itself: the engine holds one lock around every call.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from types import MappingProxyType

from ..protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    InvalidArgument,
    SequenceNotFound,
)
from .block_pool import BlockPool
from .eviction import EvictionPolicy, make_policy
from .kv.budget import check_budget, drop_plan
from .kv.compiled import compiled_class
from .kv.decode import DecodeGroup, Decoder
from .kv.events import EventLog
from .kv.integrity import check_manager
from .kv.prefix import PrefixCache
from .kv.sequence import (
    DEVICE,
    HOST,
    NO_HIT,
    OFFLOADED,
    REMOVED,
    STORED,
    BlockEvent,
    BlockMover,
    Budget,
    Counters,
    EventBatch,
    HeldBlocks,
    NullMover,
    OpenResult,
    Sequence,
    SlotMap,
    Slots,
)
from .kv.tiers import Tiers

__all__ = [
    "DEVICE",
    "HOST",
    "OFFLOADED",
    "REMOVED",
    "STORED",
    "BlockEvent",
    "BlockMover",
    "Budget",
    "Counters",
    "DecodeGroup",
    "EventBatch",
    "HeldBlocks",
    "KVCacheManager",
    "NullMover",
    "OpenResult",
    "Sequence",
    "Slots",
]


class KVCacheManager:
    def __new__(
        cls, *args: object, enable_prefix_caching: bool = True, native: bool = True, **kwargs: object
    ) -> KVCacheManager:
        """A native manager without prefix caching is kv/compiled.py's subclass, whose open,
        reserve and free run compiled where the pool's core does."""
        if cls is KVCacheManager and native and not enable_prefix_caching:
            compiled = compiled_class(cls)
            if compiled is not None:
                return compiled.__new__(compiled)  # type: ignore[no-any-return]
        return super().__new__(cls)

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
        """`native=False` keeps every loop in Python (the reference the compiled core is tested against)."""
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.device = BlockPool(
            num_blocks, make_policy(policy, num_blocks, native=native), tier=DEVICE, native=native
        )
        self.host = BlockPool(
            num_host_blocks, make_policy("lru", num_host_blocks, native=native), tier=HOST, native=native
        )
        self.policy_name = policy if isinstance(policy, str) else policy.name
        self.enable_prefix_caching = enable_prefix_caching
        self.seqs: dict[str, Sequence] = {}
        self.counters = Counters()
        self.event_log = EventLog(record_events)
        self.prefix = PrefixCache(block_size, self.device, self.host, self.event_log, native)
        self.tiers = Tiers(self.device, self.host, mover or NullMover(), self.counters, self.prefix)
        self.decoder = Decoder(self)
        self._slot_map = SlotMap(block_size)
        self._pinned: dict[bytes, int] = {}  # key -> pin count held by pin()
        self._num_swapped = 0  # sequences with a host_table: decode batches skip the check while 0

    @property
    def mover(self) -> BlockMover:
        """What copies blocks' bytes when the manager moves them (replaceable between calls)."""
        return self.tiers.mover

    @mover.setter
    def mover(self, mover: BlockMover) -> None:
        self.tiers.mover = mover

    @property
    def record_events(self) -> bool:
        return self.event_log.is_recording

    @record_events.setter
    def record_events(self, value: bool) -> None:
        self.event_log.is_recording = value

    @property
    def hold_publish(self) -> bool:
        """While set, blocks that become full get their keys but are not findable yet: a node that
        writes K/V layer by layer reserves at layer 0 and publishes after the last layer
        (publish_held), so no other sequence can hit a block whose later layers are unwritten."""
        return self.prefix.hold_publish

    @hold_publish.setter
    def hold_publish(self, value: bool) -> None:
        self.prefix.hold_publish = value

    @property
    def pinned_keys(self) -> Mapping[bytes, int]:
        """Key -> how many pin() calls hold it (a read-only view)."""
        return MappingProxyType(self._pinned)

    @property
    def num_swapped(self) -> int:
        """Sequences swapped out to the host tier."""
        return self._num_swapped

    # -- lookups ------------------------------------------------------------------

    def get(self, seq_id: str) -> Sequence:
        seq = self.seqs.get(seq_id)
        if seq is None:
            raise SequenceNotFound(seq_id)
        return seq

    def get_active(self, seq_id: str) -> Sequence:
        """The sequence, refusing one that is swapped out (FailedPrecondition)."""
        seq = self.get(seq_id)
        if seq.host_table is not None:
            raise FailedPrecondition(f"sequence {seq_id!r} is swapped out; swap it in first")
        return seq

    def block_keys(self, token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        """Keys of every full block of `token_ids` under `salt`. Pure."""
        return self.prefix.block_keys(token_ids, salt)

    def match(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """The longest cached chain: device blocks first, then host blocks that continue it.
        Changes nothing."""
        return self.prefix.match(keys)

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
        prefix = self.prefix
        root = prefix.root(salt)
        self.counters.prefix_query_tokens += len(token_ids)
        bs = self.block_size
        if self.enable_prefix_caching:
            limit = (
                len(token_ids) - 1 if max_cached_tokens is None else min(max_cached_tokens, len(token_ids))
            )
        if not self.enable_prefix_caching or limit < bs:  # nothing to look up, or not a whole block
            seqs[seq_id] = Sequence(seq_id, root, [], [], [], [])
            return NO_HIT
        hashed = token_ids[: limit - limit % bs]  # a copy: the hint must not alias the caller's list
        keys, unindexed = prefix.prompt_keys(root, hashed)
        dev, host = prefix.match(keys)
        if host:  # reviving evictable device hits shrinks what promotion can allocate
            del host[max(self.tiers.device_room_for(dev), 0) :]
        if dev:
            self.device.acquire(dev)
        table = dev
        if host:
            table = dev + self.tiers.promote(host, keys[len(dev) : len(dev) + len(host)])
        n = len(table)
        cache_len = n * bs
        seq = Sequence(seq_id, root, token_ids[:cache_len], table, keys[:n], [0.0] * n)  # type: ignore[arg-type]
        if len(keys) > n:
            seq.hint = (hashed, keys)
        if n > unindexed:  # a hit on a prefix the index does not cover yet: index it with this prompt
            prefix.index_hit(keys, unindexed, n, (hashed, keys))
        seqs[seq_id] = seq
        counters = self.counters
        counters.prefix_hit_tokens += cache_len
        counters.prefix_host_hit_tokens += len(host) * bs
        return OpenResult(cache_len, len(host) * bs)

    def append(self, seq_id: str, token_ids: list[int]) -> Slots:
        """reserve(), then where the appended tokens' K/V go (token i -> slot i)."""
        start = self.reserve(seq_id, token_ids)
        return self._slot_map.slots(self.seqs[seq_id].table, start, len(token_ids))

    def reserve(self, seq_id: str, token_ids: list[int]) -> int:
        """Reserve room for `token_ids` at the end of the sequence; returns the
        position (in the table) of the first of them. Allocates blocks as
        boundaries are crossed, copies a shared partial last block first
        (copy-on-write), and publishes blocks that become full. Raises
        (changing nothing) when the device lacks room. Token ids must be ints
        (the engine checks what comes off the wire)."""
        seq = self.seqs.get(seq_id)
        if seq is None or seq.host_table is not None:
            seq = self.get_active(seq_id)  # raises the precise error
        n = len(token_ids)
        if n == 0:
            return seq.cache_len
        group = self.decoder.group
        if group is not None and seq_id in group.members:
            self.decoder.drop_group()
        bs = self.block_size
        start = len(seq.tokens) + seq.num_elided_tokens - seq.num_dropped_tokens  # no group counts it now
        need = (start + n + bs - 1) // bs - len(seq.table)
        if not seq.simple:  # a budget, or a tail another sequence shares
            start = self._make_room(seq, n, start, need)
        elif need:  # the usual case: the blocks are the first change, or a refusal
            try:
                seq.table += self.tiers.allocate(need)
            except CapacityExceeded:
                raise CapacityExceeded(
                    f"append {n} tokens to sequence {seq_id!r}", need, self.device.num_available
                ) from None
            seq.keys += [None] * need
            seq.scores += [0.0] * need
        if self.enable_prefix_caching:
            seq.tokens += token_ids
            end = start + n
            first = start // bs
            if end // bs > first and seq.chain_intact:
                self.prefix.publish(seq, first, end // bs)
        else:
            seq.num_elided_tokens += n
        seq.simple = seq.budget is None  # the last block is private now (copied or fresh if it was shared)
        return start

    def _make_room(self, seq: Sequence, n: int, start: int, need: int) -> int:
        """reserve()'s table changes for a sequence that is not simple: drop what its budget
        evicts, copy a shared partial last block, add `need` blocks (`need` counts the table
        as it is). Raises (changing nothing) when the device lacks room. Returns the position
        of the first new token (a drop moves it)."""
        bs, device, table = self.block_size, self.device, seq.table
        # A budget makes room before the write (the new tokens are never dropped). Whole
        # blocks leave, so `need` is the same before and after the drop; the drop only adds
        # room, and happens once the append is known to fit.
        drop = drop_plan(seq, n, bs) if seq.budget is not None else []
        cow = start % bs != 0 and device.refcount_of(table[-1]) > 1
        need += cow
        room = device.num_available
        if drop:
            room += device.num_releasable([table[i] for i in drop])
        if need > room:
            raise CapacityExceeded(f"append {n} tokens to sequence {seq.seq_id!r}", need, room)
        if drop:
            self._drop_blocks(seq, drop)
            self.counters.budget_dropped_blocks += len(drop)
            start = seq.cache_len
            table = seq.table
        if cow:
            (dst,) = self.tiers.allocate(1)
            src = table[-1]
            self.mover.copy_blocks(DEVICE, [src], DEVICE, [dst])
            device.free([src])
            table[-1] = dst
            self.counters.cow_copies += 1
            need -= 1
        if need:
            table += self.tiers.allocate(need)
            seq.keys += [None] * need
            seq.scores += [0.0] * need
        return start

    def append_tokens(self, seq_ids: Seq[str], token_ids: Seq[int]) -> Slots:
        """reserve_tokens(), then each sequence's new slot (sequence i -> slot i)."""
        return self.decoder.append(seq_ids, token_ids)

    def reserve_tokens(self, seq_ids: Seq[str], token_ids: Seq[int]) -> None:
        """One token for each of many sequences (a decode step): the batched form
        of reserve(seq_id, [token]), for the whole batch in one call. The batch is
        checked as a whole first, so an unknown or swapped-out sequence, one listed
        twice, a token count that differs from the sequence count, or too little
        room for the step raises and changes nothing."""
        self.decoder.reserve(seq_ids, token_ids)

    def reserve_token_pairs(self, pairs: Seq[tuple[str, int]]) -> None:
        """reserve_tokens() for a decode step given as (seq_id, token) pairs, the
        shape a scheduler's running batch often has: the same checks and effects as
        reserve_tokens([s for s, _ in pairs], [t for _, t in pairs])."""
        self.decoder.reserve_pairs(pairs)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; the shared partial last
        block is copied on the first write to it (by either)."""
        if child_id in self.seqs:
            raise InvalidArgument(f"sequence {child_id!r} already exists")
        parent = self.get_active(parent_id)
        self.decoder.drop_group()
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

    def free(self, seq_id: str, keep_prefix: int | None = None) -> None:
        """Release the sequence. Its keyed blocks stay cached; tail blocks go
        first into the eviction order so the shared prefix outlives them.

        `keep_prefix=k`: the caller knows that nothing past the first k tokens will be asked
        for again (its conversation ended, the prompt was one-shot), so those blocks leave the
        cache now instead of pushing out blocks that will be (the hint LRU cannot infer; see
        bench/README "Eviction policies"). Blocks another sequence holds or a pin keeps stay."""
        if keep_prefix is not None and keep_prefix < 0:
            raise InvalidArgument(f"keep_prefix must be >= 0 tokens, got {keep_prefix}")
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise SequenceNotFound(seq_id)
        if self.decoder.group is not None:
            self.decoder.drop_group()
        if seq.host_table is not None:
            self._num_swapped -= 1
            self.host.free_tail_first(seq.host_table)
        else:
            self.device.free_tail_first(seq.table)
        if keep_prefix is not None:
            # keys[j] covers tokens at or after j * block_size (a budget drop only shifts blocks
            # down), so this never drops a block inside the kept prefix.
            self.tiers.drop_unheld(seq.keys[keep_prefix // self.block_size :])

    def swap_out(self, seq_id: str) -> int:
        """Move the whole sequence to host blocks and free its device blocks.
        Returns the number of blocks moved. Raises CapacityExceeded (changing
        nothing) when the host tier cannot hold it."""
        seq = self.get_active(seq_id)
        self.tiers.check_swap_out(seq)
        self.decoder.drop_group()
        moved = self.tiers.swap_out(seq)
        self._num_swapped += 1
        return moved

    def swap_in(self, seq_id: str) -> int:
        """Bring a swapped sequence back, byte-exact. Full blocks whose key is
        still cached on the device are revived instead of copied. Returns the
        number of blocks copied. Raises CapacityExceeded (changing nothing) when
        the device lacks room."""
        seq = self.get(seq_id)
        if seq.host_table is None:
            raise FailedPrecondition(f"sequence {seq_id!r} is not swapped out")
        revive = self.tiers.check_swap_in(seq)
        self.decoder.drop_group()
        copied = self.tiers.swap_in(seq, revive)
        self._num_swapped -= 1
        return copied

    # -- events and layered publishing --------------------------------------------

    def take_events(self) -> list[BlockEvent]:
        """Drain the stored/removed events recorded since the last call, in order."""
        return self.event_log.take()

    def take_event_batch(self) -> EventBatch:
        """take_events() without a tuple per event: the two recorded lists themselves, for
        a node that streams many events per step (an empty drain: one shared empty batch)."""
        return self.event_log.take_batch()

    @property
    def num_pending_events(self) -> int:
        """How many events take_events() would drain now (a length read: no copy, no lock needed)."""
        return len(self.event_log)

    @property
    def events(self) -> list[BlockEvent]:
        """The events take_events() would drain now. Changes nothing."""
        return self.event_log.pending()

    def take_held(self) -> list[HeldBlocks]:
        """The blocks that became full while hold_publish was set, not yet findable."""
        return self.prefix.take_held()

    def publish_held(self, held: list[HeldBlocks]) -> None:
        """Make held blocks findable now (their K/V is complete); entries whose sequence was
        freed, swapped, or no longer holds those blocks are skipped."""
        self.prefix.publish_held(held, self.seqs)

    # -- pins, scores, budgets ----------------------------------------------------

    def pin(self, token_ids: list[int], salt: bytes = b"") -> int:
        """Pin the device-cached prefix of `token_ids`: never evicted until unpinned.
        Returns the number of tokens pinned (whole blocks)."""
        keys = self.block_keys(token_ids, salt)
        dev, _ = self.match(keys)
        for b, key in zip(dev, keys, strict=False):
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
            block = self.device.lookup(key)
            assert block is not None
            self.device.unpin(block)
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
            check_budget(budget, self.block_size)
        seq.budget = budget
        self.decoder.drop_group()
        seq.simple = False  # the general append path re-derives it
        if budget is not None and seq.host_table is None and seq.cache_len > budget.max_tokens:
            drop = drop_plan(seq, 0, self.block_size)
            if drop:
                self._drop_blocks(seq, drop)
                self.counters.budget_dropped_blocks += len(drop)

    def drop_blocks(self, seq_id: str, indices: list[int]) -> None:
        """Release whole blocks from an active sequence's table: `indices` ascending, distinct,
        each a full block (the last one too, when full: a sealed extent's, for a budget across
        nodes). Their tokens are no longer attended to, the key chain ends at the first of
        them, and cache_len shrinks by a block each; shared blocks lose one reference, their
        bytes untouched. Budgets drop through here; so can a layer window that every layer
        has slid past (its leading blocks)."""
        seq = self.get_active(seq_id)
        if not indices or sorted(set(indices)) != list(indices) or indices[0] < 0:
            raise InvalidArgument(f"drop_blocks needs distinct ascending table indices, got {indices}")
        full = seq.cache_len // self.block_size
        if indices[-1] >= min(full, len(seq.table)):
            raise InvalidArgument(
                f"sequence {seq_id!r}: only full blocks can be dropped "
                f"(table of {len(seq.table)}, {full} full); got index {indices[-1]}"
            )
        group = self.decoder.group
        if group is not None and seq_id in group.members:
            self.decoder.drop_group()
        self._drop_blocks(seq, indices)

    def release_leading(self, seq_id: str, num_blocks: int) -> int:
        """Give back the first `num_blocks` blocks of an active sequence, which no later query
        reads (a sliding window moved past them: cache_node/windows.py decides how many). They
        leave the table as a budget's drop does (cache_len counts the kept tokens, later blocks
        get no keys); shared ones lose a reference, keyed ones stay cached for prefix hits. The
        last block always stays. Returns the number released. The decode group holds: the lists
        are cut in place (the group keeps references to them) and a member's fill is unchanged."""
        seq = self.get_active(seq_id)
        n = min(num_blocks, len(seq.table) - 1)
        if n <= 0:
            return 0
        self.device.free(seq.table[n - 1 :: -1])
        del seq.table[:n], seq.keys[:n], seq.scores[:n]
        seq.chain_intact = False
        seq.num_dropped_tokens += n * self.block_size
        self.counters.window_released_blocks += n
        return n

    def _drop_blocks(self, seq: Sequence, drop: list[int]) -> None:
        """The one place a sequence's table loses blocks (table indices `drop`, ascending)."""
        gone = set(drop)
        self.device.free([seq.table[i] for i in reversed(drop)])
        seq.table = [b for i, b in enumerate(seq.table) if i not in gone]
        seq.scores = [s for i, s in enumerate(seq.scores) if i not in gone]
        first = drop[0]
        seq.keys = [k if i < first else None for i, k in enumerate(seq.keys) if i not in gone]
        seq.chain_intact = False
        seq.simple = False
        seq.num_dropped_tokens += len(drop) * self.block_size

    # -- invariants ---------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError with the numbers that disagree (kv/integrity.py)."""
        check_manager(self)

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
            "num_swapped": self._num_swapped,
            "device_evictions": d.num_evictions,
            "host_evictions": h.num_evictions,
            **vars(self.counters),
        }
