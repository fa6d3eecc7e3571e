"""Triton paged attention for the node's CUDA pool: decode and prefill as one kernel.

Decode is prefill with one query per sequence, so one kernel serves both. A program owns one
(query tile, sequence, KV head, key split) and walks the sequence's block table:

    rows of a program   | q[t0] head g0 .. g_{G-1} | q[t0+1] head g0 .. | ...   (BLOCK_Q tokens x G)
    keys of a program   | split s: positions [s * tokens_per_split, ...) cut at the causal end

All G query heads of a KV head sit in one tile (M = BLOCK_Q * G_PAD rows), so each K/V tile is
read once per group (GQA). Long decodes split the keys over several programs (split-K, the
flash-decoding scheme); each split writes its partial out and LSE and `merge_splits` combines
them by LSE. Token t of sequence b is at block `tables[b, t // block_size]`, slot
`t % block_size`; slots past a sequence's end are never loaded, so whatever the pool holds
there (even NaN) cannot leak into a result.

The per-block attention mass (score eviction) needs the final LSE, so it is a second pass
(`block_mass`) that recomputes QK for the key tiles and sums exp(s - lse) over the rows; it runs
only when asked.

The kernels live in triton_kernels.py. A score is made in one place, `_scores` (used by both
passes): the scale, and the modifications some model families need (`ScoreMods`: a sliding
window, chunked attention, a logit soft-cap), each a compile-time switch, so the plain kernel
carries none of them. Sinks (a per-head logit in
the softmax denominator) are one more term added at the end of `attend_fwd`. paged_decode /
paged_prefill build them from an AttentionSpec (spec.py: the semantics all backends share).

Without CUDA (or with TRITON_INTERPRET=1) the kernels are built for Triton's interpreter and run
on CPU tensors: slow, exact, used by the tests. The callers (decode.py, prefill.py) validate
everything; these functions assume well-formed input.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from . import triton_kernels as kernels
from .triton_kernels import IS_AVAILABLE, IS_INTERPRETED, triton

__all__ = ["IS_AVAILABLE", "IS_INTERPRETED", "NO_MODS", "ScoreMods", "attend", "decode", "prefill", "triton"]

_LOG2E = 1.0 / math.log(2.0)


@dataclass(frozen=True, eq=False)
class ScoreMods:
    """What some model families change in the scores (all off by default), applied in `_scores`
    and the end of `attend_fwd` only. The scale itself is `attend`'s `scale`."""

    window: int = 0  # only the last `window` positions are visible, the query's own included
    chunk: int = 0  # only keys in the query's own chunk of `chunk` positions (chunked attention)
    softcap: float = 0.0  # scores become softcap * tanh(score / softcap)
    # [Hq] float32 logits, one more term of each head's softmax denominator with no value (sinks);
    # counted once, in the LSE, so a merge over parts must not count them again.
    sinks: Tensor | None = None


NO_MODS = ScoreMods()


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _tiles(group: int, head_dim: int, max_q_len: int) -> tuple[int, int, int, int]:
    """(GROUP_PAD, BLOCK_Q, BLOCK_N, DIM_PAD): tl.dot needs every side >= 16; a decode tile is
    the group alone (padded to 16 rows), a prefill tile 64 rows of (token, head) pairs."""
    group_pad = _pow2(group)
    dim_pad = _pow2(head_dim, 16)
    rows = 16 if max_q_len == 1 else 64
    block_q = max(1, rows // group_pad)
    block_n = 64 if dim_pad <= 128 else 32
    return group_pad, block_q, block_n, dim_pad


@functools.cache
def _num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def num_splits_for(num_sms: int, num_programs: int, max_ctx: int) -> int:
    """Split the keys only when (sequence, KV head) programs are too few to keep the device's
    memory busy: about four programs per SM, each split at least 256 keys, at most 64 splits
    (a guess to be tuned on a device: bench.gpu)."""
    if num_programs >= 4 * num_sms:
        return 1
    return max(1, min(-(-4 * num_sms // num_programs), max_ctx // 256, 64))


def default_num_splits(device: torch.device, num_programs: int, max_ctx: int) -> int:
    """num_splits_for this device; the interpreter (CPU tensors) never splits."""
    if device.type != "cuda":
        return 1
    return num_splits_for(_num_sms(device.index or 0), num_programs, max_ctx)


def attend(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    q_start: Tensor,
    q_len: Tensor,
    ctx_len: Tensor,
    *,
    max_q_len: int,
    max_ctx: int,
    scale: float,
    with_mass: bool,
    num_splits: int | None = None,
    mods: ScoreMods = NO_MODS,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Causal paged attention for a batch of sequences.

    q [N, Hq, D] (sequence b owns rows q_start[b] .. q_start[b] + q_len[b], its last q_len[b]
    tokens of ctx_len[b]); tables [B, max_blocks] int32; q_start, q_len, ctx_len [B] int32, all on
    q's device. Returns out [N, Hq, D] in q's dtype, lse [N, Hq] float32 and, with with_mass,
    per-key mass [B, W] float32 (W >= the longest ctx rounded up to whole blocks; summed over
    heads and queries). num_splits None picks from the device (only rows with q_len 1 gain).
    mods: sliding window, chunks, soft-cap and sinks (ScoreMods).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    batch = tables.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad, block_q, block_n, dim_pad = _tiles(group, head_dim, max_q_len)
    q_tiles = -(-max_q_len // block_q)
    if num_splits is None:
        num_splits = 1 if max_q_len > 1 else default_num_splits(q.device, batch * num_kv_heads, max_ctx)
    num_splits = max(1, min(num_splits, -(-max_ctx // block_n)))
    tokens_per_split = -(-max_ctx // num_splits)
    tokens_per_split = -(-tokens_per_split // block_n) * block_n
    qk_scale = scale * _LOG2E
    # The interpreter's tl.dot gives wrong bf16 results (triton 3.9): it multiplies in float32.
    upcast = IS_INTERPRETED and q.dtype == torch.bfloat16
    precision = "ieee" if q.dtype == torch.float32 or upcast else "tf32"
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
    if num_splits == 1:
        part_out, part_lse = out.unsqueeze(2), lse.unsqueeze(2)
    else:
        part_out = out.new_empty(num_tokens, num_q_heads, num_splits, head_dim, dtype=torch.float32)
        part_lse = lse.new_empty(num_tokens, num_q_heads, num_splits)
    common = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        DOT_PRECISION=precision,
        UPCAST=upcast,
        HAS_SOFTCAP=mods.softcap > 0,
        HAS_WINDOW=mods.window > 0,
        HAS_CHUNK=mods.chunk > 0,
    )
    score_args = (mods.softcap * _LOG2E, mods.window, mods.chunk)
    num_warps = 8 if block_q * group_pad * dim_pad >= 64 * 256 else 4  # a 64 x 256 float32 accumulator
    sinks = lse if mods.sinks is None else mods.sinks.to(device=q.device, dtype=torch.float32).contiguous()
    kernels.attend_fwd[(q_tiles, batch, num_kv_heads * num_splits)](
        q,
        k_cache,
        v_cache,
        tables,
        q_start,
        q_len,
        ctx_len,
        part_out,
        part_lse,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        part_lse.stride(2),
        qk_scale,
        num_splits,
        tokens_per_split,
        sinks,
        *score_args,
        **common,
        HAS_SINKS=mods.sinks is not None,
        num_warps=num_warps,
    )
    if num_splits > 1:
        kernels.merge_splits[(num_tokens, num_q_heads)](
            part_out,
            part_lse,
            out,
            lse,
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
            part_lse.stride(2),
            out.stride(0),
            out.stride(1),
            lse.stride(0),
            lse.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            SPLITS_PAD=_pow2(num_splits),
            num_warps=1,
        )
    if not with_mass:
        return out, lse, None
    key_tiles = -(-max_ctx // block_n)
    width = max(key_tiles * block_n, -(-max_ctx // block_size) * block_size)
    mass = torch.zeros(batch, num_kv_heads, width, dtype=torch.float32, device=q.device)
    kernels.block_mass[(key_tiles, batch, num_kv_heads)](
        q,
        k_cache,
        tables,
        q_start,
        q_len,
        ctx_len,
        lse,
        mass,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        tables.stride(0),
        lse.stride(0),
        lse.stride(1),
        mass.stride(0),
        mass.stride(1),
        qk_scale,
        *score_args,
        **common,
        num_warps=num_warps,
    )
    return out, lse, mass.sum(dim=1)


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    max_len: int,
    scale: float,
    with_mass: bool,
    num_splits: int | None = None,
    mods: ScoreMods = NO_MODS,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """paged_decode's contract (decode.py checked the input): q [B, Hq, D], tables [B, max_blocks]
    int32, lens [B] int32 on q's device. Returns out, lse and the mass per logical block [B, max_blocks]."""
    rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    out, lse, key_mass = attend(
        q,
        k_cache,
        v_cache,
        tables.contiguous(),
        rows,
        torch.ones_like(rows),
        lens.contiguous(),
        max_q_len=1,
        max_ctx=max_len,
        scale=scale,
        with_mass=with_mass,
        num_splits=num_splits,
        mods=mods,
    )
    if key_mass is None:
        return out, lse, None
    return out, lse, _per_block(key_mass, k_cache.shape[2], max_len, tables.shape[1])


def prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    ids: Tensor,
    table_len: int,
    context_len: int,
    scale: float,
    with_mass: bool,
    mods: ScoreMods = NO_MODS,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """paged_prefill's contract as a batch of one: ids are the sequence's ceil(context_len /
    block_size) checked physical blocks; the mass is per entry of a table of table_len blocks."""
    num_queries = q.shape[0]
    zero = torch.zeros(1, dtype=torch.int32, device=q.device)
    out, lse, key_mass = attend(
        q,
        k_cache,
        v_cache,
        ids.to(torch.int32).unsqueeze(0).contiguous(),
        zero,
        zero + num_queries,
        zero + context_len,
        max_q_len=num_queries,
        max_ctx=context_len,
        scale=scale,
        with_mass=with_mass,
        mods=mods,
    )
    if key_mass is None:
        return out, lse, None
    return out, lse, _per_block(key_mass, k_cache.shape[2], context_len, table_len)[0]


def _per_block(key_mass: Tensor, block_size: int, max_ctx: int, width: int) -> Tensor:
    """attend()'s per-key mass [B, W] summed per logical block: [B, width], zero past the
    ceil(max_ctx / block_size) blocks the longest sequence spans."""
    rows, num_logical = key_mass.shape[0], -(-max_ctx // block_size)
    mass = torch.zeros(rows, width, dtype=torch.float32, device=key_mass.device)
    mass[:, :num_logical] = key_mass[:, : num_logical * block_size].view(rows, num_logical, -1).sum(-1)
    return mass
