"""Triton paged attention for the node's CUDA pool: decode and prefill as one kernel.

Decode is prefill with one query per sequence, so one kernel serves both. A program owns one
(query tile, sequence, KV head, key split) and walks the sequence's block table:

    rows of a program   | q[t0] head g0 .. g_{G-1} | q[t0+1] head g0 .. | ...   (BLOCK_Q tokens x G)
    keys of a program   | split s: positions [s * tokens_per_split, ...) cut at the causal end

All G query heads of a KV head sit in one tile (M = BLOCK_Q * G_PAD rows), so each K/V tile is
read once per group (GQA). Long decodes split the keys over several programs (split-K, the
flash-decoding scheme); each split writes its partial out and LSE and `_merge_splits` combines
them by LSE. Token t of sequence b is at block `tables[b, t // block_size]`, slot
`t % block_size`; slots past a sequence's end are never loaded, so whatever the pool holds
there (even NaN) cannot leak into a result.

The per-block attention mass (score eviction) needs the final LSE, so it is a second pass
(`_block_mass`) that recomputes QK for the key tiles and sums exp(s - lse) over the rows; it runs
only when asked.

A score is made in one place, `_scores` (used by both passes): the scale, and the modifications
some model families need (`ScoreMods`: a sliding window, chunked attention, a logit soft-cap),
each a compile-time switch, so the plain kernel carries none of them. Sinks (a per-head logit in
the softmax denominator) are one more term added at the end of `_attend_fwd`. paged_decode /
paged_prefill build them from an AttentionSpec (attention_spec.py: the semantics all backends share).

Without CUDA (or with TRITON_INTERPRET=1) the kernels are built for Triton's interpreter and run
on CPU tensors: slow, exact, used by the tests. The caller (attention.py) validates everything;
these functions assume well-formed input.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

# Triton's interpreter is a process-wide mode read when triton (and its standard library of
# @jit functions) is imported, so it is chosen once here: compiled when a CUDA device is
# present, interpreted otherwise (a CPU node keeps its C++ kernel; the tests use this mode).
_NO_CUDA = not torch.cuda.is_available()
_IMPORTED_BEFORE = "triton" in sys.modules
if _NO_CUDA and not _IMPORTED_BEFORE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import triton
    import triton.language as tl
except ImportError:  # the node still runs: attention.py falls back to the torch path
    triton = None
    tl = None


def _interpret_imported_triton() -> bool:
    """triton was imported before this module, compiled (transformers and torch import it), in a
    process with no CUDA, where compiled kernels cannot run at all: make its standard library's
    @jit functions interpreted ones and turn the interpreter on, so the kernels below run.
    Returns whether that worked (it leans on triton internals; without it the kernels are off)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction

        for name, module in list(sys.modules.items()):
            if name.startswith("triton.language") and module is not None:
                for attr, value in list(vars(module).items()):
                    if isinstance(value, JITFunction):
                        setattr(module, attr, InterpretedFunction(value.fn))
        triton.knobs.runtime.interpret = True
    except Exception:  # noqa: BLE001 - any failure leaves triton as it was found, kernels off
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


IS_AVAILABLE = triton is not None
IS_INTERPRETED = IS_AVAILABLE and os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on")
if IS_AVAILABLE and _NO_CUDA and _IMPORTED_BEFORE and not IS_INTERPRETED:
    IS_INTERPRETED = _interpret_imported_triton()
_LOG2E = 1.0 / math.log(2.0)


if triton is not None:

    @triton.jit
    def _scores(
        q,
        k,
        pos,
        qpos,
        k_ok,
        qk_scale,
        softcap2,
        window,
        chunk,
        DOT_PRECISION: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr,
    ):
        # The one place a score is made: [rows, keys] in log2 units, -inf where not visible.
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if HAS_SOFTCAP:  # cap * tanh(s / cap), tanh through exp2 (softcap2 = cap * log2 e)
            s = softcap2 * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / softcap2)) + 1.0))
        visible = k_ok[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_WINDOW:  # the last `window` positions, the query's own included
            visible = visible & (pos[None, :] > qpos[:, None] - window)
        if HAS_CHUNK:  # only keys of the query's own chunk
            visible = visible & (pos[None, :] // chunk == qpos[:, None] // chunk)
        return tl.where(visible, s, float("-inf"))

    @triton.jit
    def _attend_fwd(
        Q,
        K,
        V,
        Tables,
        QStart,
        QLen,
        CtxLen,
        Out,
        Lse,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_tb,
        stride_ot,
        stride_oh,
        stride_os,
        stride_lt,
        stride_lh,
        stride_ls,
        qk_scale,
        num_splits,
        tokens_per_split,
        Sinks,
        softcap2,
        window,
        chunk,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        q_tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2) // num_splits
        split = tl.program_id(2) % num_splits
        q_len = tl.load(QLen + seq)
        ctx = tl.load(CtxLen + seq)
        q_first = tl.load(QStart + seq)

        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        tok = q_tile * BLOCK_Q + rows // GROUP_PAD
        g = rows % GROUP_PAD
        row_ok = (tok < q_len) & (g < GROUP)
        head = kv_head * GROUP + g
        qpos = ctx - q_len + tok  # the query's position in its sequence
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        q_rows = (q_first + tok).to(tl.int64)
        q = tl.load(
            Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # Keys [lo, hi): this split's range, cut at the causal end of the tile's last query
        # (a tile past q_len gets an empty range).
        tile_end = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len)
        lo = split * tokens_per_split
        hi = tl.minimum(ctx - q_len + tile_end, lo + tokens_per_split)
        first_qpos = ctx - q_len + q_tile * BLOCK_Q
        if HAS_WINDOW:  # skip the keys before the window of the tile's first query
            lo = tl.maximum(lo, first_qpos - window + 1)
        if HAS_CHUNK:
            lo = tl.maximum(lo, (first_qpos // chunk) * chunk)

        m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            k_ok = pos < hi
            phys = tl.load(Tables + seq * stride_tb + pos // BLOCK_SIZE, mask=k_ok, other=0)
            slot = phys.to(tl.int64) * stride_kb + kv_head * stride_kh + (pos % BLOCK_SIZE) * stride_ks
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            s = _scores(
                q,
                k,
                pos,
                qpos,
                k_ok,
                qk_scale,
                softcap2,
                window,
                chunk,
                DOT_PRECISION,
                HAS_SOFTCAP,
                HAS_WINDOW,
                HAS_CHUNK,
            )
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with no visible key yet keeps m = -inf; subtract 0 there, not -inf (NaN).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if HAS_SINKS:  # a per-head logit in the denominator with no value: once, in split 0
            sink = tl.load(Sinks + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
            sink = tl.where(split == 0, sink, float("-inf"))
            m_new = tl.maximum(m_i, sink)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.exp2(sink - m_safe)
            acc = acc * alpha[:, None]
            m_i = m_new

        empty = l_i == 0.0  # an empty split: out 0, lse -inf, so the merge gives it no weight
        l_safe = tl.where(empty, 1.0, l_i)
        out = acc / l_safe[:, None]
        lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)
        o_ptr = Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
        tl.store(o_ptr, out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(Lse + q_rows * stride_lt + head * stride_lh + split * stride_ls, lse, mask=row_ok)

    @triton.jit
    def _merge_splits(
        PartOut,
        PartLse,
        Out,
        Lse,
        stride_pt,
        stride_ph,
        stride_ps,
        stride_plt,
        stride_plh,
        stride_pls,
        stride_ot,
        stride_oh,
        stride_lt,
        stride_lh,
        num_splits,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        s_ok = s < num_splits
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        lse_ptr = PartLse + t * stride_plt + h * stride_plh + s * stride_pls
        lse = tl.load(lse_ptr, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse - m_safe)
        total = tl.sum(w, 0)
        part = tl.load(
            PartOut + t * stride_pt + h * stride_ph + s[:, None] * stride_ps + d[None, :],
            mask=s_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        total_safe = tl.where(total == 0.0, 1.0, total)
        out = tl.sum(w[:, None] * part, 0) / total_safe
        tl.store(Out + t * stride_ot + h * stride_oh + d, out, mask=d_ok)
        lse_total = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(total_safe))
        tl.store(Lse + t * stride_lt + h * stride_lh, lse_total)

    @triton.jit
    def _block_mass(
        Q,
        K,
        Tables,
        QStart,
        QLen,
        CtxLen,
        Lse,
        Mass,
        stride_qt,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_ks,
        stride_tb,
        stride_lt,
        stride_lh,
        stride_mb,
        stride_mh,
        qk_scale,
        softcap2,
        window,
        chunk,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        DIM_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        HAS_CHUNK: tl.constexpr,
    ):
        # Mass[seq, kv_head, t]: the probability key t received (exp(score - final lse)),
        # summed over the group's heads and the sequence's queries, for one tile of keys.
        k_tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_len = tl.load(QLen + seq)
        ctx = tl.load(CtxLen + seq)
        q_first = tl.load(QStart + seq)
        pos = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = pos < ctx
        d = tl.arange(0, DIM_PAD)
        d_ok = d < HEAD_DIM
        phys = tl.load(Tables + seq * stride_tb + pos // BLOCK_SIZE, mask=k_ok, other=0)
        slot = phys.to(tl.int64) * stride_kb + kv_head * stride_kh + (pos % BLOCK_SIZE) * stride_ks
        k = tl.load(K + slot[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        g = rows % GROUP_PAD
        head = kv_head * GROUP + g
        mass = tl.zeros([BLOCK_N], tl.float32)
        for q_start in range(0, q_len, BLOCK_Q):
            tok = q_start + rows // GROUP_PAD
            row_ok = (tok < q_len) & (g < GROUP)
            qpos = ctx - q_len + tok
            q_rows = (q_first + tok).to(tl.int64)
            q = tl.load(
                Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            if UPCAST:
                q = q.to(tl.float32)
            lse = tl.load(Lse + q_rows * stride_lt + head * stride_lh, mask=row_ok, other=0.0)
            s = _scores(
                q,
                k,
                pos,
                qpos,
                k_ok,
                qk_scale,
                softcap2,
                window,
                chunk,
                DOT_PRECISION,
                HAS_SOFTCAP,
                HAS_WINDOW,
                HAS_CHUNK,
            )
            p = tl.where(row_ok[:, None], tl.exp2(s - lse[:, None] * 1.4426950408889634), 0.0)
            mass += tl.sum(p, 0)
        tl.store(Mass + seq * stride_mb + kv_head * stride_mh + pos, mass, mask=k_ok)


@dataclass(frozen=True, eq=False)
class ScoreMods:
    """What some model families change in the scores (all off by default), applied in `_scores`
    and the end of `_attend_fwd` only. The scale itself is `attend`'s `scale`."""

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
    _attend_fwd[(q_tiles, batch, num_kv_heads * num_splits)](
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
        _merge_splits[(num_tokens, num_q_heads)](
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
    _block_mass[(key_tiles, batch, num_kv_heads)](
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
    """paged_decode's contract (attention.py checked the input): q [B, Hq, D], tables [B, max_blocks]
    int32, lens [B] int32 on q's device. Returns out, lse and the mass per logical block [B, max_blocks]."""
    batch = q.shape[0]
    block_size = k_cache.shape[2]
    rows = torch.arange(batch, dtype=torch.int32, device=q.device)
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
    num_logical = -(-max_len // block_size)
    mass = torch.zeros(batch, tables.shape[1], dtype=torch.float32, device=q.device)
    mass[:, :num_logical] = key_mass[:, : num_logical * block_size].view(batch, num_logical, -1).sum(-1)
    return out, lse, mass


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
    block_size = k_cache.shape[2]
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
    num_logical = ids.shape[0]
    mass = torch.zeros(table_len, dtype=torch.float32, device=q.device)
    mass[:num_logical] = key_mass[0, : num_logical * block_size].view(num_logical, -1).sum(-1)
    return out, lse, mass
