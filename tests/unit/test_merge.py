"""protos/merge.py against attention over all the keys at once, computed directly."""

from __future__ import annotations

import math

import pytest
import torch

from pagedkv.protos.errors import InvalidArgument
from pagedkv.protos.merge import _merge_cpu, _merge_torch, merge_partials


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


@pytest.mark.parametrize("path", ["cpu", "torch"])
def test_both_paths_match_the_float64_reference(path: str) -> None:
    """The numpy path (CPU tensors) and the torch one (any other device) agree with attention
    over all keys in float64, with an empty part, bf16 outs, lse far from 0, unchanged inputs."""
    merge = _merge_cpu if path == "cpu" else _merge_torch
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(3, 4, 16, generator=gen) * 6  # sharp softmaxes: lse in the tens
    k = torch.randn(3, 40, 4, 16, generator=gen)
    v = torch.randn(3, 40, 4, 16, generator=gen)
    want_out, want_lse = attention(q, k, v)
    parts = [attention(q, k[:, a:b], v[:, a:b]) for a, b in [(0, 17), (17, 17), (17, 31), (31, 40)]]
    outs, lses = [o.float() for o, _ in parts], [s.float() for _, s in parts]
    copies = [t.clone() for t in (*outs, *lses)]
    out, lse = merge(outs, lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(copies, (*outs, *lses), strict=True))
    out16, lse16 = merge([o.bfloat16() for o in outs], lses)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.double(), want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse16, lse)
    scalar_out, scalar_lse = merge([outs[0][0, 0], outs[2][0, 0]], [lses[0][0, 0], lses[2][0, 0]])
    assert scalar_lse.shape == () and scalar_out.shape == (16,)
    torch.testing.assert_close(scalar_lse, torch.logaddexp(lses[0][0, 0], lses[2][0, 0]))


def test_cpu_tensors_take_the_numpy_path_unless_they_need_grad() -> None:
    outs = [torch.randn(2, 3, 4), torch.randn(2, 3, 4)]
    lses = [torch.randn(2, 3), torch.full((2, 3), -math.inf)]  # the second part holds no keys
    out, lse = merge_partials(outs, lses)
    torch.testing.assert_close(out, outs[0])
    torch.testing.assert_close(lse, lses[0])
    graded = [outs[0].clone().requires_grad_(), outs[1]]
    out, _ = merge_partials(graded, lses)
    out.sum().backward()  # the torch path keeps autograd
    assert graded[0].grad is not None and torch.equal(graded[0].grad, torch.ones(2, 3, 4))
