"""Which sealed extents a windowed or chunked query sees (client/extent_masks.py): exact
outcomes for a window's edge before, inside and on the edges of an extent, a chunk that starts
inside one, and a prefill's queries split into those that see an extent whole, cut, or not."""

from __future__ import annotations

import torch

from pagedkv.client.extent_masks import PAST, SKIP, WHOLE, extent_view, pad_rows, query_split
from pagedkv.client.types import AttentionResult
from pagedkv.protos.attention import LayerAttention

W8 = LayerAttention(window=8)  # a query at p sees p - 7 .. p
C8 = LayerAttention(chunk=8)  # a query at p sees 8 * (p // 8) .. p


def test_a_decode_query_skips_cuts_or_sees_whole_each_extent():
    # extent [16, 32), query at 40: the window sees 33.. -> wholly before it
    assert extent_view(W8, 16, 32, 40) == SKIP
    assert extent_view(W8, 16, 32, 39) == SKIP  # sees 32..: the extent ends at 31
    assert extent_view(W8, 16, 32, 38) == PAST  # sees 31..: its last token only
    assert extent_view(W8, 16, 32, 23) == WHOLE  # sees 16..: the window's edge on its first token
    assert extent_view(W8, 16, 32, 24) == PAST  # sees 17..
    assert extent_view(LayerAttention(), 16, 32, 1000) == WHOLE  # no window: every extent whole
    # a chunk: the query's chunk is the extent's last token's, so the usual call is exact
    assert extent_view(C8, 16, 30, 31) == WHOLE  # chunk [24, 32) cuts [16, 30): the node masks it
    assert extent_view(C8, 16, 32, 33) == SKIP  # chunk [32, 40)
    both = LayerAttention(window=6, chunk=8)
    assert extent_view(both, 16, 30, 31) == PAST  # sees max(26, 24) = 26..: a window's edge


def test_a_prefills_queries_split_by_what_they_see():
    # extent [16, 32), queries at 30 .. 41 (12 of them, past the extent from 32)
    whole, seen = query_split(W8, 16, 32, 30, 12)
    # query i at 30 + i sees from 23 + i: 23..31 cut the extent (i < 9), none whole
    assert (whole, seen) == (0, 9)
    assert query_split(W8, 16, 32, 20, 4) == (4, 4)  # 20..23 see from 13..16: the extent whole
    assert query_split(W8, 16, 32, 22, 4) == (2, 4)  # 24, 25 see from 17, 18: cut
    assert query_split(C8, 16, 32, 30, 4) == (2, 2)  # 30, 31 in chunk [24, 32); 32, 33 past it
    assert query_split(LayerAttention(), 16, 32, 40, 3) == (3, 3)


def test_rows_that_saw_nothing_weigh_nothing():
    res = AttentionResult(torch.ones(2, 4, 8), torch.zeros(2, 4))
    padded = pad_rows(res, 5)
    assert padded.out.shape == (5, 4, 8) and padded.lse.shape == (5, 4)
    assert torch.equal(padded.out[2:], torch.zeros(3, 4, 8))
    assert torch.all(padded.lse[2:] == -torch.inf) and torch.all(padded.lse[:2] == 0)
