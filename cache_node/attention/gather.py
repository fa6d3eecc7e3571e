"""The torch path's block gather into pooled buffers (decode and prefill on CPU)."""

from __future__ import annotations

import threading

import torch
from torch import Tensor


class _Workspace:
    """Pooled gather buffers for the torch path on CPU.

    A fresh 100+ MB tensor per call costs more than the gather itself (first-touch page faults: at
    B=8, Hk=32, L=512 index_select takes 29 ms into a new tensor, 5 ms into a reused one), so buffers
    are reused. The lock guards only the free list; a buffer belongs to one call at a time, so
    concurrent calls stay safe. Holds at most `max_pooled` buffers and `max_bytes` (2 GiB) in all;
    `release_workspace()` drops them.
    """

    def __init__(self, max_pooled: int = 4, max_bytes: int = 2 << 30) -> None:
        self._free: list[Tensor] = []
        self._lock = threading.Lock()
        self._max_pooled = max_pooled
        self._max_bytes = max_bytes

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-d buffer of at least numel elements, owned by the caller until given back."""
        if device.type == "cpu":  # (the CUDA caching allocator already reuses memory)
            with self._lock:  # best fit: the free list is largest first
                for i in reversed(range(len(self._free))):
                    if self._free[i].dtype == dtype and self._free[i].numel() >= numel:
                        return self._free.pop(i)
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, bufs: list[Tensor]) -> None:
        with self._lock:
            self._free.extend(buf for buf in bufs if buf.device.type == "cpu")
            self._free.sort(key=lambda buf: buf.nbytes, reverse=True)  # prefer keeping the largest
            kept: list[Tensor] = []
            total = 0
            for buf in self._free:
                if len(kept) < self._max_pooled and total + buf.nbytes <= self._max_bytes:
                    kept.append(buf)
                    total += buf.nbytes
            self._free = kept

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


workspace = _Workspace()


def release_workspace() -> None:
    """Drop the pooled buffers of the torch path (memory pressure); the next call reallocates."""
    workspace.clear()


def gather_float(cache: Tensor, rows: Tensor, taken: list[Tensor]) -> Tensor:
    """The (block, head) slabs of a [num_blocks, Hk, bs, D] cache listed in rows, as float32
    [len(rows), bs * D], in pooled buffers that are appended to `taken` for the caller to give back."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    flat = cache.view(num_blocks * num_kv_heads, block_size * head_dim)
    numel = rows.numel() * block_size * head_dim
    taken.append(workspace.take(numel, cache.dtype, cache.device))
    gathered = torch.index_select(flat, 0, rows, out=taken[-1][:numel].view(rows.numel(), -1))
    if cache.dtype == torch.float32:
        return gathered
    taken.append(workspace.take(numel, torch.float32, cache.device))
    return taken[-1][:numel].view(rows.numel(), -1).copy_(gathered)
