"""Paged decode attention against the float64 reference, for both CPU backends (C++ kernel and
torch): GQA, block sizes, half types, head dims, split partitions, `out=` buffers, threads."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from attention_reference import (
    BACKENDS,
    LSE_TOL,
    MASS_TOL,
    check_decode,
    make_scenario,
    require_backend,
)

from pagedkv.cache_node import attention
from pagedkv.cache_node.attention import (
    cpu_kernel,
    gather,
    kernel_info,
    paged_decode,
)
from pagedkv.protos.errors import InvalidArgument


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    kernel_info()  # build once up front so the first test's time is not the compile


# --------------------------------------------------------------------------- decode


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_decode_matches_reference(backend: str, group: int, block_size: int) -> None:
    require_backend(backend)
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
    require_backend(backend)
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
    require_backend(backend)
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
    require_backend(backend)
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
    require_backend("kernel")
    lens = [9, 70, 33]
    sc = make_scenario(lens, num_kv_heads=2, block_size=4, head_dim=32, fork_of_first=1, seed=5)
    q = torch.randn(len(lens), 4, 32)
    result = cpu_kernel.decode(
        q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, 32**-0.5, True, num_partitions=num_partitions
    )
    check_decode(result, sc, q, 32**-0.5, 4)


def test_kernel_and_torch_agree_on_long_sequence() -> None:
    require_backend("kernel")
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
    require_backend(backend)
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
    require_backend(backend)
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
