"""Block mass under normalizers computed elsewhere: for a sequence sharded over nodes, a
node's own softmax covers only its keys, so the mass it reports with an attend is a share
of a partial sum. Given the merged log-sum-exp of each query head (the client merges the
nodes' results), this node's blocks get their share of the whole softmax, exactly what one
node holding every key would have computed:

    mass[block] = sum over queries i, heads h, keys t in block of exp(score(i, h, t) - lse[i, h])

A token budget across nodes ranks blocks by it (client/budget.py), crediting many steps'
queries at once: each query names how many of this node's tokens it saw (blocks only grow
at the end between a query and its credit). Scores as the attend's (scale, soft-cap); masks
by position (windows, chunks) are refused by the caller."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .gather import gather_float, workspace
from .spec import AttentionSpec

# Scores are materialized a chunk of queries at a time; this bounds the chunk (floats).
_SCORE_BUDGET = 1 << 24


def block_mass_given(
    q: Tensor,
    lse: Tensor,
    visible: Tensor,
    k_cache: Tensor,
    table: Tensor,
    context_len: int,
    spec: AttentionSpec,
) -> Tensor:
    """q [n, Hq, D], lse [n, Hq] (float32), visible [n] (query i sees keys 0 .. visible[i] - 1,
    each in 1 .. context_len); table [>= ceil(context_len / block_size)] block ids of a
    sequence of context_len tokens. Returns float64 [ceil(context_len / block_size)].
    Trusted input (the engine checked it)."""
    num_queries, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    device = q.device
    num_logical = -(-context_len // block_size)
    mass = torch.zeros(num_logical * block_size, dtype=torch.float64, device=device)
    if num_logical == 0 or num_queries == 0:
        return mass.view(num_logical, block_size).sum(-1)
    scale = spec.resolve_scale(None, head_dim)
    ids = table[:num_logical].to(device=device, dtype=torch.int64)
    heads = torch.arange(num_kv_heads, device=device)
    rows = (ids.unsqueeze(0) * num_kv_heads + heads.unsqueeze(1)).reshape(-1)  # [Hk, blocks]
    qf = q.float().view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk, G, n, D]
    norm = lse.float().view(num_queries, num_kv_heads, group).permute(1, 2, 0)  # [Hk, G, n]
    seen = visible.to(device=device, dtype=torch.int64)
    chunk = max(1, _SCORE_BUDGET // (num_q_heads * context_len))
    taken: list[Tensor] = []
    try:
        k = gather_float(k_cache, rows, taken).view(num_kv_heads, -1, head_dim)
        for begin in range(0, num_queries, chunk):
            stop = min(num_queries, begin + chunk)
            hi = int(seen[begin:stop].max())
            rows_q = group * (stop - begin)
            q_chunk = qf[:, :, begin:stop].reshape(num_kv_heads, rows_q, head_dim)
            scores = torch.bmm(q_chunk, k[:, :hi].transpose(1, 2)).mul_(scale)
            scores = spec.cap_(scores.view(num_kv_heads, group, stop - begin, hi))
            if int(seen[begin:stop].min()) < hi:  # (queries that saw every key need no mask)
                hidden = torch.arange(hi, device=device).unsqueeze(0) >= seen[begin:stop].unsqueeze(1)
                scores.masked_fill_(hidden, -math.inf)
            probs = scores.sub_(norm[:, :, begin:stop].unsqueeze(-1)).exp_()
            mass[:hi] += probs.sum(dim=(0, 1, 2)).double()
    finally:
        workspace.give(taken)
    return mass.view(num_logical, block_size).sum(-1)
