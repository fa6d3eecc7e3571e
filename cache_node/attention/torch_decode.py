"""The torch decode path: gather the blocks into [B, Hk, L, D] with one index_select, then
matmuls with the query heads of each KV head folded together. Runs anywhere torch does."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .checks import check_block_ids, first_blocks
from .gather import gather_float, workspace
from .output import AttentionOutput
from .spec import PLAIN, AttentionSpec


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    with_mass: bool,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    batch, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    device = q.device
    tables = tables.to(device=device, dtype=torch.int64)
    lens = lens.to(device=device, dtype=torch.int64)
    num_logical = -(-int(lens.max()) // block_size)  # only as many blocks as the longest sequence uses
    seq_blocks = (lens + block_size - 1) // block_size
    if spec.masks:
        # A window or chunks: each sequence gathers its own band of blocks from the first one its
        # query sees (logical[b] = firsts[b] + 0 .. span-1), so the work follows the window.
        firsts = first_blocks(spec, lens, block_size)
        span = int((seq_blocks - firsts).max())
        logical = firsts.unsqueeze(1) + torch.arange(span, device=device)
        logical = logical.clamp_(max=tables.shape[1] - 1)  # past a sequence's end: unused anyway
        table = torch.gather(tables, 1, logical)
        used = firsts.unsqueeze(1) + torch.arange(span, device=device) < seq_blocks.unsqueeze(1)
    else:
        span = num_logical
        table = tables[:, :num_logical]
        used = torch.arange(num_logical, device=device) < seq_blocks.unsqueeze(1)
    check_block_ids(table, used, num_blocks, "block_tables")
    ids = torch.where(used, table, 0)  # padding reads block 0; masked out of the softmax below
    heads = torch.arange(num_kv_heads, device=device)
    rows = (ids.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)).reshape(-1)  # [B, Hk, blocks]
    length = span * block_size
    taken: list[Tensor] = []
    try:
        k = gather_float(k_cache, rows, taken).view(batch * num_kv_heads, length, head_dim)
        v = gather_float(v_cache, rows, taken).view(batch * num_kv_heads, length, head_dim)
        # Fold the G query heads of each KV head into the matmul's M dimension: K/V are read once
        # per group. bmm on 3-d views: 4-d matmul takes a slower path for M = 1 (~2x on p @ v).
        qf = q.float().view(batch * num_kv_heads, group, head_dim)
        scores = torch.bmm(qf, k.transpose(1, 2)).mul_(scale).view(batch, num_kv_heads, group, length)
        spec.cap_(scores)
        slots = torch.arange(length, device=device)
        if spec.masks:  # [B, L]: past the end, before the window, in other chunks
            key_pos = (firsts * block_size).unsqueeze(1) + slots
            beyond = spec.hidden((lens - 1).unsqueeze(1), key_pos)
        else:
            beyond = slots >= lens.unsqueeze(1)
        scores.masked_fill_(beyond.view(batch, 1, 1, length), -math.inf)
        # Slots past a sequence's end hold whatever the pool had (maybe NaN) and 0 * NaN = NaN:
        # zero those V rows (few: the tails and the padding blocks).
        tail_b, tail_pos = beyond.nonzero(as_tuple=True)
        v.view(batch, num_kv_heads, length, head_dim)[tail_b, :, tail_pos] = 0.0
        lse = torch.logsumexp(scores, dim=-1)
        sinks = spec.sinks_tensor(device)
        if sinks is not None:  # one more denominator term per head (attention_spec.py)
            lse = torch.logaddexp(lse, sinks.view(1, num_kv_heads, group))
        probs = scores.sub_(lse.unsqueeze(-1)).exp_()
        out = torch.bmm(probs.view(batch * num_kv_heads, group, length), v)
    finally:
        workspace.give(taken)
    out = out.view(batch, num_q_heads, head_dim)
    mass = None
    if with_mass:
        mass = torch.zeros(batch, tables.shape[1], dtype=torch.float32, device=device)
        per_block = probs.sum(dim=(1, 2)).view(batch, span, block_size).sum(-1)
        if spec.masks:  # hidden slots have probability 0, so the clamped indices add nothing
            mass.scatter_add_(1, logical, per_block)
        else:
            mass[:, :num_logical] = per_block
    return AttentionOutput(out.to(q.dtype), lse.view(batch, num_q_heads), mass)
