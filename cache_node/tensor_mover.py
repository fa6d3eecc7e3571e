"""TensorMover: the bytes of the KV manager's block moves (copy-on-write, swap, the host tier).

The pools are `kv[layer, K/V, block, kv_head, slot, dim]`, so a block is one index along dim 2
and a move of n blocks is one gather and one scatter, never a loop over blocks:

    same tier (copy-on-write)   pool.index_copy_(2, dst, pool.index_select(2, src))
    between tiers               chunks of at most chunk_bytes through two reused staging buffers:

        host -> device   index_select into pinned staging ─▶ async H2D ─▶ index_copy_ on the device
        device -> host   index_select on the device ─▶ async D2H into pinned staging ─▶ index_copy_

    With two buffers one chunk's transfer overlaps the next chunk's gather (or the previous one's
    scatter), and a long sequence's swap needs no staging the size of the sequence.

On CUDA the transfers run on one stream of their own. It first waits for the work already queued
on the compute stream (a block is read only after its last write), and the compute stream waits
for it before its next kernel (attention never reads a block that has not landed), so a swap-in
does not block the CPU. A copy to the host returns once the bytes are in the host pool (the
manager may reuse the device blocks at once). Pinned staging exists only where CUDA does; on a
CPU node the tiers share one device and every move is the same-tier pair.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from .kv_manager import HOST


class TensorMover:
    """Implements kv_manager.BlockMover over the engine's pool tensors, one per tier.

    chunk_bytes bounds each staging buffer (two are kept, allocated on first use).
    staged=None stages exactly when the tiers live on different devices; tests pass True to run
    the staging path with CPU tensors. Not thread-safe: the engine's lock serialises calls."""

    def __init__(
        self, pools: dict[str, Tensor], chunk_bytes: int = 128 << 20, staged: bool | None = None
    ) -> None:
        self.pools = pools
        devices = {p.device for p in pools.values()}
        self.is_staged = len(devices) > 1 if staged is None else staged
        cuda = [d for d in devices if d.type == "cuda"]
        self._device = cuda[0] if cuda else None
        self._stream = torch.cuda.Stream(self._device) if self._device is not None else None
        pool = next(iter(pools.values()))
        self._block_numel = math.prod(pool.shape[:2]) * math.prod(pool.shape[3:])
        self._dtype = pool.dtype
        self.chunk_blocks = max(1, chunk_bytes // max(1, self._block_numel * pool.element_size()))
        self._staging: list[Tensor] = []
        self._in_flight: list[torch.cuda.Event | None] = [None, None]
        self.num_chunks = 0  # chunks moved between tiers since creation (batching is observable)

    def copy_blocks(self, src_tier: str, src: list[int], dst_tier: str, dst: list[int]) -> None:
        """Copy whole blocks (every layer, K and V) src[i] -> dst[i], pairwise; src and dst blocks
        do not overlap. Returns when a later call or kernel on the compute stream sees them."""
        if not src:
            return
        assert len(src) == len(dst), (len(src), len(dst))
        src_pool, dst_pool = self.pools[src_tier], self.pools[dst_tier]
        if src_tier == dst_tier or not self.is_staged:
            src_idx = torch.tensor(src, dtype=torch.long).to(src_pool.device)
            dst_idx = torch.tensor(dst, dtype=torch.long).to(dst_pool.device)
            dst_pool.index_copy_(2, dst_idx, src_pool.index_select(2, src_idx).to(dst_pool.device))
        elif dst_tier == HOST:
            self._to_host(src_pool, src, dst_pool, dst)
        else:
            self._to_device(src_pool, src, dst_pool, dst)

    # -- between tiers ----------------------------------------------------------

    @contextlib.contextmanager
    def _on_transfer_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._device))
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)

    def _stage(self, i: int, num_blocks: int, like: Tensor) -> Tensor:
        """Staging buffer i viewed as [L, 2, num_blocks, ...], once its last transfer is done."""
        event = self._in_flight[i]
        if event is not None:
            event.synchronize()
            self._in_flight[i] = None
        if not self._staging:
            numel = self.chunk_blocks * self._block_numel
            pin = self._device is not None
            self._staging = [torch.empty(numel, dtype=self._dtype, pin_memory=pin) for _ in range(2)]
        shape = (*like.shape[:2], num_blocks, *like.shape[3:])
        return self._staging[i][: num_blocks * self._block_numel].view(shape)

    def _mark(self, i: int) -> None:
        if self._stream is not None:
            event = torch.cuda.Event()
            event.record(self._stream)
            self._in_flight[i] = event

    def _chunks(self, n: int) -> Iterator[tuple[int, int, int]]:
        for i, start in enumerate(range(0, n, self.chunk_blocks)):
            self.num_chunks += 1
            yield i % 2, start, min(n, start + self.chunk_blocks)

    def _to_device(self, host_pool: Tensor, src: list[int], dev_pool: Tensor, dst: list[int]) -> None:
        src_idx = torch.tensor(src, dtype=torch.long)
        dst_idx = torch.tensor(dst, dtype=torch.long)
        with self._on_transfer_stream():
            dst_idx = dst_idx.to(dev_pool.device)
            for i, a, b in self._chunks(len(src)):
                stage = self._stage(i, b - a, host_pool)
                torch.index_select(host_pool, 2, src_idx[a:b], out=stage)
                dev_pool.index_copy_(2, dst_idx[a:b], stage.to(dev_pool.device, non_blocking=True))
                self._mark(i)  # staging i may be refilled once this transfer has read it

    def _to_host(self, dev_pool: Tensor, src: list[int], host_pool: Tensor, dst: list[int]) -> None:
        dst_idx = torch.tensor(dst, dtype=torch.long)
        pending: tuple[int, int, int] | None = None
        with self._on_transfer_stream():
            src_idx = torch.tensor(src, dtype=torch.long).to(dev_pool.device)
            for i, a, b in self._chunks(len(src)):
                stage = self._stage(i, b - a, dev_pool)
                stage.copy_(dev_pool.index_select(2, src_idx[a:b]), non_blocking=True)
                self._mark(i)
                if pending is not None:  # scatter the previous chunk while this one transfers
                    self._scatter_to_host(host_pool, dst_idx, pending)
                pending = (i, a, b)
            if pending is not None:
                self._scatter_to_host(host_pool, dst_idx, pending)

    def _scatter_to_host(self, host_pool: Tensor, dst_idx: Tensor, chunk: tuple[int, int, int]) -> None:
        i, a, b = chunk
        stage = self._stage(i, b - a, host_pool)  # waits for the chunk's D2H
        host_pool.index_copy_(2, dst_idx[a:b], stage)
