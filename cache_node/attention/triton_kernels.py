"""The Triton kernels of paged attention (triton_backend.py launches them and says how they
tile the work). Importing this module picks compiled or interpreted Triton for the process."""

from __future__ import annotations

import os
import sys

import torch

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
except ImportError:  # the node still runs: CUDA tensors take the torch path
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
    def attend_fwd(
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
    def merge_splits(
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
    def block_mass(
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
