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

Not thread-safe by itself: the engine holds one lock around every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from ..protos.errors import (
    CapacityExceeded,
    FailedPrecondition,
    IntegrityError,
    InvalidArgument,
    SequenceNotFound,
)
from ..protos.keys import chain_keys, root_key
from .block_pool import BlockPool, Evicted
from .eviction import make_policy

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


STORED, REMOVED = "stored", "removed"


@dataclass(frozen=True)
class Budget:
    max_tokens: int
    sink_blocks: int = 1
    recent_blocks: int = 4


@dataclass(eq=False)
class Sequence:
    seq_id: str
    root: bytes
    tokens: list[int]
    table: list[int] = field(default_factory=list)
    keys: list[bytes | None] = field(default_factory=list)  # aligned with table
    scores: list[float] = field(default_factory=list)  # attention mass per kept block
    cache_len: int = 0  # tokens held in the table
    host_table: list[int] | None = None  # set while swapped out
    budget: Budget | None = None
    chain_intact: bool = True  # False after a budget drop: later blocks get no keys
    # Keys open() already computed for the prompt it was given, reused when the
    # appended tokens turn out to be that prompt (the usual case): no double hashing.
    hint: tuple[list[int], list[bytes]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def is_swapped(self) -> bool:
        return self.host_table is not None


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


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        num_host_blocks: int = 0,
        policy: str = "lru",
        enable_prefix_caching: bool = True,
        mover: BlockMover | None = None,
        record_events: bool = False,
    ) -> None:
        if block_size <= 0:
            raise InvalidArgument(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.device = BlockPool(num_blocks, make_policy(policy, num_blocks), tier=DEVICE)
        self.host = BlockPool(num_host_blocks, make_policy("lru", num_host_blocks), tier=HOST)
        self.policy_name = policy
        self.enable_prefix_caching = enable_prefix_caching
        self.mover: BlockMover = mover if mover is not None else NullMover()
        self.record_events = record_events
        self.events: list[tuple[str, bytes]] = []
        self.seqs: dict[str, Sequence] = {}
        self.counters = Counters()
        self._roots: dict[bytes, bytes] = {}
        self._pinned: dict[bytes, int] = {}  # key -> pin count held by pin()

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
        dev: list[int] = []
        lookup = self.device.block_of_key.get
        for key in keys:
            b = lookup(key)
            if b is None:
                break
            dev.append(b)
        host: list[int] = []
        hlookup = self.host.block_of_key.get
        for key in keys[len(dev) :]:
            b = hlookup(key)
            if b is None:
                break
            host.append(b)
        return dev, host

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
        if seq_id in self.seqs:
            raise InvalidArgument(f"sequence {seq_id!r} already exists")
        limit = len(token_ids) - 1 if max_cached_tokens is None else min(max_cached_tokens, len(token_ids))
        limit = max(limit, 0)
        root = self._root(salt)
        seq = Sequence(seq_id, root, [])
        self.counters.prefix_query_tokens += len(token_ids)
        dev: list[int] = []
        host: list[int] = []
        keys: list[bytes] = []
        if self.enable_prefix_caching and limit >= self.block_size:
            keys = chain_keys(root, token_ids[: limit - limit % self.block_size], self.block_size)
            dev, host = self.match(keys)
            # Reviving evictable device hits shrinks what promotion can allocate.
            room = self.device.num_available - sum(1 for b in dev if b in self.device.policy)
            del host[max(room, 0) :]
        device_pool = self.device
        for b in dev:
            device_pool.incref(b)
            device_pool.policy.touch(b)
        table = list(dev)
        if host:
            table += self._promote(host, keys[len(dev) : len(dev) + len(host)])
        n = len(table)
        seq.table = table
        seq.keys = list(keys[:n])
        seq.scores = [0.0] * n
        seq.tokens = list(token_ids[: n * self.block_size])
        seq.cache_len = n * self.block_size
        if len(keys) > n:
            seq.hint = (token_ids, keys)
        self.seqs[seq_id] = seq
        self.counters.prefix_hit_tokens += seq.cache_len
        self.counters.prefix_host_hit_tokens += len(host) * self.block_size
        return OpenResult(seq.cache_len, len(host) * self.block_size)

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
        blocks, evicted = self.device.allocate(n)
        if evicted:
            self._offload(evicted)
        return blocks

    def _offload(self, evicted: list[Evicted]) -> None:
        """Evicted device blocks go to the host tier while it has room, else out."""
        host, counters = self.host, self.counters
        for block, key in evicted:
            if host.num_available == 0:
                counters.evicted_device_dropped += 1
                if self.record_events:
                    self.events.append((REMOVED, key))
                continue
            hb, lost = host.allocate_one()
            if lost is not None:
                counters.evicted_host_dropped += 1
                if self.record_events:
                    self.events.append((REMOVED, lost.key))
            self.mover.copy_blocks(DEVICE, [block], HOST, [hb])
            host.publish(hb, key)
            host.free([hb])
            counters.evicted_to_host += 1

    def take_events(self) -> list[BlockEvent]:
        """Drain the stored/removed events recorded since the last call, in order."""
        events, self.events = self.events, []
        return [BlockEvent(kind, key) for kind, key in events]

    def append(self, seq_id: str, token_ids: list[int]) -> Slots:
        """Reserve room for `token_ids` at the end of the sequence and return
        where their K/V go. Allocates blocks as boundaries are crossed, copies a
        shared partial last block first (copy-on-write), and publishes blocks
        that become full. Raises (changing nothing) when the device lacks room."""
        seq = self._active(seq_id)
        n = len(token_ids)
        if n == 0:
            return Slots([], [])
        if seq.budget is not None:
            self._enforce_budget(seq, incoming=n)
        bs, table, device = self.block_size, seq.table, self.device
        start = seq.cache_len
        fill = start % bs
        cow = fill != 0 and device.refcount[table[-1]] > 1
        need = (start + n + bs - 1) // bs - len(table) + cow
        if need and need > device.num_available:
            raise CapacityExceeded(f"append {n} tokens to sequence {seq_id!r}", need, device.num_available)
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
        seq.tokens += token_ids
        seq.cache_len = end = start + n
        if n == 1:
            slots = Slots([table[start // bs]], [fill])
        else:
            slots = Slots([table[p // bs] for p in range(start, end)], [p % bs for p in range(start, end)])
        if end // bs > start // bs and seq.chain_intact and self.enable_prefix_caching:
            self._publish_full(seq, start // bs, end // bs)
        return slots

    def _publish_full(self, seq: Sequence, first: int, stop: int) -> None:
        """Key blocks [first, stop) of the table, which just became full."""
        bs = self.block_size
        tokens = seq.tokens
        new_keys: list[bytes] = []
        if seq.hint is not None:  # reuse open()'s keys while the tokens agree
            hint_tokens, hint_keys = seq.hint
            i = first
            while i < stop and i < len(hint_keys) and tokens[i * bs : (i + 1) * bs] == hint_tokens[
                i * bs : (i + 1) * bs
            ]:
                new_keys.append(hint_keys[i])
                i += 1
            if i < stop:
                seq.hint = None
        if first + len(new_keys) < stop:
            j = first + len(new_keys)
            parent = new_keys[-1] if new_keys else (seq.keys[j - 1] if j else seq.root)
            assert parent is not None
            new_keys += chain_keys(parent, tokens[j * bs : stop * bs], bs)
        device, host, table, keys = self.device, self.host, seq.table, seq.keys
        for i, key in enumerate(new_keys, first):
            keys[i] = key
            if not device.publish(table[i], key):
                continue
            hb = host.block_of_key.get(key)
            if hb is None:
                if self.record_events:
                    self.events.append((STORED, key))
            else:  # the node held it on the host already; the device copy replaces it
                host.drop(hb)

    def append_tokens(self, seq_ids: list[str], token_ids: list[int]) -> Slots:
        """One token for each of many sequences (a decode step): the batched
        form of append(seq_id, [token]), checked for room as a whole first so a
        failure changes nothing. Sequences must be distinct."""
        if len(seq_ids) != len(token_ids):
            raise InvalidArgument(f"a decode batch of {len(seq_ids)} sequences got {len(token_ids)} tokens")
        seqs = self.seqs
        batch: list[Sequence] = []
        need = 0
        bs = self.block_size
        refcount = self.device.refcount
        for sid in seq_ids:
            seq = seqs.get(sid)
            if seq is None or seq.host_table is not None:
                self._active(sid)  # raises the precise error
            assert seq is not None
            fill = seq.cache_len % bs
            need += fill == 0 or refcount[seq.table[-1]] > 1
            batch.append(seq)
        if len(batch) != len(set(seq_ids)):
            raise InvalidArgument("a decode batch lists a sequence more than once")
        if need and need > self.device.num_available:
            raise CapacityExceeded(f"decode step for {len(batch)} sequences", need, self.device.num_available)
        blocks: list[int] = []
        offsets: list[int] = []
        for seq, token in zip(batch, token_ids, strict=True):
            pos = seq.cache_len
            fill = pos % bs
            if fill == 0 or refcount[seq.table[-1]] > 1 or seq.budget is not None:
                slots = self.append(seq.seq_id, [token])  # the general path handles the rare cases
                blocks.append(slots.blocks[0])
                offsets.append(slots.offsets[0])
                continue
            seq.tokens.append(token)
            seq.cache_len = pos + 1
            blocks.append(seq.table[-1])
            offsets.append(fill)
            if fill == bs - 1 and seq.chain_intact and self.enable_prefix_caching:
                self._publish_full(seq, pos // bs, pos // bs + 1)
        return Slots(blocks, offsets)

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent; the shared partial last
        block is copied on the first write to it (by either)."""
        if child_id in self.seqs:
            raise InvalidArgument(f"sequence {child_id!r} already exists")
        parent = self._active(parent_id)
        for b in parent.table:
            self.device.incref(b)
        self.seqs[child_id] = Sequence(
            child_id,
            parent.root,
            list(parent.tokens),
            list(parent.table),
            list(parent.keys),
            list(parent.scores),
            parent.cache_len,
            None,
            parent.budget,
            parent.chain_intact,
        )

    def free(self, seq_id: str) -> None:
        """Release the sequence. Its keyed blocks stay cached; tail blocks go
        first into the eviction order so the shared prefix outlives them."""
        seq = self.get(seq_id)
        del self.seqs[seq_id]
        if seq.host_table is not None:
            self.host.free(seq.host_table[::-1])
        else:
            self.device.free(seq.table[::-1])

    # -- swapping -----------------------------------------------------------------

    def swap_out(self, seq_id: str) -> int:
        """Move the whole sequence to host blocks and free its device blocks.
        Returns the number of blocks moved. Raises CapacityExceeded (changing
        nothing) when the host tier cannot hold it."""
        seq = self._active(seq_id)
        n = len(seq.table)
        if n > self.host.num_available:
            raise CapacityExceeded(f"swap out sequence {seq_id!r} to host", n, self.host.num_available)
        host_blocks, lost = self.host.allocate(n)
        for ev in lost:
            self.counters.evicted_host_dropped += 1
            if self.record_events:
                self.events.append((REMOVED, ev.key))
        self.mover.copy_blocks(DEVICE, seq.table, HOST, host_blocks)
        self.device.free(seq.table[::-1])
        seq.host_table = host_blocks
        seq.table = []
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
        if budget is not None and seq.host_table is None and seq.cache_len > budget.max_tokens:
            self._enforce_budget(seq)

    def _enforce_budget(self, seq: Sequence, incoming: int = 0) -> None:
        """Drop the lowest-score middle blocks (never the sink or recent window)
        until the sequence plus `incoming` tokens fits its budget. Runs before an
        append, so the tokens being written in this step are never dropped (their
        other layers' K/V may still be on the way). Shared blocks lose one
        reference; their bytes are untouched."""
        budget = seq.budget
        assert budget is not None
        bs = self.block_size
        excess = seq.cache_len + incoming - budget.max_tokens
        if excess <= 0:
            return
        excess_blocks = -(-excess // bs)
        lo, hi = budget.sink_blocks, len(seq.table) - budget.recent_blocks
        middle = sorted(range(lo, max(hi, lo)), key=lambda i: (seq.scores[i], i))
        drop = sorted(middle[:excess_blocks])
        if not drop:
            return
        gone = set(drop)
        self.device.free([seq.table[i] for i in reversed(drop)])
        seq.table = [b for i, b in enumerate(seq.table) if i not in gone]
        seq.scores = [s for i, s in enumerate(seq.scores) if i not in gone]
        first = drop[0]
        seq.keys = [k if i < first else None for i, k in enumerate(seq.keys) if i not in gone]
        seq.chain_intact = False
        seq.cache_len -= len(drop) * bs
        self.counters.budget_dropped_blocks += len(drop)

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
        both = self.device.block_of_key.keys() & self.host.block_of_key.keys()
        if both:
            problems.append(f"{len(both)} keys held by both tiers")
        for key, count in self._pinned.items():
            b = self.device.block_of_key.get(key)
            if b is None or self.device.pins.get(b, 0) < count:
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
