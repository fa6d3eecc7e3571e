"""The test side's ground truth: the KV each sequence was given, and float64 dense attention."""

from __future__ import annotations

import math

import torch

from pagedkv.protos.spec import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)
NUM_Q_HEADS = 4


def rand_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V for n tokens over every layer: [num_layers, n, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def rand_q(n: int, seed: int, heads: int = NUM_Q_HEADS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, heads, SPEC.head_dim), generator=g)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int | None = None):
    """q [n, Hq, D] over k, v [L, Hk, D] in float64 -> (out [n, Hq, D], lse [n, Hq]).
    With causal_offset, query i sees keys [0, causal_offset + i]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->nhl", q, k) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        pos = torch.arange(k.shape[0])
        mask = pos[None, :] > (causal_offset + torch.arange(q.shape[0]))[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out, lse


def assert_attention(res, q, k, v, causal_offset=None, atol=1e-4) -> None:
    out, lse = dense(q, k, v, causal_offset)
    torch.testing.assert_close(res.out.double(), out, atol=atol, rtol=1e-4)
    torch.testing.assert_close(res.lse.double(), lse, atol=atol, rtol=1e-4)
