"""Windows and chunks over a sequence sharded across nodes: which extents a query sees.

A query at position p sees the keys from first_visible(p) (protos/attention.py) to p. Each
extent's node counts positions in the whole sequence (its Open named its first one), so the
tail and every extent the query sees whole are attended as usual; what lies wholly before
first_visible(p) is not attended at all::

    positions   [ a0 ...... b0 )[ a1 ........ b1 )[ a2 ......... tail ... p ]
    window(p)                          |<----------- the last `window` ---->|
    extent          SKIP (no call)     PAST             WHOLE (the usual call)

- SKIP: first_visible(p) >= b: no call (counted: window_skipped_attends).
- WHOLE: first_visible(p) <= a, or a chunk's partial extent: the query's chunk is the extent's
  last token's, so the node's own mask (from its last token) is the query's.
- PAST: a window's edge inside the extent: AttendPrefill with query_position = p, the node
  masks from p (one more call, gRPC, for that row: at most one extent per row and layer).

A prefill's n queries at p0 .. p0 + n - 1 see an earlier extent as a prefix of them (first_visible
never decreases): `query_split` says how many see it at all and how many see it whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..protos.attention import LayerAttention
from .types import AttentionResult

SKIP, WHOLE, PAST = "skip", "whole", "past"
PLAIN = LayerAttention()


def layer_of(attention: Sequence[LayerAttention], layer: int) -> LayerAttention:
    """A sequence's spec at `layer` (plain when it has none)."""
    return attention[layer] if attention else PLAIN


def extent_view(spec: LayerAttention, first: int, end: int, pos: int) -> str:
    """How a decode query at `pos` sees the sealed extent holding positions [first, end)."""
    lo = spec.first_visible(pos)
    if lo >= end:
        return SKIP
    if lo <= first or not spec.window:
        return WHOLE
    return PAST


def query_split(spec: LayerAttention, first: int, end: int, first_query: int, n: int) -> tuple[int, int]:
    """(whole, seen) for n queries at first_query.. over the sealed extent [first, end): the
    first `seen` see some of it, the first `whole` of those all of it (or, for a chunk, exactly
    what its last token sees): whole == seen when one usual call serves them all."""
    seen = whole = 0
    for i in range(n):
        lo = spec.first_visible(first_query + i)
        if lo >= end:
            break
        seen += 1
        whole += lo <= first or not spec.window
    return whole, seen


def pad_rows(res: AttentionResult, n: int) -> AttentionResult:
    """A result for the first rows of n queries, with rows that saw no key (out 0, lse -inf:
    the merge gives them no weight) after them."""
    extra = n - res.out.shape[0]
    if extra == 0:
        return AttentionResult(res.out, res.lse)
    out = torch.cat([res.out, res.out.new_zeros((extra, *res.out.shape[1:]))])
    lse = torch.cat([res.lse, torch.full((extra, *res.lse.shape[1:]), -torch.inf, dtype=res.lse.dtype)])
    return AttentionResult(out, lse)
