"""TensorMover: batched block copies within and between tiers.

The staging path (pinned buffers, chunks, two buffers in turn) is what a CUDA node uses between
its device pool and its host pool; here it runs on CPU tensors (staged=True) so its indexing,
chunking and buffer reuse are checked on every machine. With a CUDA device the same moves also
run between a real device pool and a pinned host pool.
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import SPEC, fill, make_engine

from pagedkv.cache_node.kv_manager import DEVICE, HOST
from pagedkv.cache_node.tensor_mover import TensorMover

LAYERS, HEADS, BLOCK, DIM = 3, 2, 4, 8
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4  # float32


def _pools(device: str = "cpu", num_blocks: int = 12, num_host: int = 10) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    dev = torch.randn(LAYERS, 2, num_blocks, HEADS, BLOCK, DIM, generator=gen)
    host = torch.randn(LAYERS, 2, num_host, HEADS, BLOCK, DIM, generator=gen)
    if device != "cpu":
        dev, host = dev.to(device), host.pin_memory()
    return {DEVICE: dev, HOST: host}


def _expect(pools: dict[str, torch.Tensor], src_tier: str, src: list[int], dst_tier: str, dst: list[int]):
    want = {tier: pool.cpu().clone() for tier, pool in pools.items()}
    want[dst_tier][:, :, dst] = pools[src_tier].cpu()[:, :, src]
    return want


@pytest.mark.parametrize("chunk_blocks", [3, 8, 100])  # several chunks (both buffers, a short last one), one
def test_staged_moves_between_tiers_in_chunks(chunk_blocks: int) -> None:
    pools = _pools()
    mover = TensorMover(pools, chunk_bytes=chunk_blocks * BLOCK_BYTES, staged=True)
    assert mover.chunk_blocks == chunk_blocks
    moves = [
        (DEVICE, [7, 0, 11, 3, 5, 2, 9, 4], HOST, [9, 1, 0, 8, 2, 6, 3, 5]),  # swap out / offload
        (HOST, [3, 9, 6, 1, 0, 5, 8], DEVICE, [10, 1, 6, 8, 0, 4, 2]),  # swap in / revive
    ]
    staging_ptrs: set[int] = set()
    for src_tier, src, dst_tier, dst in moves:
        want = _expect(pools, src_tier, src, dst_tier, dst)
        before = mover.num_chunks
        mover.copy_blocks(src_tier, src, dst_tier, dst)
        assert mover.num_chunks - before == -(-len(src) // chunk_blocks)
        for tier in (DEVICE, HOST):
            assert torch.equal(pools[tier], want[tier]), (src_tier, dst_tier, tier)
        staging_ptrs |= {buf.data_ptr() for buf in mover._staging}
    assert len(staging_ptrs) == 2  # two buffers, allocated once and reused by every chunk and call


def test_copy_within_a_tier_is_one_gather_and_no_staging() -> None:
    pools = _pools()
    mover = TensorMover(pools, chunk_bytes=BLOCK_BYTES, staged=True)
    want = _expect(pools, DEVICE, [1, 2, 3], DEVICE, [7, 8, 0])
    mover.copy_blocks(DEVICE, [1, 2, 3], DEVICE, [7, 8, 0])  # copy-on-write of forked blocks
    assert torch.equal(pools[DEVICE], want[DEVICE]) and torch.equal(pools[HOST], want[HOST])
    assert mover.num_chunks == 0 and mover._staging == []
    mover.copy_blocks(HOST, [], DEVICE, [])
    assert mover.num_chunks == 0


def test_tiers_on_one_device_are_not_staged() -> None:
    assert not TensorMover(_pools()).is_staged


def test_engine_swap_and_host_tier_through_the_staged_path() -> None:
    """The manager's own moves (swap out, swap in, offload on eviction, revival) through a staged
    mover with one-block chunks: the bytes come back exact and the books stay consistent."""
    e = make_engine(num_blocks=8, num_host_blocks=6)
    mover = TensorMover({DEVICE: e.kv, HOST: e.host_kv}, chunk_bytes=SPEC.bytes_per_block, staged=True)
    e.manager.mover = mover
    tokens = list(range(10))
    fill(e, "a", tokens, seed=5)
    want = e.read_kv("a")
    assert e.swap_out("a") == 3
    assert e.swap_in("a") == 1  # the two full blocks stayed cached on the device
    got = e.read_kv("a")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    e.free("a")
    fill(e, "b", [50 + i for i in range(32)], seed=6)  # fills the device: a's cached blocks go to host
    e.free("b")
    assert e.stats()["evicted_to_host"] >= 2
    assert fill(e, "c", tokens, seed=5) == 8  # both of a's full blocks revived from the host
    got = e.read_kv("c", 0, 8)
    assert torch.equal(got[0], want[0][:, :8]) and torch.equal(got[1], want[1][:, :8])
    assert mover.num_chunks >= 4
    e.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pool_and_pinned_host_round_trip() -> None:
    pools = _pools("cuda")
    mover = TensorMover(pools, chunk_bytes=3 * BLOCK_BYTES)
    assert mover.is_staged
    for src_tier, src, dst_tier, dst in [
        (DEVICE, [7, 0, 11, 3, 5, 2, 9], HOST, [9, 1, 0, 8, 2, 6, 3]),
        (HOST, [3, 9, 6, 1, 0], DEVICE, [10, 1, 6, 8, 0]),
        (DEVICE, [1, 2], DEVICE, [4, 5]),
    ]:
        want = _expect(pools, src_tier, src, dst_tier, dst)
        mover.copy_blocks(src_tier, src, dst_tier, dst)
        torch.cuda.current_stream().synchronize()
        for tier in (DEVICE, HOST):
            assert torch.equal(pools[tier].cpu(), want[tier])
    assert all(buf.is_pinned() for buf in mover._staging)
