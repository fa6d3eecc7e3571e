"""Decode steps: one token for each sequence of a batch, the whole batch in one call.

A step keeps its batch as the manager's decode group: when the next step names the same
sequences (the usual case), it skips the lookups and checks, appends the tokens in one
C-level pass, and knows from the group's schedule which members cross a block boundary
this step (about batch / block_size of them); only those run Python code. Any other
change to a member (free, swap, fork, budget, a reserve()) drops the group. The result is
exactly that of one-token reserve() calls in batch order.

Without prefix caching no token id is kept: while a group holds, its step count is every
member's count of decoded tokens (Sequence.decode_group).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING

from ...protos.errors import CapacityExceeded, InvalidArgument
from ..block_core import get_core
from .budget import drop_plan
from .sequence import Sequence, Slots

if TYPE_CHECKING:
    from ..kv_manager import KVCacheManager

_PAIR_LENGTH = frozenset((2,))  # a decode step's (seq_id, token) pairs
_consume: Callable[[Iterable[object]], None] = deque[object](maxlen=0).extend  # an iterator, run in C
_TOKENS, _TABLE, _IS_SIMPLE = attrgetter("tokens"), attrgetter("table"), attrgetter("simple")
_KEYS, _SCORES = attrgetter("keys"), attrgetter("scores")
_LAST = itemgetter(-1)


def schedule(batch: list[Sequence], block_size: int) -> list[list[int]]:
    """by_fill[r]: the indices of the members whose length (no group counting their tokens
    yet) is r modulo block_size."""
    by_fill: list[list[int]] = [[] for _ in range(block_size)]
    for i, seq in enumerate(batch):
        by_fill[(len(seq.tokens) + seq.num_elided_tokens) % block_size].append(i)
    return by_fill


class DecodeGroup:
    """The batch of the last decode step. Every member is simple (no shared tail, no
    budget) and gets exactly one token per step. The reference of block_core's compiled
    DecodeGroup (csrc/decode_group.c): the same constructor, attributes and steps, except
    that the compiled one also takes the blocks its members open off the pool's free stack."""

    __slots__ = ("ids", "members", "batch", "token_lists", "by_fill", "num_steps", "_keeps_ids")

    def __init__(
        self,
        ids: tuple[str, ...],
        batch: list[Sequence],
        token_lists: list[list[int]],
        tables: list[list[int]],
        keys: list[list[bytes | None]],
        scores: list[list[float]],
        by_fill: list[list[int]],
        keep_ids: bool,
    ) -> None:
        """`keep_ids`: the step appends the token ids (prefix caching); else only counts them."""
        self.ids = ids
        self.members = frozenset(ids)
        self.batch = batch
        self.token_lists = token_lists
        self.by_fill = by_fill
        self.num_steps = 0
        self._keeps_ids = keep_ids

    def step(self, token_ids: Seq[int], pool: object) -> tuple[Seq[int], Seq[int]]:
        """Step num_steps + 1 (the batch checked): the tokens go in by one C-level pass.
        Returns (opened, filled): the members whose token opens a new block, and those
        whose block it filled."""
        t = self.num_steps + 1
        if self._keeps_ids:  # else the step count is the new tokens
            _consume(map(list.append, self.token_lists, token_ids))
        self.num_steps = t
        # A member that had length L when the group formed has L + t now: its token
        # opened a new block when (L + t) % bs == 1, and filled its block when it is 0.
        bs = len(self.by_fill)
        return self.by_fill[(1 - t) % bs], (self.by_fill[-t % bs] if self._keeps_ids else ())

    def step_pairs(self, pairs: object, pool: object) -> tuple[Seq[int], Seq[int]] | None:
        """None: the reference takes every (seq_id, token) step through the checked path."""
        return None


class Decoder:
    """The manager's decode steps and its current decode group."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.block_size = manager.block_size
        self.keeps_ids = manager.enable_prefix_caching
        self.group: DecodeGroup | None = None
        # With the compiled pool, compiled groups that open blocks off its free stack.
        self._pool = manager.device.compiled_core
        core = get_core()[0] if self._pool is not None else None
        self._new_group: Callable[..., DecodeGroup] = core.DecodeGroup if core is not None else DecodeGroup

    def reserve_pairs(self, pairs: Seq[tuple[str, int]]) -> None:
        group = self.group
        if group is not None:  # the group's usual step, checked and taken in one compiled call
            left = group.step_pairs(pairs, self._pool)
            if left is not None:
                if left[0] or left[1]:  # members that open a block with eviction, or fill one
                    self._finish(group, *left)
                return
        if not _PAIR_LENGTH.issuperset(map(len, pairs)):
            raise InvalidArgument("a decode step's pairs must each be (seq_id, token)")
        seq_ids, token_ids = zip(*pairs, strict=True) if pairs else ((), ())  # the two columns, as tuples
        self.reserve(seq_ids, token_ids)

    def reserve(self, seq_ids: Seq[str], token_ids: Seq[int]) -> None:
        group = self.group
        if (
            group is not None
            and len(seq_ids) == len(token_ids) <= self.manager.device.num_available
            and (seq_ids if type(seq_ids) is tuple else tuple(seq_ids)) == group.ids
        ):  # the group's usual step, with room for a block each: as step() takes it
            self._step(group, token_ids)
            return
        self.step(seq_ids, token_ids)

    def append(self, seq_ids: Seq[str], token_ids: Seq[int]) -> Slots:
        batch = self.step(seq_ids, token_ids)
        bs = self.block_size
        blocks = list(map(_LAST, map(_TABLE, batch)))  # the new token is always in the last block
        offsets = [(seq.cache_len - 1) % bs for seq in batch]
        return Slots(blocks, offsets)

    def step(self, seq_ids: Seq[str], token_ids: Seq[int]) -> list[Sequence]:
        """Check the batch as a whole, then append; returns the batch's sequences."""
        n = len(seq_ids)
        if n != len(token_ids):
            raise InvalidArgument(f"a decode batch of {n} sequences got {len(token_ids)} tokens")
        ids = seq_ids if type(seq_ids) is tuple else tuple(seq_ids)
        manager, group = self.manager, self.group
        available = manager.device.num_available
        if group is not None and ids == group.ids:  # the batch of the last step (the usual case)
            if n > available:
                self.check_room(group.batch)
            self._step(group, token_ids)
            return group.batch
        seqs = manager.seqs
        try:
            batch = list(map(seqs.__getitem__, ids))
        except KeyError:
            for sid in ids:  # the first bad id, in order, raises its precise error
                manager.get_active(sid)
            raise
        if manager.num_swapped:
            for sid in ids:
                manager.get_active(sid)
        if len(frozenset(ids)) != n:
            raise InvalidArgument("a decode batch lists a sequence more than once")
        if n > available:  # else every sequence surely finds its block
            self.check_room(batch)
        bs = self.block_size
        self.drop_group()
        if bs > 1 and all(map(_IS_SIMPLE, batch)):
            self.group = group = self._new_group(
                ids,
                batch,
                list(map(_TOKENS, batch)),
                list(map(_TABLE, batch)),
                list(map(_KEYS, batch)),
                list(map(_SCORES, batch)),
                schedule(batch, bs),
                self.keeps_ids,
            )
            if not self.keeps_ids:  # the group counts its members' decoded tokens from now
                for seq in batch:
                    seq.decode_group = group
            self._step(group, token_ids)
            return batch
        # copy-on-write, a budget, or one-token blocks: one append per sequence
        for seq, token in zip(batch, token_ids, strict=True):
            manager.reserve(seq.seq_id, [token])
        return batch

    def _step(self, group: DecodeGroup, token_ids: Seq[int]) -> None:
        """A step for a group whose room was checked."""
        self._finish(group, *group.step(token_ids, self._pool))

    def _finish(self, group: DecodeGroup, opened: Seq[int], filled: Seq[int]) -> None:
        """After a step's tokens are in: open a block for the members in `opened` and key the
        blocks of those in `filled`, in batch order, as one-token appends would."""
        if not (opened or filled):
            return
        batch, bs = group.batch, self.block_size
        manager = self.manager
        if not filled:  # the opens alone: one allocation, in batch order
            for i, block in zip(opened, manager.tiers.allocate(len(opened)), strict=True):
                self._open(batch[i], block)
            return
        if opened:  # both kinds in one step: in batch order
            for i in sorted([*opened, *filled]):
                if i in opened:
                    self._open(batch[i], manager.tiers.allocate(1)[0])
                elif batch[i].chain_intact:
                    manager.prefix.publish_one(batch[i], len(batch[i].tokens) // bs - 1)
            return
        for i in filled:
            seq = batch[i]
            if seq.chain_intact:
                manager.prefix.publish_one(seq, len(seq.tokens) // bs - 1)

    @staticmethod
    def _open(seq: Sequence, block: int) -> None:
        """A decoding sequence's next block (its new token sits at offset 0)."""
        seq.table.append(block)
        seq.keys.append(None)
        seq.scores.append(0.0)

    def drop_group(self) -> None:
        """Forget the decode group (a change to a member other than a step). Without prefix
        caching its members' decoded tokens, counted by the group's steps until now, move
        into their num_elided_tokens."""
        group = self.group
        if group is None:
            return
        self.group = None
        if not self.keeps_ids:
            steps = group.num_steps
            for seq in group.batch:
                seq.num_elided_tokens += steps
                seq.decode_group = None

    def check_room(self, batch: list[Sequence]) -> None:
        """Raise CapacityExceeded unless every sequence of the batch, served in order, finds
        its block: a budget sequence's drop only helps those after it."""
        device = self.manager.device
        room = available = device.num_available
        need = 0
        short = False
        bs = self.block_size
        for seq in batch:
            if seq.budget is not None:
                plan = drop_plan(seq, 1, bs)
                released = device.num_releasable([seq.table[i] for i in plan])
                room += released
                available += released
            if seq.cache_len % bs == 0 or device.refcount_of(seq.table[-1]) > 1:
                need += 1
                room -= 1
                short = short or room < 0
        if short:
            raise CapacityExceeded(f"decode step for {len(batch)} sequences", need, available)

    def check(self, problems: list[str]) -> None:
        """Append what disagrees between the group and its members (for check_integrity)."""
        group, manager, bs = self.group, self.manager, self.block_size
        if group is not None:  # the cached decode batch must still describe its members
            for i, (sid, seq) in enumerate(zip(group.ids, group.batch, strict=True)):
                fill = next(r for r, members in enumerate(group.by_fill) if i in members)
                if manager.seqs.get(sid) is not seq or not seq.simple or seq.host_table is not None:
                    problems.append(f"decode group member {sid!r} is gone, swapped or not simple")
                elif (
                    seq.tokens is not group.token_lists[i]
                    or (fill + group.num_steps) % bs != seq.num_tokens % bs
                ):
                    problems.append(f"decode group member {sid!r}: {seq.num_tokens} tokens off its schedule")
        counted = group.batch if group is not None and not self.keeps_ids else []
        for seq in manager.seqs.values():  # only the current group's members, and only without caching
            if (seq.decode_group is not None) != (seq in counted) or seq.decode_group not in (None, group):
                problems.append(f"sequence {seq.seq_id!r}: its tokens are counted by the wrong decode group")
