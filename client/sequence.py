"""Sequence: the handle on one sequence, which may span several nodes (extents).

Most sequences live on one node, and every call goes straight to it. A sequence that
outgrows its node (the node refuses its next block, RESOURCE_EXHAUSTED), or reaches the
`max_extent_tokens` its open asked for, gets a new tail extent on another node from the
coordinator (Extend) and keeps going; every extent before the tail is sealed::

    tokens    0 ........ a | a ........ b | b ....... num_tokens
              extent 0     | extent 1     | tail (takes appends)

Appends go to the tail (split at the seal when they cross it); attention runs on every
node holding an extent and merges by LSE (extents.py); read_kv reads each extent's part
of a range from its node; fork forks every extent; close frees every extent (the
worker does, then the coordinator drops the page table: closing.py). What may spill::

    attention spec        soft-cap, scale: yes, exact (each node caps its own scores; the
                          LSE merge is over the capped scores); sinks: yes (the client
                          folds them in after the merge)
                          window, chunk: yes, exact (each extent's node counts the
                          sequence's positions; extents wholly outside the query's window
                          or chunk are not attended: extent_masks.py)
    token budget          yes, the same blocks kept as on one node: the node keeps it
                          while the sequence is on one node, the client once it spans
                          several (exact mass under the merged softmax, drops on any
                          extent: budget.py)
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from ..protos.attention import LayerAttention, to_messages
from ..protos.errors import CapacityExceeded, InvalidArgument, NotFound, OpenFailed, SequenceLost
from . import budget as budgets
from . import codec
from .closing import close_in_cluster
from .extent_masks import PAST, SKIP, WHOLE, extent_view, layer_of
from .extents import cat_rows, exact_mass, exchange, merge, prefill_part
from .types import AttentionResult, ExtentRoute, MissExplanation, Route

if TYPE_CHECKING:
    from .sync import CacheClient, NodeHandle


def squeeze(res: AttentionResult, squeeze: bool) -> AttentionResult:
    if not squeeze:
        return res
    mass = res.block_mass[0] if res.block_mass is not None else None
    return AttentionResult(res.out[0], res.lse[0], mass)


def as_batch(t: Any, ndim: int) -> tuple[Any, bool]:
    """A single sequence's [heads, D] tensor as a batch of one."""
    if t is not None and getattr(t, "ndim", 0) == ndim - 1:
        return t[None], True
    return t, False


class Sequence:
    """A handle on one sequence; close() (or `with`) frees it on every node it spans."""

    def __init__(
        self,
        client: CacheClient,
        seq_id: str,
        route: Route | list[ExtentRoute],
        num_cached_tokens: int = 0,
        num_host_hit_tokens: int = 0,
        miss: MissExplanation | None = None,
        *,
        num_tokens: int | None = None,
        max_extent_tokens: int | None = None,
        attention: Seq[LayerAttention] = (),
        no_spill: str | None = None,
    ) -> None:
        self.client = client
        self.seq_id = seq_id
        self.extents: list[ExtentRoute] = []
        self._nodes: list[NodeHandle] = []
        self._set_extents(route if isinstance(route, list) else [ExtentRoute(route, 0)])
        self.num_cached_tokens = num_cached_tokens
        self.num_host_hit_tokens = num_host_hit_tokens
        self.miss = miss  # why the prompt missed, when open() was asked to explain (a cluster only)
        self.is_closed = False
        # Tokens held (None: not known to this handle, e.g. one found by id, until an append says)
        self.num_tokens = num_tokens
        if max_extent_tokens is not None and (type(max_extent_tokens) is not int or max_extent_tokens < 1):
            raise InvalidArgument(f"max_extent_tokens must be an int >= 1, got {max_extent_tokens!r}")
        self.max_extent_tokens = max_extent_tokens
        # The spec its open gave, sent with every Extend (a handle found by id does not know it:
        # set it before the sequence grows past its node)
        self.attention = tuple(attention)
        # Why it may not spill to another node (None: it may)
        self.no_spill = no_spill if client.is_cluster else "a client of one node has no other node"
        # a layered prefill's (extent, count, first position) parts, from layer 0
        self._plan: list[tuple[int, int, int | None]] = []
        # A token budget: (max_tokens, sink_blocks, recent_blocks) as set; kept by the tail's
        # node while the sequence is on one node, by `budget` once it spans several (which
        # also counts each extent's dropped tokens after the budget is lifted)
        self._budget_args: tuple[int, int, int] | None = None
        self._was_budgeted = False
        self.budget: budgets.SpreadBudget | None = None

    # -- extents ------------------------------------------------------------------

    @property
    def route(self) -> Route:
        """The first extent's route (where the sequence was opened)."""
        return self.extents[0].route

    @property
    def node(self) -> NodeHandle:
        """The tail's node: where appends go."""
        return self._nodes[-1]

    @property
    def can_spill(self) -> bool:
        return self.no_spill is None

    @property
    def is_sharded(self) -> bool:
        return len(self.extents) > 1

    def _set_extents(self, extents: list[ExtentRoute]) -> None:
        if not extents:
            raise InvalidArgument(f"sequence {self.seq_id!r}: the coordinator named no extent")
        self.extents = list(extents)
        self._nodes = [self.client.node(e.route.address) for e in extents]
        for e, node in zip(self.extents, self._nodes, strict=True):
            node.hold(self.seq_id, e.route)

    def _extent_tokens(self, i: int) -> int | None:
        """Tokens extent i holds (None: the tail's count is not known to this handle)."""
        if i < len(self.extents) - 1:
            return self.extents[i + 1].first_token - self.extents[i].first_token
        return None if self.num_tokens is None else self.num_tokens - self.extents[i].first_token

    @property
    def _budget_on(self) -> bool:
        """This handle keeps a budget over several nodes."""
        return self.budget is not None and self.budget.max_tokens is not None

    def _held_tokens(self, i: int) -> int | None:
        """Tokens extent i holds now: appended less what a budget dropped there."""
        n = self._extent_tokens(i)
        if n is None or self.budget is None or i >= len(self.budget.dropped):
            return n
        return n - self.budget.dropped[i]

    def _tail_room(self) -> int | None:
        """Tokens the tail may still take under max_extent_tokens (None: no limit)."""
        tail = self._extent_tokens(len(self.extents) - 1)
        if self.max_extent_tokens is None or tail is None or not self.can_spill:
            return None
        return max(self.max_extent_tokens - tail, 0)

    def _block_size(self, timeout_s: float | None) -> int:
        return self.node.model_spec(timeout_s).block_size

    def extend(self, *, timeout_s: float | None = None) -> None:
        """Seal the tail at the tokens held now (a whole number of blocks) and continue on a
        new extent on another node (the coordinator's Extend). Usually automatic: an append
        or a decode step the tail cannot take calls it."""
        if not self.can_spill:
            raise InvalidArgument(f"sequence {self.seq_id!r} cannot spill to another node: {self._why_not()}")
        if self.num_tokens is None:
            raise InvalidArgument(
                f"sequence {self.seq_id!r}: its length is unknown to this handle; append first"
            )
        if self._was_budgeted and self.budget is None:
            self.budget = budgets.take(self, self._budget_args, timeout_s)
        extents = self.client.routing.extend(
            self.seq_id, self.num_tokens, timeout_s, to_messages(self.attention)
        )
        if extents[-1].first_token != self.num_tokens:
            raise InvalidArgument(
                f"sequence {self.seq_id!r}: the coordinator's tail starts at {extents[-1].first_token}, "
                f"not at {self.num_tokens}"
            )
        self._set_extents(extents)
        self.client.counters["spills"] += 1

    def _spill_after(self, exc: CapacityExceeded, wanted: int, timeout_s: float | None) -> int:
        """The tail refused `wanted` more tokens: how many of them still fit in its partial last
        block (then a new extent for the rest), after extending when it has none. Re-raises
        exc when the sequence cannot spill or the tail is not where a new extent may begin."""
        if not self.can_spill:
            # the node's error, its fields kept, saying why no other node takes the rest
            refused = CapacityExceeded.__new__(CapacityExceeded)
            Exception.__init__(
                refused, f"{exc} (sequence {self.seq_id!r} cannot spill to another node: {self._why_not()})"
            )
            refused.__dict__.update(exc.__dict__)
            raise refused from exc
        tail = self._extent_tokens(len(self.extents) - 1)
        if tail == 0:  # an empty tail (a fresh sequence): what its node has room for, then spill
            fits = exc.available * self._block_size(timeout_s)
            if 0 < fits < wanted:
                return fits
        if tail is None or tail == 0:
            raise exc
        fill = -tail % self._block_size(timeout_s)
        if fill == 0:
            self.extend(timeout_s=timeout_s)
            return wanted
        if fill >= wanted:  # it fits the partial block, yet was refused (a shared block to copy)
            raise exc
        return fill

    def _why_not(self) -> str:
        return self.no_spill or "it may not"

    def _query_position(self, layer: int, k: Any) -> int:
        """The position of a decode step's query: the new token's (k given at layer 0, before
        the count moves), else the last token's."""
        if self.num_tokens is None:
            raise InvalidArgument(
                f"sequence {self.seq_id!r}: its length is unknown to this handle, and its window or "
                "chunks over several extents need it; append first"
            )
        return self.num_tokens if k is not None and layer == 0 else self.num_tokens - 1

    # -- data calls ---------------------------------------------------------------

    def append(self, token_ids: codec.TokenIds, k: Any, v: Any, *, timeout_s: float | None = None) -> int:
        """Append tokens with K/V of every layer ([num_layers, n, kv_heads, D]); returns the new
        length. Tokens the tail cannot take go to a new extent on another node."""
        tokens = codec.token_list(token_ids)
        if self._budget_on:  # room for all of them at once, as one node makes it
            budgets.make_room(self, len(tokens), timeout_s)
        if not self.can_spill or (self.max_extent_tokens is None and not self.is_sharded):
            try:
                return self._append_tail(tokens, k, v, timeout_s)
            except CapacityExceeded as exc:
                if self.num_tokens is None:
                    raise
                take = self._spill_after(exc, len(tokens), timeout_s)
        else:
            take = len(tokens)
        done = 0
        while done < len(tokens):
            room = self._tail_room()
            if room == 0:
                self.extend(timeout_s=timeout_s)
                continue
            n = min(take, len(tokens) - done, room if room is not None else len(tokens))
            try:
                self._append_tail(
                    tokens[done : done + n], k[:, done : done + n], v[:, done : done + n], timeout_s
                )
            except CapacityExceeded as exc:
                take = self._spill_after(exc, n, timeout_s)
                continue
            done += n
            take = len(tokens) - done
        assert self.num_tokens is not None
        return self.num_tokens

    def _append_tail(self, tokens: list[int], k: Any, v: Any, timeout_s: float | None) -> int:
        if self._budget_on:
            budgets.make_room(self, len(tokens), timeout_s)
        local = self.node.data.append(self.seq_id, tokens, k, v, timeout_s)
        self.num_tokens = self.extents[-1].first_token + local
        return self.num_tokens

    def attend(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_id: int | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """One decode step of one layer: q [q_heads, D] (or [1, q_heads, D]); with k, v
        [kv_heads, D] the new token is appended first (token_id at layer 0) to the tail.
        Over several extents: one call per node in parallel, merged by LSE."""
        q, is_one = as_batch(q, 3)
        k, _ = as_batch(k, 3)
        v, _ = as_batch(v, 3)
        tokens = None if token_id is None else [token_id]
        if not self.is_sharded and (k is None or self._tail_room() is None):
            try:
                res = self.node.data.attend(
                    [self.seq_id],
                    layer,
                    q,
                    k,
                    v,
                    tokens,
                    return_block_mass=return_block_mass,
                    timeout_s=timeout_s,
                )
            except CapacityExceeded as exc:
                if layer != 0 or k is None or self.num_tokens is None:
                    raise
                self._spill_after(exc, 1, timeout_s)  # one token: the tail's last block is full
            else:
                if k is not None and layer == 0 and self.num_tokens is not None:
                    self.num_tokens += 1
                return squeeze(res, is_one)
        if k is not None and layer == 0 and self._tail_room() == 0:
            self.extend(timeout_s=timeout_s)  # max_extent_tokens reached: the new token starts an extent
        try:
            res = self._attend_extents(layer, q, k, v, tokens, return_block_mass, timeout_s)
        except CapacityExceeded as exc:
            if layer != 0 or k is None or not self.can_spill:
                raise
            self._spill_after(exc, 1, timeout_s)
            res = self._attend_extents(layer, q, k, v, tokens, return_block_mass, timeout_s)
        if k is not None and layer == 0 and self.num_tokens is not None:
            self.num_tokens += 1
        return squeeze(res, is_one)

    def _attend_extents(
        self,
        layer: int,
        q: Any,
        k: Any,
        v: Any,
        tokens: list[int] | None,
        return_block_mass: bool,
        timeout_s: float | None,
    ) -> AttentionResult:
        """One decode step of this sequence over its extents: one call per node, in parallel
        (the tail's appends when k is given), merged by LSE in extent order."""
        last = len(self.extents) - 1
        spec = layer_of(self.attention, layer)
        pos = self._query_position(layer, k) if spec.masks else 0
        if self._budget_on and k is not None and layer == 0:
            budgets.make_room(self, 1, timeout_s)
        calls = []
        skipped = 0
        for i, node in enumerate(self._nodes):
            appends = i == last and k is not None
            if not appends and self._held_tokens(i) == 0:
                continue  # an empty new tail, or an extent a budget emptied: nothing to attend to
            view = WHOLE
            if spec.masks and i < last:
                view = extent_view(spec, self.extents[i].first_token, self.extents[i + 1].first_token, pos)
            if view == SKIP:
                skipped += 1
                continue
            if view == PAST:  # the window's edge is inside it: the node masks from the query's position
                calls.append(
                    lambda data=node.data: data.start_attend_prefill(  # type: ignore[misc]
                        self.seq_id, layer, q, timeout_s=timeout_s, query_position=pos
                    )
                )
                continue
            calls.append(
                lambda data=node.data, appends=appends: data.start_attend(  # type: ignore[misc]
                    [self.seq_id],
                    layer,
                    q,
                    k if appends else None,
                    v if appends else None,
                    tokens if appends else None,
                    return_block_mass=return_block_mass,
                    timeout_s=timeout_s,
                )
            )
        calls.reverse()  # the tail's request (it appends) out first
        results = exchange(calls)
        if len(calls) > 1:
            self.client.counters["sharded_steps"] += 1
            self.client.counters["sharded_attends"] += len(calls)
        self.client.counters["window_skipped_attends"] += skipped
        if skipped:  # the masses would no longer line up with the extents
            results = [AttentionResult(r.out, r.lse) for r in results]
        res = merge(results[::-1])
        if return_block_mass and len(calls) > 1 and not skipped and not spec.masks:
            mass = exact_mass(self, layer, q, res.lse, timeout_s, int(k is not None and layer == 0))
            res = AttentionResult(res.out, res.lse, mass)
        if self._budget_on:  # (the new token, landed, is counted by the caller after)
            budgets.record(
                self, layer, q, res.lse, last, timeout_s, pending=int(k is not None and layer == 0)
            )
        return res

    def attend_prefill(
        self,
        layer: int,
        q: Any,
        k: Any = None,
        v: Any = None,
        token_ids: codec.TokenIds | None = None,
        *,
        return_block_mass: bool = False,
        timeout_s: float | None = None,
    ) -> AttentionResult:
        """n query tokens (q [n, q_heads, D]) attending causally to the cache and themselves.
        Over several extents the queries see every earlier extent whole and the tail
        causally; new tokens the tail cannot take go to a new extent (decided at layer 0,
        kept by the later layers). No block mass across extents."""
        if not self.is_sharded and (k is None or self._tail_room() is None):
            try:
                res = self.node.data.attend_prefill(
                    self.seq_id,
                    layer,
                    q,
                    k,
                    v,
                    token_ids,
                    return_block_mass=return_block_mass,
                    timeout_s=timeout_s,
                )
            except CapacityExceeded as exc:
                if layer != 0 or k is None or self.num_tokens is None:
                    raise
                self._spill_after(exc, len(q), timeout_s)
            else:
                if k is not None and layer == 0 and self.num_tokens is not None:
                    self.num_tokens += len(q)
                self._plan = []
                return res
        return self._prefill_sharded(layer, q, k, v, token_ids, timeout_s)

    def _prefill_sharded(
        self, layer: int, q: Any, k: Any, v: Any, token_ids: codec.TokenIds | None, timeout_s: float | None
    ) -> AttentionResult:
        n = len(q)
        if k is None:  # q are the last n tokens: they must all be in the tail
            tail = self._held_tokens(len(self.extents) - 1)
            if tail is not None and tail < n:
                raise InvalidArgument(
                    f"sequence {self.seq_id!r}: {n} queries for its last tokens but its tail extent "
                    f"holds {tail}; append them with k and v instead"
                )
            last = len(self.extents) - 1
            first = None if self.num_tokens is None else self.num_tokens - n
            return prefill_part(self, layer, last, q, None, None, None, first, timeout_s)
        if layer > 0:  # the parts layer 0 made, in order
            plan = self._plan
            if sum(c for _, c, _ in plan) != n:
                plan = [(len(self.extents) - 1, n, None if self.num_tokens is None else self.num_tokens - n)]
            parts, done = [], 0
            for ext, count, first in plan:
                s = slice(done, done + count)
                parts.append(prefill_part(self, layer, ext, q[s], k[s], v[s], None, first, timeout_s))
                done += count
            return cat_rows(parts)
        tokens = codec.token_list(token_ids)
        plan, parts, done = [], [], 0
        take = n
        while done < n:
            room = self._tail_room()
            if room == 0:
                self.extend(timeout_s=timeout_s)
                continue
            count = min(take, n - done, room if room is not None else n)
            s = slice(done, done + count)
            ext = len(self.extents) - 1
            assert self.num_tokens is not None
            first = self.num_tokens
            try:
                if self._budget_on:  # room for all n at once (a no-op after the first part)
                    budgets.make_room(self, n - done, timeout_s)
                parts.append(prefill_part(self, layer, ext, q[s], k[s], v[s], tokens[s], first, timeout_s))
            except CapacityExceeded as exc:
                take = self._spill_after(exc, count, timeout_s)
                continue
            self.num_tokens += count
            plan.append((ext, count, first))
            done += count
            take = n - done
        self._plan = plan
        return cat_rows(parts)

    def fork(self, child_id: str, *, timeout_s: float | None = None) -> Sequence:
        """A new sequence sharing every block of every extent (copy-on-write of the tail's
        partial last block)."""
        extents = self.client.routing.fork(self.seq_id, child_id, timeout_s)
        child = Sequence(
            self.client,
            child_id,
            extents,
            num_tokens=self.num_tokens,
            max_extent_tokens=self.max_extent_tokens,
            attention=self.attention,
            no_spill=self.no_spill,
        )
        # the nodes copied a budget they keep; one this handle keeps is copied here
        child._budget_args, child._was_budgeted = self._budget_args, self._was_budgeted
        child.budget = None if self.budget is None else self.budget.copy()
        return child

    def read_kv(
        self,
        start: int = 0,
        end: int | None = None,
        *,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
        timeout_s: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions [start, end): each [num_layers, n, kv_heads, D] (streamed).
        out: a (k, v) pair of contiguous CPU tensors of exactly that shape and the node's
        dtype to receive them (no allocation per call; returned); InvalidArgument when it
        does not match, the sequence and the connection untouched. A range across extents
        is read from each node and joined."""
        if not self.is_sharded:
            return self.node.data.read_kv(self.seq_id, start, end, timeout_s, out)
        # where each extent's held tokens begin (a budget's drops shift them, as on one node)
        firsts = [e.first_token for e in self.extents]
        if self.budget is not None:
            dropped = self.budget.dropped
            firsts = [first - sum(dropped[:i]) for i, first in enumerate(firsts)]
        stop = end
        if stop is None:  # to the tail's end (read it when this handle does not know its length)
            tail = self._held_tokens(len(self.extents) - 1)
            if tail is None:
                tail = self._nodes[-1].data.read_kv(self.seq_id, 0, None, timeout_s)[0].shape[1]
            stop = firsts[-1] + tail
        if not isinstance(start, int) or not isinstance(stop, int) or not 0 <= start <= stop:
            raise InvalidArgument(f"read_kv: need 0 <= start <= end, got [{start}, {stop})")
        pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, first in enumerate(firsts):
            last = i == len(firsts) - 1
            lo = max(start, first)
            hi = stop if last else min(stop, firsts[i + 1])
            if lo < hi or (last and not pieces):
                pieces.append(self._nodes[i].data.read_kv(self.seq_id, lo - first, hi - first, timeout_s))
        k = torch.cat([p[0] for p in pieces], dim=1)
        v = torch.cat([p[1] for p in pieces], dim=1)
        if out is None:
            return k, v
        if out[0].shape != k.shape or out[1].shape != v.shape or out[0].dtype != k.dtype:
            raise InvalidArgument(
                f"read_kv out: need two tensors of shape {tuple(k.shape)} and dtype {k.dtype}, got "
                f"{tuple(out[0].shape)} / {tuple(out[1].shape)} {out[0].dtype}"
            )
        out[0].copy_(k)
        out[1].copy_(v)
        return out

    def swap_out(self, *, timeout_s: float | None = None) -> int:
        """Move the sequence to its nodes' host memory; returns blocks moved."""
        return self.client.routing.swap_out(self.seq_id, timeout_s)

    def swap_in(self, *, timeout_s: float | None = None) -> int:
        """Bring it back, byte-exact; returns blocks copied."""
        num_blocks, extents = self.client.routing.swap_in(self.seq_id, timeout_s)
        self._set_extents(extents)
        return num_blocks

    def set_budget(
        self,
        max_tokens: int | None,
        sink_blocks: int = 1,
        recent_blocks: int = 4,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """A lossy token budget (None lifts it): at most max_tokens held, keeping the first
        sink_blocks and the last recent_blocks, dropping the least attended blocks between
        before an append that would pass it. The node keeps it while the sequence is on one
        node; over several nodes this handle keeps it (budget.py), choosing the same blocks:
        a handle found by id does not know a budget another handle set over several nodes."""
        args = None if max_tokens is None else (max_tokens, sink_blocks, recent_blocks)
        if not self.is_sharded:
            self.node.control.set_budget(self.seq_id, max_tokens, sink_blocks, recent_blocks, timeout_s)
        elif args is not None:
            budgets.check(max_tokens, sink_blocks, recent_blocks, self._block_size(timeout_s))  # type: ignore[arg-type]
            if self.budget is None:
                self.budget = budgets.take(self, args, timeout_s)
        self._budget_args, self._was_budgeted = args, self._was_budgeted or args is not None
        if self.budget is not None:  # (lifted: it keeps counting what was dropped where)
            self.budget.max_tokens = max_tokens
            self.budget.sink_blocks, self.budget.recent_blocks = sink_blocks, recent_blocks
            if max_tokens is not None:
                budgets.make_room(self, 0, timeout_s)

    def close(self, *, keep_prefix: int | None = None, timeout_s: float | None = None) -> None:
        """Free the sequence (and, in a cluster, its page table: every extent). Idempotent on
        this handle. In a cluster the worker frees it on each extent's node, then the
        coordinator drops the page table (closing.py); a sequence whose open failed on its
        node (OpenFailed) has nothing to close: that error, or NotFound, is raised; a lost
        one raises SequenceLost naming the node (its page table is dropped: the handle is
        closed). Unavailable (a node down or cut off, or a suspect, with no verdict yet)
        leaves the handle open and the page table kept: close again to get the answer.

        `keep_prefix=k` when nothing past the first k tokens will be asked for again (the
        conversation ended; k = the system prompt's length): the node drops those cached
        blocks now, so they do not push out blocks that other requests will reuse. Default:
        everything stays cached until evicted. A negative k raises InvalidArgument."""
        if keep_prefix is not None and keep_prefix < 0:
            raise InvalidArgument(f"keep_prefix must be >= 0 tokens, got {keep_prefix}")
        if not self.is_closed:
            try:
                if self.client.is_cluster:
                    close_in_cluster(self, timeout_s, keep_prefix)
                else:
                    self.client.routing.close(self.seq_id, timeout_s, keep_prefix)
            except (OpenFailed, NotFound, SequenceLost):
                self.is_closed = True
                self._forget()
                raise
            self.is_closed = True
            if self.client.is_cluster:  # (direct mode holds no tickets)
                self._forget()

    def _forget(self) -> None:
        for node in self._nodes:
            node.wallet.forget(self.seq_id)

    def __repr__(self) -> str:
        where = ",".join(e.route.node_id or e.route.address for e in self.extents)
        return f"Sequence({self.seq_id!r}, node={where}, cached={self.num_cached_tokens})"

    def __enter__(self) -> Sequence:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        try:
            self.close()
        except (OpenFailed, NotFound, SequenceLost):
            if exc_type is None:  # else the body's error (e.g. the OpenFailed itself) says it
                raise
