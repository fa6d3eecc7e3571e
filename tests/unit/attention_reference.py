"""The reference paged attention is checked against, shared by the attention tests.

Each scenario writes sequences into a NaN-poisoned pool through shuffled block tables (with a forked
sequence sharing its parent's full blocks), so reading any slot that is not part of a sequence shows
up as NaN; results are compared with explicit float64 softmax attention computed on the sequences'
logical K/V (not on the pool), so the paging itself is under test too.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedkv.cache_node.attention import (
    AttentionOutput,
    kernel_info,
)

BACKENDS = ["kernel", "torch"]
# Tolerances vs the float64 reference. fp32: rtol 1e-5 as specified, atol for values near 0
# (5e-6: the Triton interpreter's dots run in numpy's BLAS, whose AVX-512 kernels sum 128-wide
# blocks in another order than AVX2 ones: 3e-6 seen at D 128, block 128; a wrong kernel is off by >1e-2).
# Half types: the pool holds rounded values and the reference uses the same rounded values, so only
# float32 accumulation and the final rounding of `out` to the half type remain; lse stays float32.
OUT_TOL: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: dict(rtol=1e-5, atol=5e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
LSE_TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-5)
MASS_TOL: dict[str, Any] = dict(rtol=1e-5, atol=1e-6)


def require_backend(backend: str) -> None:
    if backend == "kernel" and not kernel_info().is_available:
        if os.environ.get("PAGEDKV_REQUIRE_KERNEL") == "1":
            pytest.fail(f"C++ kernel required but unavailable: {kernel_info().detail}")
        pytest.skip(f"C++ kernel unavailable: {kernel_info().detail}")


# --------------------------------------------------------------------------- scenario + reference


@dataclass
class Scenario:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor  # [B, max_blocks] int32, padding entries = -1 (must be ignored)
    seq_lens: torch.Tensor  # [B]
    keys: list[torch.Tensor]  # per sequence [L, Hk, D], the logical K (rounded to the pool dtype)
    values: list[torch.Tensor]


def make_scenario(
    lens: list[int],
    *,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    fork_of_first: int = 0,
    seed: int = 0,
) -> Scenario:
    """Sequences with the given lengths; the last `fork_of_first` ones are forks of sequence 0 that
    share its full blocks (physically) and their own copy of the rest, then diverge."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled physical ids
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype)
    v_cache = torch.full(shape, math.nan, dtype=dtype)
    max_blocks = max(blocks_needed) + 2  # padding columns
    tables = torch.full((len(lens), max_blocks), -1, dtype=torch.int32)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    first_forked = len(lens) - fork_of_first
    for b, n in enumerate(lens):
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        ids: list[int] = []
        if b >= first_forked:
            shared = min(n, lens[0]) // block_size  # full blocks only; a partial one is copied on write
            k[: shared * block_size] = keys[0][: shared * block_size]
            v[: shared * block_size] = values[0][: shared * block_size]
            ids = tables[0, :shared].tolist()
        ids += [free.pop() for _ in range(blocks_needed[b] - len(ids))]
        tables[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        phys = torch.tensor(ids)[pos // block_size]
        k_cache[phys, :, pos % block_size] = k
        v_cache[phys, :, pos % block_size] = v
        keys.append(k)
        values.append(v)
    return Scenario(k_cache, v_cache, tables, torch.tensor(lens), keys, values)


def reference(q, keys, values, first_pos: int, scale: float, block_size: int):
    """Float64 causal attention: q [n, Hq, D] at positions first_pos + i over keys [L, Hk, D].
    Returns (out [n, Hq, D], lse [n, Hq], mass per logical block summed over heads and queries)."""
    q64, k64, v64 = q.double(), keys.double(), values.double()
    group = q.shape[1] // keys.shape[1]
    k64 = k64.repeat_interleave(group, dim=1)
    v64 = v64.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q64, k64) * scale
    query_pos = first_pos + torch.arange(q.shape[0])
    future = torch.arange(keys.shape[0]).unsqueeze(0) > query_pos.unsqueeze(1)
    scores = scores.masked_fill(future, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("hnl,lhd->nhd", probs, v64)
    per_token = probs.sum(dim=(0, 1))
    num_logical = -(-keys.shape[0] // block_size)
    mass = torch.zeros(num_logical * block_size, dtype=torch.float64)
    mass[: keys.shape[0]] = per_token
    return out, lse.T, mass.view(num_logical, block_size).sum(-1)


def check_decode(result: AttentionOutput, sc: Scenario, q: torch.Tensor, scale: float, block_size: int):
    assert result.out.dtype == q.dtype and result.out.shape == q.shape
    assert result.lse.dtype == torch.float32 and result.lse.shape == q.shape[:2]
    assert result.block_mass is not None and result.block_mass.shape == sc.tables.shape
    for b, n in enumerate(sc.seq_lens.tolist()):
        out, lse, mass = reference(q[b : b + 1], sc.keys[b], sc.values[b], n - 1, scale, block_size)
        torch.testing.assert_close(result.out[b].double(), out[0], **OUT_TOL[q.dtype])
        torch.testing.assert_close(result.lse[b].double(), lse[0], **LSE_TOL)
        torch.testing.assert_close(result.block_mass[b, : len(mass)].double(), mass, **MASS_TOL)
        assert torch.all(result.block_mass[b, len(mass) :] == 0)
        assert math.isclose(float(result.block_mass[b].sum()), q.shape[1], rel_tol=1e-5)
