"""A token budget over a sequence sharded across nodes, kept by the client.

On one node the node keeps a budget: each block's score is the attention mass it got
(summed over heads, layers and steps), and an append past `max_tokens` first drops the
lowest-score middle blocks (cache_node/kv/budget.py). Over several nodes no node sees the
whole softmax, nor every block, so the client keeps the same budget over the sequence's
blocks laid end to end::

    extents   [ extent 0        ][ extent 1      ][ tail ......... ]
    blocks    s s . . . . . . . .  . . . . . . .  . . . . r r r r
              sink (extent 0's first)  middle: drop candidates     recent (the last, any extent)

- Scores: a node's own mass is a share of its partial softmax. After each attend over
  several nodes the client keeps the queries and the merged log-sum-exp (and how many of
  each node's tokens each query saw); when the budget next needs its scores (a drop), one
  BlockMass call per node credits all of them at once: each node's blocks' share of the
  whole softmax, exactly the mass one node holding every key would have computed. Scores
  only add up and tables only grow at the end between drops, so crediting late changes
  nothing but the cost: one call per node per drop, not per attend.
- Drops: before an append of n tokens the tail cannot take within the budget, the
  client picks the globally lowest-score middle blocks (ties: the earlier block), as one
  node would, and each node holding some drops them (DropBlocks): a sealed extent too.
- Handover: a budgeted sequence that spills hands its node's scores to the client
  (BlockMass accumulated) and the node stops dropping on its own.

So the kept blocks are the ones a single node of the same budget would keep. The cost, per
drop: one BlockMass and one DropBlocks call per node (in parallel), and the queries kept
until then (bounded: past MAX_PENDING_ROWS they are credited anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..protos.errors import InvalidArgument

if TYPE_CHECKING:
    from .sequence import Sequence

# Query rows kept for a later credit before they are credited anyway (memory bound)
MAX_PENDING_ROWS = 4096


class Queries(NamedTuple):
    """An attend's queries, not credited yet: q [n, Hq, D], the merged lse (n * Hq floats),
    and per extent the leading tokens there each query saw (empty: none)."""

    layer: int
    q: Any
    lse: list[float]
    visible: list[list[int]]


@dataclass
class SpreadBudget:
    max_tokens: int | None  # None: lifted (what was dropped where still counts)
    sink_blocks: int
    recent_blocks: int
    block_size: int
    # per extent: the score of each block held there (its node's table order), tokens
    # appended there, tokens dropped there
    scores: list[list[float]] = field(default_factory=list)
    appended: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    pending: list[Queries] = field(default_factory=list)  # credited at the next drop
    pending_rows: int = 0

    def sync(self, appended: list[int]) -> None:
        """Each extent's tokens appended so far (the tail grows): blocks that appeared since
        get a zero score, extents that appeared get their lists."""
        while len(self.dropped) < len(appended):
            self.dropped.append(0)
            self.scores.append([])
        self.appended = list(appended)
        for e, n in enumerate(appended):
            blocks = -(-(n - self.dropped[e]) // self.block_size)
            held = self.scores[e]
            held.extend([0.0] * (blocks - len(held)))

    def held(self, extent: int) -> int:
        return self.appended[extent] - self.dropped[extent]

    def credit(self, extent: int, mass: list[float]) -> None:
        held = self.scores[extent]
        if len(mass) != len(held):
            raise InvalidArgument(
                f"extent {extent}: the node gave {len(mass)} block masses for {len(held)} blocks"
            )
        for i, m in enumerate(mass):
            held[i] += m

    def excess(self, incoming: int) -> int:
        """Tokens past max_tokens once `incoming` more land (<= 0: they fit, or no budget)."""
        if self.max_tokens is None:
            return 0
        return sum(self.appended) - sum(self.dropped) + incoming - self.max_tokens

    def plan(self, incoming: int) -> dict[int, list[int]]:
        """Extent -> its table indices to drop (ascending) so that the held tokens plus
        `incoming` fit max_tokens; changes nothing. The same choice as one node's
        drop_plan over the blocks laid end to end (sync first)."""
        excess = self.excess(incoming)
        if excess <= 0:
            return {}
        need = -(-excess // self.block_size)
        flat = [(s, e, i) for e, blocks in enumerate(self.scores) for i, s in enumerate(blocks)]
        middle = flat[self.sink_blocks : max(len(flat) - self.recent_blocks, self.sink_blocks)]
        # by score, then by position (flat order): a stable sort on the score alone
        chosen = sorted(range(len(middle)), key=lambda j: middle[j][0])[:need]
        out: dict[int, list[int]] = {}
        for j in sorted(chosen):
            _, e, i = middle[j]
            out.setdefault(e, []).append(i)
        return out

    def lost(self, extent: int, indices: list[int]) -> None:
        gone = set(indices)
        self.scores[extent] = [s for i, s in enumerate(self.scores[extent]) if i not in gone]
        self.dropped[extent] += len(indices) * self.block_size

    def copy(self) -> SpreadBudget:
        return SpreadBudget(
            self.max_tokens,
            self.sink_blocks,
            self.recent_blocks,
            self.block_size,
            [list(s) for s in self.scores],
            list(self.appended),
            list(self.dropped),
            list(self.pending),
            self.pending_rows,
        )


def check(max_tokens: int, sink_blocks: int, recent_blocks: int, block_size: int) -> None:
    """The node's own check of a budget (cache_node/kv/budget.py), for one the client keeps."""
    floor = (sink_blocks + recent_blocks) * block_size
    if type(max_tokens) is not int or sink_blocks < 0 or recent_blocks < 1 or max_tokens < floor:
        raise InvalidArgument(
            f"budget needs sink_blocks >= 0, recent_blocks >= 1 and max_tokens >= "
            f"(sink + recent) * block_size = {floor}; got max_tokens={max_tokens}, "
            f"sink_blocks={sink_blocks}, recent_blocks={recent_blocks}"
        )


def take(seq: Sequence, args: tuple[int, int, int] | None, timeout_s: float | None) -> SpreadBudget:
    """The budget of a sequence about to span nodes (or spanning them), kept by the client
    from now on: each node's scores so far and tokens dropped, its own budget lifted (the
    tail's node stops dropping on its own; a sealed extent never appends). args None: a
    budget once set, lifted: only what it dropped is counted."""
    max_tokens, sink, recent = args or (None, 1, 4)
    budget = SpreadBudget(max_tokens, sink, recent, seq._block_size(timeout_s))
    appended = []
    for i, node in enumerate(seq._nodes):
        scores, held = node.data.budget_scores(seq.seq_id, timeout_s)
        n = seq._extent_tokens(i)
        appended.append(held if n is None else n)
        budget.scores.append(scores)
        budget.dropped.append(appended[-1] - held)
    budget.appended = appended
    if args is not None:
        seq.node.control.set_budget(seq.seq_id, None, sink, recent, timeout_s)
    return budget


def appended(seq: Sequence, pending: int = 0) -> list[int]:
    """Tokens appended to each extent (the tail's from the sequence's length, plus
    `pending` that landed and are not counted yet)."""
    counts = [seq._extent_tokens(i) for i in range(len(seq.extents))]
    tail = counts[-1]
    if tail is None:
        raise InvalidArgument(f"sequence {seq.seq_id!r}: its length is unknown to this handle; append first")
    return [*counts[:-1], tail + pending]  # type: ignore[list-item]


def make_room(seq: Sequence, incoming: int, timeout_s: float | None) -> None:
    """Drop what the budget evicts before `incoming` tokens go to the tail (the pending
    queries credited first; one DropBlocks per node holding some). A no-op when they fit."""
    budget = seq.budget
    assert budget is not None
    budget.sync(appended(seq))
    if budget.excess(incoming) <= 0:
        return
    flush(seq, timeout_s)
    for extent, indices in budget.plan(incoming).items():
        seq._nodes[extent].data.drop_blocks(seq.seq_id, indices, timeout_s)
        budget.lost(extent, indices)
        seq.client.counters["budget_dropped_blocks"] += len(indices)


def record(
    seq: Sequence, layer: int, q: Any, lse: Any, upto: int, timeout_s: float | None, pending: int = 0
) -> None:
    """Keep, for the next drop, queries q [n, Hq, D] (merged normalizers lse [n, Hq]) that
    attended extents 0..upto: every token of the earlier ones, causally the last n of
    `upto` (`pending`: tokens of the tail that landed, not counted in the length yet)."""
    budget = seq.budget
    assert budget is not None
    budget.sync(appended(seq, pending))
    n = len(q)
    visible: list[list[int]] = []
    for e in range(len(budget.scores)):
        held = budget.held(e)
        if e > upto or held <= 0:
            visible.append([])
        elif e < upto:
            visible.append([held] * n)
        else:  # causal: query i is the (held - n + i)-th token there
            visible.append([held - n + 1 + i for i in range(n)] if held >= n else [])
    # (a copy: the caller may reuse its q buffer before the credit)
    budget.pending.append(Queries(layer, q.detach().clone(), lse.float().reshape(-1).tolist(), visible))
    budget.pending_rows += n
    if budget.pending_rows >= MAX_PENDING_ROWS:
        flush(seq, timeout_s)


def flush(seq: Sequence, timeout_s: float | None) -> None:
    """Credit every pending query: one BlockMass per node, all nodes at once."""
    budget = seq.budget
    assert budget is not None
    if not budget.pending:
        return
    calls = []
    for e in range(len(budget.scores)):
        layers: dict[int, list[Queries]] = {}  # one part a layer: its queries stacked
        for p in budget.pending:
            if e < len(p.visible) and p.visible[e]:
                layers.setdefault(p.layer, []).append(p)
        parts = [
            (
                layer,
                torch.cat([p.q for p in group]),
                [x for p in group for x in p.lse],
                [x for p in group for x in p.visible[e]],
            )
            for layer, group in layers.items()
        ]
        if parts:
            calls.append((e, seq._nodes[e].data.start_block_mass(seq.seq_id, parts, timeout_s)))
    budget.pending, budget.pending_rows = [], 0
    for e, reply in calls:
        budget.credit(e, reply.result())
