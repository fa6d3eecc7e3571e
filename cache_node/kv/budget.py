"""Token budgets: a sequence that opted in keeps at most `max_tokens`, dropping its
lowest-score middle blocks (never the sink or the recent window), as H2O and
StreamingLLM do. This module decides what to drop; the manager drops it
(KVCacheManager.drop_blocks), before an append, so the tokens being written are never
dropped (their other layers' K/V may still be on the way).

    table:  [ sink ... | middle (drop candidates, lowest score first) | ... recent ]
             0 .. sink_blocks-1                                        last recent_blocks
"""

from __future__ import annotations

from ...protos.errors import InvalidArgument
from .sequence import Budget, Sequence


def check_budget(budget: Budget, block_size: int) -> None:
    """Raise InvalidArgument unless the budget can hold its sink and recent blocks."""
    floor = (budget.sink_blocks + budget.recent_blocks) * block_size
    if budget.sink_blocks < 0 or budget.recent_blocks < 1 or budget.max_tokens < floor:
        raise InvalidArgument(
            f"budget needs sink_blocks >= 0, recent_blocks >= 1 and max_tokens >= "
            f"(sink + recent) * block_size = {floor}; got {budget}"
        )


def drop_plan(seq: Sequence, incoming: int, block_size: int) -> list[int]:
    """Table indices to drop, ascending, so the sequence plus `incoming` tokens fits its
    budget (whole blocks, lowest score first, ties by index). Changes nothing."""
    budget = seq.budget
    assert budget is not None
    excess = seq.cache_len + incoming - budget.max_tokens
    if excess <= 0:
        return []
    excess_blocks = -(-excess // block_size)
    lo, hi = budget.sink_blocks, len(seq.table) - budget.recent_blocks
    scores = seq.scores
    middle = sorted(range(lo, max(hi, lo)), key=lambda i: (scores[i], i))
    return sorted(middle[:excess_blocks])
