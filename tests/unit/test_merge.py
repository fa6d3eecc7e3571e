"""protos/merge.py against attention over all the keys at once, computed directly."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.merge import merge_partials


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, D], k/v [B, T, H, D] -> out [B, H, D], lse [B, H] (natural log)."""
    scores = torch.einsum("bhd,bthd->bht", q.double(), k.double()) / math.sqrt(q.shape[-1])
    if scores.shape[-1] == 0:
        return torch.zeros(q.shape, dtype=torch.float64), torch.full(
            q.shape[:2], -math.inf, dtype=torch.float64
        )
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bht,bthd->bhd", torch.softmax(scores, dim=-1), v.double())
    return out, lse


def test_parts_merge_to_the_whole() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 8, generator=gen)
    k = torch.randn(4, 13, 2, 8, generator=gen)
    v = torch.randn(4, 13, 2, 8, generator=gen)
    want_out, want_lse = attention(q, k, v)
    cuts = [(0, 5), (5, 5), (5, 13)]  # an empty middle part contributes nothing
    parts = [attention(q, k[:, a:b], v[:, a:b]) for a, b in cuts]
    out, lse = merge_partials([o.float() for o, _ in parts], [s.float() for _, s in parts])
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want_out.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-5, atol=1e-5)


def test_all_parts_empty_and_bad_shapes() -> None:
    empty_out, empty_lse = torch.zeros(2, 3, 4, dtype=torch.bfloat16), torch.full((2, 3), -math.inf)
    out, lse = merge_partials([empty_out, empty_out], [empty_lse, empty_lse])
    assert out.dtype == torch.bfloat16 and torch.equal(out, empty_out) and torch.isinf(lse).all()
    with pytest.raises(InvalidArgument, match="as many outs as lses"):
        merge_partials([empty_out], [])
    with pytest.raises(InvalidArgument, match="part 1"):
        merge_partials([empty_out, empty_out[:, :2]], [empty_lse, empty_lse[:, :2]])
