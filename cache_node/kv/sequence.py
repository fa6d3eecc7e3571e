"""Sequences and their block tables: the records every part of the manager reads, and the
small value types its API returns.

A sequence's cache, in positions (block_size 4, 10 tokens, one block shared):

    table:     [ b7 (shared, full) | b2 (full) | b9 (partial) ]
    positions:   0  1  2  3          4  5  6  7  8  9  .  .
    keys:      [ k0               | k1        | None         ]   # full blocks only
                                                 ^ cache_len = 10, next write at b9[2]

Only full blocks get keys. With a token budget, dropped middle blocks leave the table,
`cache_len` counts the kept tokens and `num_tokens` the logical length; the key chain
ends at the first drop. Without prefix caching the token ids are never read, so a
sequence only counts them (`num_elided_tokens`, and its decode group's steps).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from .decode import DecodeGroup

DEVICE, HOST = "device", "host"
STORED, REMOVED, OFFLOADED = "stored", "removed", "offloaded"


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


NO_HIT = OpenResult(0, 0)


class Slots(NamedTuple):
    """Where the appended tokens' K/V go: token i -> (blocks[i], offsets[i])."""

    blocks: list[int]
    offsets: list[int]


class BlockEvent(NamedTuple):
    kind: str  # STORED (held by this node, on its device), OFFLOADED (held, on its host tier) or REMOVED
    key: bytes


class EventBatch(NamedTuple):
    """Drained events as two aligned sequences: kinds[i] happened to keys[i], in order.
    Read-only: an empty drain returns one shared batch of two empty tuples."""

    kinds: Seq[str]
    keys: Seq[bytes]


@dataclass(frozen=True)
class Budget:
    max_tokens: int
    sink_blocks: int = 1
    recent_blocks: int = 4


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
    dropped_on_close: int = 0  # cached blocks a close's keep_prefix hint freed at once


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
    decode_group: DecodeGroup | None = None

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


@dataclass(frozen=True)
class HeldBlocks:
    """Full blocks [first, first + len(blocks)) of seq, keyed but not yet findable."""

    seq: Sequence
    first: int
    blocks: tuple[int, ...]


class SlotMap:
    """Slots of consecutive table positions, for one block size."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._offsets = list(range(block_size)) * 16  # offsets of consecutive slots: p % bs

    def slots(self, table: list[int], start: int, n: int) -> Slots:
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
