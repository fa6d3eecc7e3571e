"""Paged prefill attention against the float64 reference (each of its paths), and the LSE merge of
partial results from several nodes."""

from __future__ import annotations

import math

import pytest
import torch
from attention_reference import (
    BACKENDS,
    LSE_TOL,
    MASS_TOL,
    OUT_TOL,
    make_scenario,
    reference,
    require_backend,
)

from pagedkv.cache_node.attention import (
    kernel_info,
    merge_partials,
    paged_decode,
    paged_prefill,
    prefill,
)
from pagedkv.protos.errors import InvalidArgument


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    kernel_info()  # build once up front so the first test's time is not the compile


# --------------------------------------------------------------------------- prefill


@pytest.mark.parametrize("path", ["explicit+mass", "flash-masked", "flash-split"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize(("context_len", "num_queries"), [(1, 1), (16, 16), (37, 37), (37, 9), (50, 1)])
def test_prefill_matches_reference(
    group: int,
    block_size: int,
    context_len: int,
    num_queries: int,
    path: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each prefill path: the explicit one (block mass), the flash kernel's one masked call
    (small prefills) and its two unmasked calls merged by LSE (large ones; forced here)."""
    with_mass = path == "explicit+mass"
    if path == "flash-split":
        monkeypatch.setattr(prefill, "_MASKED_PREFILL_MAX", 0)
    num_kv_heads, head_dim = 2, 32
    sc = make_scenario(
        [context_len],
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        head_dim=head_dim,
        seed=context_len + num_queries,
    )
    q = torch.randn(num_queries, num_kv_heads * group, head_dim)
    masks = prefill._folded_causal_mask.cache_info()
    result = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], context_len, return_block_mass=with_mass)
    after = prefill._folded_causal_mask.cache_info()
    assert (after.hits + after.misses > masks.hits + masks.misses) == (path == "flash-masked")
    out, lse, mass = reference(
        q, sc.keys[0], sc.values[0], context_len - num_queries, head_dim**-0.5, block_size
    )
    torch.testing.assert_close(result.out.double(), out, **OUT_TOL[torch.float32])
    torch.testing.assert_close(result.lse.double(), lse, **LSE_TOL)
    if not with_mass:
        assert result.block_mass is None
        return
    assert result.block_mass is not None and result.block_mass.shape == (sc.tables.shape[1],)
    torch.testing.assert_close(result.block_mass[: len(mass)].double(), mass, **MASS_TOL)
    assert torch.all(result.block_mass[len(mass) :] == 0)
    assert math.isclose(float(result.block_mass.sum()), num_queries * q.shape[1], rel_tol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_types_without_mass(dtype: torch.dtype) -> None:
    sc = make_scenario([45], num_kv_heads=1, block_size=8, head_dim=32, dtype=dtype, seed=3)
    q = torch.randn(20, 2, 32).to(dtype)
    result = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 45)
    out, lse, _ = reference(q, sc.keys[0], sc.values[0], 25, 32**-0.5, 8)
    assert result.out.dtype == dtype
    torch.testing.assert_close(result.out.double(), out, **OUT_TOL[dtype])
    torch.testing.assert_close(result.lse.double(), lse, **LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_types_and_query_chunks(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill, "_PREFILL_SCORE_BUDGET", 500)  # forces several query chunks
    sc = make_scenario([45], num_kv_heads=1, block_size=8, head_dim=32, dtype=dtype, seed=2)
    q = torch.randn(20, 2, 32).to(dtype)
    result = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 45, return_block_mass=True)
    out, lse, mass = reference(q, sc.keys[0], sc.values[0], 25, 32**-0.5, 8)
    assert result.out.dtype == dtype
    torch.testing.assert_close(result.out.double(), out, **OUT_TOL[dtype])
    torch.testing.assert_close(result.lse.double(), lse, **LSE_TOL)
    assert result.block_mass is not None
    torch.testing.assert_close(result.block_mass[: len(mass)].double(), mass, **MASS_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_of_last_token_equals_decode(backend: str) -> None:
    require_backend(backend)
    sc = make_scenario([29], num_kv_heads=2, block_size=8, head_dim=32, seed=9)
    q = torch.randn(1, 8, 32)
    pre = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 29, return_block_mass=True)
    dec = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend=backend
    )
    torch.testing.assert_close(pre.out, dec.out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(pre.lse, dec.lse, **LSE_TOL)
    assert pre.block_mass is not None and dec.block_mass is not None
    torch.testing.assert_close(pre.block_mass, dec.block_mass[0], **MASS_TOL)


# --------------------------------------------------------------------------- merge


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_of_two_nodes_equals_full_decode(backend: str) -> None:
    """A sequence split across two nodes at a block boundary: each attends over its own blocks, the
    client merges by LSE and gets the single-node result."""
    require_backend(backend)
    bs, split = 8, 3  # node A holds logical blocks [0, 3), node B the rest
    sc = make_scenario([70, 45], num_kv_heads=2, block_size=bs, head_dim=32, seed=4)
    q = torch.randn(2, 8, 32)
    full = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend=backend)
    part_a = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables[:, :split], torch.full((2,), split * bs), backend=backend
    )
    part_b = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables[:, split:], sc.seq_lens - split * bs, backend=backend
    )
    out, lse = merge_partials([part_a.out, part_b.out], [part_a.lse, part_b.lse])
    torch.testing.assert_close(out, full.out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, full.lse, **LSE_TOL)


def test_merge_three_parts_and_empty_parts() -> None:
    sc = make_scenario([24], num_kv_heads=1, block_size=8, head_dim=16, seed=8)
    q = torch.randn(5, 2, 16)  # prefill-shaped partials: [n, Hq, D]
    full = paged_prefill(q, sc.k_cache, sc.v_cache, sc.tables[0], 24)
    # keys [0, 8), [8, 16), [16, 24) as three "nodes": float64 partial attention over each range
    q64 = q.double()
    keys = sc.keys[0].double().repeat_interleave(2, dim=1)
    values = sc.values[0].double().repeat_interleave(2, dim=1)
    future = torch.arange(24).unsqueeze(0) > (19 + torch.arange(5)).unsqueeze(1)  # queries at 19..23
    outs, lses = [], []
    for lo in (0, 8, 16):
        outside = torch.ones(24, dtype=torch.bool)
        outside[lo : lo + 8] = False
        s = (torch.einsum("nhd,lhd->hnl", q64, keys) * 16**-0.5).masked_fill(future | outside, -math.inf)
        lse = torch.logsumexp(s, -1)
        outs.append(torch.einsum("hnl,lhd->nhd", torch.exp(s - lse.unsqueeze(-1)), values).float())
        lses.append(lse.T.float())
    empty_out, empty_lse = torch.zeros_like(outs[0]), torch.full_like(lses[0], -math.inf)
    out, lse = merge_partials([*outs, empty_out], [*lses, empty_lse])
    torch.testing.assert_close(out, full.out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, full.lse, **LSE_TOL)
    nothing_out, nothing_lse = merge_partials([empty_out], [empty_lse])
    assert torch.all(nothing_out == 0) and torch.all(nothing_lse == -math.inf)
    with pytest.raises(InvalidArgument, match="as many outs as lses"):
        merge_partials([empty_out], [])
    with pytest.raises(InvalidArgument, match="part 1"):
        merge_partials([empty_out, empty_out[:2]], [empty_lse, empty_lse[:2]])
