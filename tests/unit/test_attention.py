"""Paged attention against a float64 dense reference, for both backends (C++ kernel and torch).

Each scenario writes sequences into a NaN-poisoned pool through shuffled block tables (with a forked
sequence sharing its parent's full blocks), so reading any slot that is not part of a sequence shows
up as NaN, and compares out / lse / block_mass with explicit float64 softmax attention computed on
the sequences' logical K/V (not on the pool), so the paging itself is under test too.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from pagedkv.cache_node import attention
from pagedkv.cache_node.attention import (
    AttentionOutput,
    cpu_kernel,
    gather,
    kernel_info,
    merge_partials,
    paged_decode,
    paged_prefill,
    prefill,
)
from pagedkv.protos import native_build
from pagedkv.protos.errors import FailedPrecondition, InvalidArgument

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


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    kernel_info()  # build once up front so the first test's time is not the compile


def _require(backend: str) -> None:
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


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_reference(backend: str, group: int, block_size: int) -> None:
    _require(backend)
    bs = block_size
    # lengths: 1, exact multiples, one past a boundary, one short of one, random; plus a fork
    lens = [1, bs, bs + 1, 2 * bs - 1 if bs > 1 else 2, 3 * bs, 37, 53]
    num_kv_heads, head_dim = 2, 64
    sc = make_scenario(
        lens,
        num_kv_heads=num_kv_heads,
        block_size=bs,
        head_dim=head_dim,
        fork_of_first=1,
        seed=block_size * 10 + group,
    )
    q = torch.randn(len(lens), num_kv_heads * group, head_dim)
    scale = head_dim**-0.5
    result = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend=backend
    )
    check_decode(result, sc, q, scale, bs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_types(backend: str, dtype: torch.dtype) -> None:
    _require(backend)
    lens = [5, 16, 40]
    sc = make_scenario(lens, num_kv_heads=2, block_size=8, head_dim=64, dtype=dtype, fork_of_first=1, seed=3)
    q = torch.randn(len(lens), 8, 64).to(dtype)
    result = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend=backend
    )
    check_decode(result, sc, q, 64**-0.5, 8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_writes_into_given_out(backend: str, dtype: torch.dtype) -> None:
    """out= (what the node passes for a same-host client's shared region): the result
    is those very tensors, with the values of a call that allocates."""
    _require(backend)
    sc = make_scenario([5, 16, 40], num_kv_heads=2, block_size=8, head_dim=64, dtype=dtype, seed=4)
    q = torch.randn(3, 8, 64).to(dtype)
    dst = (torch.full((3, 8, 64), math.nan).to(dtype), torch.full((3, 8), math.nan))
    given = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend=backend, out=dst
    )
    assert given.out is dst[0] and given.lse is dst[1]
    check_decode(given, sc, q, 64**-0.5, 8)
    fresh = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend=backend)
    assert torch.equal(dst[0], fresh.out) and torch.equal(dst[1], fresh.lse)


@pytest.mark.parametrize(
    "dst, message",
    [
        ((torch.empty(3, 8, 32), torch.empty(3, 8)), r"out= .* \[3, 8, 64\], got torch.float32 \[3, 8, 32\]"),
        ((torch.empty(3, 8, 64).half(), torch.empty(3, 8)), r"out= must be a contiguous CPU torch.float32"),
        ((torch.empty(3, 8, 64), torch.empty(8, 3).T), r"lse= must be a contiguous"),
    ],
)
def test_decode_rejects_bad_out(dst: tuple[torch.Tensor, torch.Tensor], message: str) -> None:
    sc = make_scenario([5, 16, 40], num_kv_heads=2, block_size=8, head_dim=64, seed=5)
    with pytest.raises(InvalidArgument, match=message):
        paged_decode(torch.randn(3, 8, 64), sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, out=dst)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("head_dim", [8, 40, 20])  # vector tiles only, 8-wide remainder, scalar remainder
def test_decode_head_dims_and_scale(backend: str, head_dim: int) -> None:
    _require(backend)
    lens = [3, 21, 30]
    sc = make_scenario(lens, num_kv_heads=1, block_size=4, head_dim=head_dim, seed=head_dim)
    q = torch.randn(len(lens), 3, head_dim)
    result = paged_decode(
        q,
        sc.k_cache,
        sc.v_cache,
        sc.tables.long(),
        sc.seq_lens,
        scale=0.3,
        return_block_mass=True,
        backend=backend,
    )
    check_decode(result, sc, q, 0.3, 4)


@pytest.mark.parametrize("num_partitions", [1, 2, 3, 7, 40])  # 40 > blocks: empty partitions
def test_kernel_split_across_partitions(num_partitions: int) -> None:
    _require("kernel")
    lens = [9, 70, 33]
    sc = make_scenario(lens, num_kv_heads=2, block_size=4, head_dim=32, fork_of_first=1, seed=5)
    q = torch.randn(len(lens), 4, 32)
    result = cpu_kernel.decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, 32**-0.5, True, num_partitions=num_partitions
    )
    check_decode(result, sc, q, 32**-0.5, 4)


def test_kernel_and_torch_agree_on_long_sequence() -> None:
    _require("kernel")
    lens = [1000, 517]  # few (sequence, head) pairs: the automatic split kicks in
    sc = make_scenario(lens, num_kv_heads=1, block_size=16, head_dim=64, seed=11)
    q = torch.randn(2, 4, 64)
    a = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="kernel", return_block_mass=True
    )
    b = paged_decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="torch", return_block_mass=True
    )
    torch.testing.assert_close(a.out, b.out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(a.lse, b.lse, **LSE_TOL)
    torch.testing.assert_close(a.block_mass, b.block_mass, **MASS_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_without_mass_and_empty_batch(backend: str) -> None:
    _require(backend)
    sc = make_scenario([10], num_kv_heads=1, block_size=4, head_dim=16)
    q = torch.randn(1, 2, 16)
    assert paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend=backend).block_mass is None
    empty = paged_decode(
        q[:0], sc.k_cache, sc.v_cache, sc.tables[:0], sc.seq_lens[:0], backend=backend, return_block_mass=True
    )
    assert empty.out.shape == (0, 2, 16) and empty.lse.shape == (0, 2)
    assert empty.block_mass is not None and empty.block_mass.shape == (0, sc.tables.shape[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_is_thread_safe(backend: str) -> None:
    _require(backend)
    scenarios = [
        make_scenario([7 + i, 30 + 3 * i], num_kv_heads=2, block_size=4, head_dim=32, seed=i)
        for i in range(6)
    ]
    queries = [torch.randn(2, 4, 32) for _ in scenarios]
    expected = [
        paged_decode(q, s.k_cache, s.v_cache, s.tables, s.seq_lens, backend=backend).out
        for q, s in zip(queries, scenarios, strict=True)
    ]
    mismatches: list[int] = []

    def worker(i: int) -> None:
        s, q = scenarios[i], queries[i]
        for _ in range(20):
            got = paged_decode(q, s.k_cache, s.v_cache, s.tables, s.seq_lens, backend=backend).out
            if not torch.equal(got, expected[i]):
                mismatches.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(scenarios))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert mismatches == []


def test_torch_path_workspace_is_reused_and_releasable() -> None:
    sc = make_scenario([30, 12], num_kv_heads=2, block_size=4, head_dim=16, seed=6)
    q = torch.randn(2, 4, 16)
    first = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="torch").out
    pooled = list(gather.workspace._free)
    assert pooled  # the gather buffers went back to the pool
    again = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="torch").out
    assert {b.data_ptr() for b in gather.workspace._free} == {b.data_ptr() for b in pooled}
    attention.release_workspace()
    assert gather.workspace._free == []
    after = paged_decode(q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, backend="torch").out
    assert torch.equal(first, again) and torch.equal(first, after)


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
    _require(backend)
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
    _require(backend)
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


# --------------------------------------------------------------------------- bad input


_BAD = make_scenario([10, 20], num_kv_heads=2, block_size=4, head_dim=16, seed=1)  # 8 blocks + 3 spare


def _decode_args(**overrides):
    args = dict(
        q=torch.randn(2, 4, 16),
        k_cache=_BAD.k_cache,
        v_cache=_BAD.v_cache,
        block_tables=_BAD.tables,
        seq_lens=_BAD.seq_lens,
    )
    args.update(overrides)
    return args


def _bad_table(block_id: int) -> torch.Tensor:
    table = _BAD.tables.clone()
    table[1, 4] = block_id  # logical block 4 of the 20-token sequence: in use
    return table


BAD_DECODE: dict[str, tuple[dict[str, Any], str]] = {
    "q 2-d": (dict(q=torch.randn(2, 64)), "must be 3-d"),
    "q int": (dict(q=torch.ones(2, 4, 16, dtype=torch.int32)), "q dtype"),
    "q float64": (dict(q=torch.randn(2, 4, 16, dtype=torch.float64)), "q dtype"),
    "q dtype != cache": (dict(q=torch.randn(2, 4, 16, dtype=torch.float16)), "dtype mismatch"),
    "cache shapes differ": (dict(k_cache=_BAD.k_cache[:5]), "k_cache and v_cache must both be"),
    "cache 3-d": (dict(k_cache=torch.zeros(11, 2, 64)), "k_cache and v_cache must both be"),
    "heads": (dict(q=torch.randn(2, 3, 16)), "multiple of kv heads"),
    "head_dim": (dict(q=torch.randn(2, 4, 8)), "head_dim mismatch"),
    "table batch": (dict(block_tables=torch.zeros(3, 5, dtype=torch.int32)), "block_tables must be"),
    "table float": (dict(block_tables=torch.zeros(2, 5)), "int32 or int64"),
    "seq_lens shape": (dict(seq_lens=torch.tensor([3])), "seq_lens must be"),
    "seq_len 0": (dict(seq_lens=torch.tensor([0, 5])), r"seq_lens\[0\] = 0"),
    "seq_len > capacity": (dict(seq_lens=torch.tensor([5, 1000])), r"seq_lens\[1\] = 1000 outside"),
    "block id too big": (dict(block_tables=_bad_table(999)), r"block_tables\[1, 4\] = 999"),
    "block id negative": (dict(block_tables=_bad_table(-3)), r"block_tables\[1, 4\] = -3"),
    "scale nan": (dict(scale=math.nan), "scale"),
    "q not a tensor": (dict(q=[[1.0]]), "q must be a torch.Tensor"),
    "zero query heads": (dict(q=torch.randn(2, 0, 16)), "empty dimension"),
    "seq_lens strings": (dict(seq_lens=["a", "b"]), "seq_lens must be an integer tensor"),
    "backend name": (dict(backend="cuda-graphs"), "backend"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_rejects_bad_input(backend: str, case: str) -> None:
    _require(backend)
    overrides, message = BAD_DECODE[case]
    args = _decode_args(**overrides)
    args.setdefault("backend", backend)
    with pytest.raises(InvalidArgument, match=message):
        paged_decode(**args)


def test_decode_rejects_non_contiguous_cache() -> None:
    args = _decode_args()
    k = args["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(InvalidArgument, match="contiguous"):
        paged_decode(**{**args, "k_cache": k})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(context_len=5), r"n \(8\) <= context_len \(5\)"),
        (dict(context_len=99), "capacity"),
        (dict(context_len=True), "context_len must be an int"),
        (dict(block_table=torch.zeros(2, 5, dtype=torch.int32)), "1-d"),
        (dict(block_table=torch.tensor([0, 1, 50, 2, 3])), r"block_table\[2\] = 50"),
        (dict(q=torch.randn(8, 4)), "3-d"),
    ],
)
def test_prefill_rejects_bad_input(overrides: dict, message: str) -> None:
    sc = make_scenario([20], num_kv_heads=2, block_size=4, head_dim=16, seed=1)
    args = dict(
        q=torch.randn(8, 4, 16),
        k_cache=sc.k_cache,
        v_cache=sc.v_cache,
        block_table=sc.tables[0],
        context_len=20,
    )
    args.update(overrides)
    with pytest.raises(InvalidArgument, match=message):
        paged_prefill(**args)


# --------------------------------------------------------------------------- backend selection


def test_env_selects_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args, **kwargs):
        raise AssertionError("kernel used although the torch backend was selected")

    monkeypatch.setattr(cpu_kernel, "decode", no_kernel)
    monkeypatch.setenv(attention.BACKEND_ENV, "torch")
    args = _decode_args()
    assert paged_decode(**args).out.shape == (2, 4, 16)


def test_failed_build_falls_back_to_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = native_build.once(cpu_kernel._build_kernel, cpu_kernel._unavailable)
    monkeypatch.setattr(cpu_kernel, "_get", fresh)  # forget this process's kernel; restored after
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path))  # and the disk cache
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    args = _decode_args()
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.logger.name):
        info = kernel_info()
        assert not info.is_available and "failed" in info.detail
        reference_out = paged_decode(**args, backend="torch").out
        torch.testing.assert_close(paged_decode(**args).out, reference_out)  # auto -> torch
        paged_decode(**args)
    assert len([r for r in caplog.records if "kernel unavailable" in r.message]) == 1
    with pytest.raises(FailedPrecondition, match="kernel unavailable"):
        paged_decode(**args, backend="kernel")


def test_portable_build_without_openmp_or_native_flags(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The flag sets are tried in order; the last one (plain C++17: SSE2 only, no OpenMP, software
    fp16 conversion) is what a compiler without OpenMP gets, and it must be just as correct."""
    _require("kernel")
    fresh = native_build.once(cpu_kernel._build_kernel, cpu_kernel._unavailable)
    monkeypatch.setattr(cpu_kernel, "_get", fresh)
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_CXX_OPTIONAL_FLAGS", (("-fno-such-flag-for-pagedkv",), ()))
    info = kernel_info()
    assert info.is_available and info.build_s > 0, info.detail
    assert "-fopenmp" not in info.detail and "-march" not in info.detail
    for dtype, seed in ((torch.float32, 1), (torch.float16, 2), (torch.bfloat16, 3)):
        sc = make_scenario([1, 8, 29, 40], num_kv_heads=2, block_size=8, head_dim=40, dtype=dtype, seed=seed)
        q = torch.randn(4, 8, 40).to(dtype)
        result = paged_decode(
            q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend="kernel"
        )
        check_decode(result, sc, q, 40**-0.5, 8)
