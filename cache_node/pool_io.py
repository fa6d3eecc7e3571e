"""Copies between the node's pool tensor and a caller's K/V, by block table.

    kv[layer, 0 or 1 (K or V), block, kv_head, offset_in_block, head_dim]

Token t of a sequence lives in block table[t // block_size] at offset t % block_size.
The caller (the engine) checked every shape and range and holds its lock.
"""

from __future__ import annotations

import torch


class PoolIO:
    def __init__(self, kv: torch.Tensor, block_size: int) -> None:
        self.kv, self.block_size = kv, block_size

    def write_range(self, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write tokens [start, start + t) of a sequence, every layer (k, v [num_layers, t, Hk, D]):
        one strided copy per block touched for K and for V (a scatter through index_put_ over a
        permuted view is ~5x slower on CPU)."""
        bs, kv, n = self.block_size, self.kv, k.shape[1]
        p = 0
        while p < n:
            pos = start + p
            block, lo = table[pos // bs], pos % bs
            c = min(bs - lo, n - p)
            kv[:, 0, block, :, lo : lo + c].copy_(k[:, p : p + c].transpose(1, 2))
            kv[:, 1, block, :, lo : lo + c].copy_(v[:, p : p + c].transpose(1, 2))
            p += c

    def write_layer(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """k, v [n, Hk, D] of one layer into `blocks` at `offsets` (index tensors [n])."""
        self.kv[layer, 0].transpose(1, 2).index_put_((blocks, offsets), k)
        self.kv[layer, 1].transpose(1, 2).index_put_((blocks, offsets), v)

    def read_range(
        self, table: list[int], start: int, stop: int, out_k: torch.Tensor, out_v: torch.Tensor
    ) -> None:
        """Tokens [start, stop) of every layer into out_k, out_v [num_layers, stop - start, Hk, D]:
        per block and layer, since contiguous destinations copy fastest."""
        bs, kv = self.block_size, self.kv
        pos = start
        while pos < stop:
            block, lo = table[pos // bs], pos % bs
            c = min(bs - lo, stop - pos)
            p = pos - start
            for layer in range(kv.shape[0]):
                out_k[layer, p : p + c].copy_(kv[layer, 0, block, :, lo : lo + c].transpose(0, 1))
                out_v[layer, p : p + c].copy_(kv[layer, 1, block, :, lo : lo + c].transpose(0, 1))
            pos += c
