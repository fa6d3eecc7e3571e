"""Paged attention over one layer of the node's block pool.

The pool is `kv[num_layers, 2, num_blocks, Hk, block_size, D]`; these functions take one layer's
`k_cache = kv[layer, 0]` and `v_cache = kv[layer, 1]` ([num_blocks, Hk, block_size, D], contiguous)
after the engine has appended the new tokens (append-then-attend). Token t of a sequence lives in
physical block `table[t // block_size]` at offset `t % block_size`:

    logical blocks   | 0            | 1            | 2       ...  |
    block table      | 7            | 2            | 9            |   (any order, may be shared)
    tokens           | 0 .. bs-1    | bs .. 2bs-1  | 2bs .. len-1 |   (last block may be partial)

Every result carries the natural-log LSE of the scaled scores, so attention computed by several nodes
over disjoint key sets merges exactly (`merge_partials`, the flash-decoding merge), and optionally the
attention mass per logical block, which feeds the attention-score-aware eviction policy.

Three backends with one contract:
- "kernel": `csrc/paged_attention.cpp`, a C++/OpenMP kernel that walks the blocks in place (no
  gather), built on first use with the system C++ compiler and cached on disk, called via ctypes.
  Decode on CPU tensors.
- "triton": `triton_attention.py`, decode and prefill walking the block tables on the device.
  The default on CUDA tensors when triton is installed; on CPU tensors only in Triton's
  interpreter (the tests).
- "torch": gather the blocks into [B, Hk, L, D] with one index_select, then matmuls with the query
  heads of each KV head folded together. Used whenever the others are unavailable.
Pick one per call (`backend=`) or process-wide with PAGEDKV_ATTENTION_BACKEND=auto|kernel|triton|torch.
Prefill on CPU uses torch's flash kernel (or explicit matmuls when block mass is asked for).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Literal

import torch
from torch import Tensor

from pagedkv.protos.errors import FailedPrecondition, InvalidArgument
from pagedkv.protos.merge import merge_partials  # the node's and the client's one merge

from . import attention_kernel
from .attention_kernel import KernelInfo, kernel_info
from .attention_spec import PLAIN, AttentionSpec, apply_sinks

__all__ = [
    "AttentionOutput",
    "AttentionSpec",
    "KernelInfo",
    "kernel_info",
    "merge_partials",
    "paged_decode",
    "paged_prefill",
    "release_workspace",
]

logger = logging.getLogger(__name__)

Backend = Literal["auto", "kernel", "triton", "torch"]
BACKEND_ENV = "PAGEDKV_ATTENTION_BACKEND"
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Prefill materializes scores for a chunk of queries at a time; this bounds that chunk (floats).
_PREFILL_SCORE_BUDGET = 1 << 24
# A prefill whose folded mask (G*n rows x context_len keys, float32) fits this many elements runs
# as one masked flash call; a larger one as two unmasked calls merged by their LSEs.
_MASKED_PREFILL_MAX = 1 << 20


@dataclass(frozen=True)
class AttentionOutput:
    """out: decode [B, Hq, D] / prefill [n, Hq, D], in q's dtype.
    lse: decode [B, Hq] / prefill [n, Hq], float32, natural log of sum(exp(scaled scores)).
    block_mass: decode [B, max_blocks] / prefill [len(block_table)], float32, probability mass each
    logical block received summed over query heads (and query tokens for prefill); padding is 0.
    None unless asked for."""

    out: Tensor
    lse: Tensor
    block_mass: Tensor | None = None


# --------------------------------------------------------------------------- validation


def _as_index_tensor(value: Tensor | Sequence[int], name: str) -> Tensor:
    try:
        tensor = value if isinstance(value, Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"{name} must be an integer tensor: {exc}") from exc
    if tensor.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument(f"{name} must be int32 or int64, got {tensor.dtype}")
    return tensor


def _check_q_and_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int]:
    """Returns (Hk, block_size) after checking everything q and the caches must agree on."""
    for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(value, Tensor):
            raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if q.dim() != 3:
        raise InvalidArgument(f"q must be 3-d, got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPE_CODES:
        raise InvalidArgument(f"q dtype must be float32, float16 or bfloat16, got {q.dtype}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise InvalidArgument(
            "k_cache and v_cache must both be [num_blocks, num_kv_heads, block_size, head_dim], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise InvalidArgument(
            f"dtype mismatch: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if k_cache.device != q.device or v_cache.device != q.device:
        raise InvalidArgument(
            f"device mismatch: q {q.device}, k_cache {k_cache.device}, v_cache {v_cache.device}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise InvalidArgument("k_cache and v_cache must be contiguous (views kv[layer, 0] and kv[layer, 1])")
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    num_q_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise InvalidArgument(f"head_dim mismatch: q has {q.shape[2]}, the cache has {head_dim}")
    if min(num_q_heads, num_kv_heads, head_dim, block_size) == 0:
        raise InvalidArgument(
            f"empty dimension: {num_q_heads} query heads, {num_kv_heads} kv heads, head_dim {head_dim}, "
            f"block_size {block_size}"
        )
    if num_q_heads % num_kv_heads != 0:
        raise InvalidArgument(
            f"query heads ({num_q_heads}) must be a positive multiple of kv heads ({num_kv_heads})"
        )
    return num_kv_heads, block_size


def _check_block_ids(table: Tensor, used: Tensor, num_blocks: int, what: str) -> None:
    """table[used] must be valid physical block ids; names the first offender."""
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise InvalidArgument(
            f"{what}{list(where)} = {int(table[where])} is not a physical block id in [0, {num_blocks})"
        )


@functools.cache
def _triton() -> ModuleType | None:
    """triton_attention, imported on first use (importing triton takes a second, and on a
    machine without CUDA it puts triton in interpreter mode); None when triton is missing."""
    from . import triton_attention

    if not triton_attention.IS_AVAILABLE:
        logger.info("paged attention: triton is not installed; CUDA tensors use the torch path")
        return None
    return triton_attention


def _pick_backend(backend: Backend | None, device: torch.device) -> str:
    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    if choice not in ("auto", "kernel", "triton", "torch"):
        raise InvalidArgument(f"backend must be 'auto', 'kernel', 'triton' or 'torch', got {choice!r}")
    if choice == "torch":
        return "torch"
    if choice == "triton":
        tri = _triton()
        if tri is None:
            raise FailedPrecondition("backend 'triton' needs the triton package (pip install pagedkv[gpu])")
        if device.type == "cpu" and not tri.IS_INTERPRETED:
            raise InvalidArgument("the triton kernels run on CPU tensors only under TRITON_INTERPRET=1")
        return "triton"
    if device.type != "cpu":
        if choice == "kernel":
            raise InvalidArgument(f"the C++ kernel runs on CPU tensors only, got {device}")
        tri = _triton()
        return "triton" if tri is not None and not tri.IS_INTERPRETED else "torch"
    fn, info = attention_kernel.get_kernel()
    if fn is None:
        if choice == "kernel":
            raise FailedPrecondition(f"paged attention kernel unavailable: {info.detail}")
        return "torch"
    return "kernel"


# --------------------------------------------------------------------------- decode


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    *,
    scale: float | None = None,
    return_block_mass: bool = False,
    backend: Backend | None = None,
    out: tuple[Tensor, Tensor] | None = None,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    """One decode step for a batch: query b attends to all seq_lens[b] tokens of its sequence.

    q [B, Hq, D]; block_tables int32/int64 [B, max_blocks], entries past a sequence's
    ceil(seq_len / block_size) blocks are ignored (any value); seq_lens [B], >= 1, counting the new
    token. GQA when Hq is a multiple of Hk. Pure: reads the caches, writes nothing shared, thread-safe.
    Raises InvalidArgument on malformed input (including an out-of-range physical block id), and
    FailedPrecondition when backend="kernel" is forced but the kernel cannot be built.
    out: contiguous [B, Hq, D] in q's dtype and [B, Hq] float32 CPU tensors to write out and lse
    into (the node's same-host path passes the client's shared region), returned as the result's.
    spec: the layer's window, chunks, soft-cap, sinks and scale (attention_spec.py); with a window
    or chunks, blocks wholly before the query's first visible key are never read (any value).
    """
    num_kv_heads, block_size = _check_q_and_cache(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    if out is not None:
        _check_out(out, (batch, num_q_heads, head_dim), q.dtype)
    scale = _check_spec(spec, num_q_heads).resolve_scale(scale, head_dim)
    tables = _as_index_tensor(block_tables, "block_tables")
    lens = _as_index_tensor(seq_lens, "seq_lens")
    if tables.dim() != 2 or tables.shape[0] != batch:
        raise InvalidArgument(f"block_tables must be [B={batch}, max_blocks], got {tuple(tables.shape)}")
    if lens.shape != (batch,):
        raise InvalidArgument(f"seq_lens must be [B={batch}], got {tuple(lens.shape)}")
    capacity = tables.shape[1] * block_size
    if batch > 0:
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 1 or hi > capacity:
            b = int(torch.argmin(lens)) if lo < 1 else int(torch.argmax(lens))
            raise InvalidArgument(
                f"seq_lens[{b}] = {int(lens[b])} outside [1, {capacity}] "
                f"(block_tables hold {tables.shape[1]} blocks of {block_size})"
            )
    if batch == 0:
        empty = AttentionOutput(q.new_empty(0, num_q_heads, head_dim), q.new_empty(0, num_q_heads).float())
        if return_block_mass:
            empty = AttentionOutput(empty.out, empty.lse, torch.zeros(0, tables.shape[1], device=q.device))
        return empty
    picked = _pick_backend(backend, q.device)
    if picked == "kernel":
        return _decode_kernel(q, k_cache, v_cache, tables, lens, scale, return_block_mass, out=out, spec=spec)
    if picked == "triton":
        res = _decode_triton(
            q, k_cache, v_cache, tables, lens, int(lens.max()), scale, return_block_mass, spec=spec
        )
    else:
        res = _decode_torch(q, k_cache, v_cache, tables, lens, scale, return_block_mass, spec)
    if out is None:
        return res
    out[0].copy_(res.out)
    out[1].copy_(res.lse)
    return AttentionOutput(out[0], out[1], res.block_mass)


def _check_spec(spec: AttentionSpec, num_q_heads: int) -> AttentionSpec:
    if not isinstance(spec, AttentionSpec):
        raise InvalidArgument(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    spec.check_heads(num_q_heads)
    return spec


def _first_blocks(spec: AttentionSpec, lens: Tensor, block_size: int) -> Tensor:
    """[B] the first logical block each decode query (at lens - 1) can see."""
    if not spec.masks:
        return torch.zeros_like(lens)
    return spec.first_visible_t(lens - 1) // block_size


def _check_out(out: tuple[Tensor, Tensor], shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The caller's destination for out and lse: the shapes, dtypes and layout paged_decode writes."""
    o, lse = out
    for name, t, want_shape, want_dtype in (("out", o, shape, dtype), ("lse", lse, shape[:2], torch.float32)):
        if tuple(t.shape) != want_shape or t.dtype != want_dtype or not t.is_contiguous() or t.is_cuda:
            raise InvalidArgument(
                f"paged_decode {name}= must be a contiguous CPU {want_dtype} tensor of shape "
                f"{list(want_shape)}, got {t.dtype} {list(t.shape)}"
            )


def _decode_kernel(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    with_mass: bool,
    num_partitions: int | None = None,  # tests force the split; None picks from the thread count
    out: tuple[Tensor, Tensor] | None = None,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    fn = attention_kernel.get_kernel()[0]
    assert fn is not None
    batch, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    tables = tables.to(device="cpu", dtype=torch.int64).contiguous()
    lens = lens.to(device="cpu", dtype=torch.int64).contiguous()
    q32 = q.to(torch.float32).contiguous()
    if out is not None and q.dtype == torch.float32:  # the kernel writes straight into the caller's
        o, lse = out
    else:
        o = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch, num_q_heads, dtype=torch.float32) if out is None else out[1]
    block_lse = None
    if with_mass:  # blocks the kernel never visits (padding) keep -inf, so their mass is 0
        block_lse = torch.full((batch, num_q_heads, tables.shape[1]), -math.inf, dtype=torch.float32)
    # Split long sequences across threads when there are too few (sequence, kv head) pairs to go round.
    num_threads = torch.get_num_threads()
    if num_partitions is None:
        num_partitions = 1
        if batch * num_kv_heads < 2 * num_threads:
            max_logical = -(-int(lens.max()) // block_size)
            num_partitions = max(1, min(-(-4 * num_threads // (batch * num_kv_heads)), max_logical // 8))
    bad = (ctypes.c_int64 * 3)()
    sinks = spec.sinks_tensor(torch.device("cpu"))
    status = fn(
        _DTYPE_CODES[q.dtype],
        q32.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        batch,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        tables.shape[1],
        num_partitions,
        scale,
        spec.window,
        spec.chunk,
        spec.softcap,
        0 if sinks is None else sinks.data_ptr(),
        o.data_ptr(),
        lse.data_ptr(),
        0 if block_lse is None else block_lse.data_ptr(),
        num_threads,
        bad,
    )
    if status == 1:
        raise InvalidArgument(
            f"block_tables[{bad[0]}, {bad[1]}] = {bad[2]} is not a physical block id in [0, {num_blocks})"
        )
    if status != 0:
        raise RuntimeError(f"paged attention kernel failed with status {status}")
    mass = None
    if block_lse is not None:
        mass = torch.exp(block_lse - lse.unsqueeze(-1)).sum(dim=1)
    if out is not None and o is not out[0]:
        o = out[0].copy_(o)
    return AttentionOutput(o.to(q.dtype), lse, mass)


def _decode_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    max_len: int,
    scale: float,
    with_mass: bool,
    num_splits: int | None = None,  # tests force the split; None picks from the device
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    tri = _triton()
    assert tri is not None
    num_blocks, _, block_size, _ = k_cache.shape
    # Checked where the caller built them (the engine: on the host, so no device sync), then moved.
    num_logical = -(-max_len // block_size)
    logical = torch.arange(num_logical, device=lens.device)
    used = logical < ((lens + block_size - 1) // block_size).unsqueeze(1)
    if spec.masks:  # blocks before a window are never attended; the mass pass reads block 0 there
        used &= logical >= _first_blocks(spec, lens, block_size).unsqueeze(1)
    tables = tables.to(lens.device)
    _check_block_ids(tables[:, :num_logical], used, num_blocks, "block_tables")
    if spec.masks:
        tables = tables.clone()
        tables[:, :num_logical] = torch.where(used, tables[:, :num_logical], 0)
    tables = tables.to(device=q.device, dtype=torch.int32)
    lens = lens.to(device=q.device, dtype=torch.int32)
    res = tri.decode(q, k_cache, v_cache, tables, lens, max_len, scale, with_mass, num_splits, _mods(spec, q))
    return AttentionOutput(*res)


def _mods(spec: AttentionSpec, q: Tensor) -> object:
    """The Triton kernels' compile-time score hooks for a spec (the scale travels apart)."""
    tri = _triton()
    assert tri is not None
    if spec.is_plain:
        return tri.NO_MODS
    return tri.ScoreMods(spec.window, spec.chunk, spec.softcap, spec.sinks_tensor(q.device))


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


_workspace = _Workspace()


def release_workspace() -> None:
    """Drop the pooled buffers of the torch path (memory pressure); the next call reallocates."""
    _workspace.clear()


def _gather_float(cache: Tensor, rows: Tensor, taken: list[Tensor]) -> Tensor:
    """The (block, head) slabs of a [num_blocks, Hk, bs, D] cache listed in rows, as float32
    [len(rows), bs * D], in pooled buffers that are appended to `taken` for the caller to give back."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    flat = cache.view(num_blocks * num_kv_heads, block_size * head_dim)
    numel = rows.numel() * block_size * head_dim
    taken.append(_workspace.take(numel, cache.dtype, cache.device))
    gathered = torch.index_select(flat, 0, rows, out=taken[-1][:numel].view(rows.numel(), -1))
    if cache.dtype == torch.float32:
        return gathered
    taken.append(_workspace.take(numel, torch.float32, cache.device))
    return taken[-1][:numel].view(rows.numel(), -1).copy_(gathered)


def _decode_torch(
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
        firsts = _first_blocks(spec, lens, block_size)
        span = int((seq_blocks - firsts).max())
        logical = firsts.unsqueeze(1) + torch.arange(span, device=device)
        logical = logical.clamp_(max=tables.shape[1] - 1)  # past a sequence's end: unused anyway
        table = torch.gather(tables, 1, logical)
        used = firsts.unsqueeze(1) + torch.arange(span, device=device) < seq_blocks.unsqueeze(1)
    else:
        span = num_logical
        table = tables[:, :num_logical]
        used = torch.arange(num_logical, device=device) < seq_blocks.unsqueeze(1)
    _check_block_ids(table, used, num_blocks, "block_tables")
    ids = torch.where(used, table, 0)  # padding reads block 0; masked out of the softmax below
    heads = torch.arange(num_kv_heads, device=device)
    rows = (ids.unsqueeze(1) * num_kv_heads + heads.view(1, -1, 1)).reshape(-1)  # [B, Hk, blocks]
    length = span * block_size
    taken: list[Tensor] = []
    try:
        k = _gather_float(k_cache, rows, taken).view(batch * num_kv_heads, length, head_dim)
        v = _gather_float(v_cache, rows, taken).view(batch * num_kv_heads, length, head_dim)
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
        _workspace.give(taken)
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


# --------------------------------------------------------------------------- prefill


def paged_prefill(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    context_len: int,
    *,
    scale: float | None = None,
    return_block_mass: bool = False,
    backend: Backend | None = None,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    """Causal attention for the last n tokens of one sequence of context_len tokens.

        positions  0 ............ context_len - n ........ context_len
                   | cached prefix | q[0] ... q[n-1] (already appended) |
        q[i] attends to positions 0 .. context_len - n + i

    q [n, Hq, D] with 1 <= n <= context_len; block_table [num_blocks_of_seq] with at least
    ceil(context_len / block_size) entries (the rest ignored; their block_mass is 0). Pure, thread-safe.
    Raises InvalidArgument on malformed input. backend: "triton" or the CPU paths (any other).
    spec: as for paged_decode; blocks wholly before q[0]'s first visible key are never read.
    """
    num_kv_heads, block_size = _check_q_and_cache(q, k_cache, v_cache)
    num_queries, num_q_heads, head_dim = q.shape
    scale = _check_spec(spec, num_q_heads).resolve_scale(scale, head_dim)
    table = _as_index_tensor(block_table, "block_table")
    if table.dim() != 1:
        raise InvalidArgument(f"block_table must be 1-d, got shape {tuple(table.shape)}")
    if isinstance(context_len, bool) or not isinstance(context_len, int):
        raise InvalidArgument(f"context_len must be an int, got {context_len!r}")
    if not 1 <= num_queries <= context_len <= table.shape[0] * block_size:
        raise InvalidArgument(
            f"need 1 <= n ({num_queries}) <= context_len ({context_len}) <= block_table capacity "
            f"({table.shape[0]} blocks of {block_size})"
        )
    device = q.device
    num_blocks = k_cache.shape[0]
    num_logical = -(-context_len // block_size)
    first_pos = context_len - num_queries
    start = spec.first_visible(first_pos) // block_size  # the first block any query sees
    ids = table[:num_logical].to(device=device, dtype=torch.int64)
    used = torch.arange(num_logical, device=device) >= start
    _check_block_ids(ids, used, num_blocks, "block_table")
    if start > 0:
        ids = torch.where(used, ids, 0)
    group = num_q_heads // num_kv_heads

    choice = backend or os.environ.get(BACKEND_ENV, "auto")
    # Only triton has a prefill of its own; on CPU tensors "auto" and "kernel" mean the torch paths.
    wants_triton = choice == "triton" or (choice == "auto" and device.type != "cpu")
    if wants_triton and _pick_backend(backend, device) == "triton":
        tri = _triton()
        assert tri is not None
        mods = _mods(spec, q)
        res = tri.prefill(
            q, k_cache, v_cache, ids, table.shape[0], context_len, scale, return_block_mass, mods
        )
        return AttentionOutput(*res)
    heads = torch.arange(num_kv_heads, device=device)
    rows = (ids[start:].unsqueeze(0) * num_kv_heads + heads.unsqueeze(1)).reshape(-1)  # [Hk, blocks]
    key_base = start * block_size  # position of the first gathered key
    padded = num_logical * block_size - key_base
    # The flash kernel takes an additive mask but no soft-cap; sinks fold in after it.
    flash_ok = spec.softcap == 0.0 and (
        not spec.masks or group * num_queries * (context_len - key_base) <= _MASKED_PREFILL_MAX
    )
    if not return_block_mass and device.type == "cpu" and flash_ok:
        res = _prefill_flash(q, k_cache, v_cache, rows, context_len, scale, spec, key_base)
        sinks = spec.sinks_tensor(device)
        return res if sinks is None else AttentionOutput(*apply_sinks(res.out, res.lse, sinks))
    qf = q.float().view(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [Hk, G, n, D]
    out = torch.empty(num_kv_heads, group, num_queries, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(num_kv_heads, group, num_queries, dtype=torch.float32, device=device)
    mass = torch.zeros(padded, dtype=torch.float32, device=device) if return_block_mass else None
    sinks = spec.sinks_tensor(device)
    # Chunk the queries so the score tensor stays bounded; query i needs keys [lo_i, first_pos + i]
    # (lo_i = 0 but for a window or chunks); indices below are relative to key_base.
    chunk = max(1, _PREFILL_SCORE_BUDGET // (num_q_heads * context_len))
    taken: list[Tensor] = []
    try:
        k = _gather_float(k_cache, rows, taken).view(num_kv_heads, padded, head_dim)
        v = _gather_float(v_cache, rows, taken).view(num_kv_heads, padded, head_dim)
        for begin in range(0, num_queries, chunk):
            stop = min(num_queries, begin + chunk)
            lo = spec.first_visible(first_pos + begin) - key_base
            hi = first_pos + stop - key_base
            rows_q = group * (stop - begin)  # the G heads of a KV head folded into one matmul
            q_chunk = qf[:, :, begin:stop].reshape(num_kv_heads, rows_q, head_dim)
            scores = torch.bmm(q_chunk, k[:, lo:hi].transpose(1, 2)).mul_(scale)
            scores = spec.cap_(scores.view(num_kv_heads, group, stop - begin, hi - lo))
            query_pos = torch.arange(first_pos + begin, first_pos + stop, device=device)
            key_pos = torch.arange(key_base + lo, key_base + hi, device=device)
            scores.masked_fill_(spec.hidden(query_pos.unsqueeze(1), key_pos), -math.inf)
            chunk_lse = torch.logsumexp(scores, dim=-1)
            if sinks is not None:  # one more denominator term per head (attention_spec.py)
                chunk_lse = torch.logaddexp(chunk_lse, sinks.view(num_kv_heads, group, 1))
            probs = scores.sub_(chunk_lse.unsqueeze(-1)).exp_()
            chunk_out = torch.bmm(probs.view(num_kv_heads, rows_q, hi - lo), v[:, lo:hi])
            out[:, :, begin:stop] = chunk_out.view(num_kv_heads, group, stop - begin, head_dim)
            lse[:, :, begin:stop] = chunk_lse
            if mass is not None:
                mass[lo:hi] += probs.sum(dim=(0, 1, 2))
    finally:
        _workspace.give(taken)
    out_q = out.permute(2, 0, 1, 3).reshape(num_queries, num_q_heads, head_dim).to(q.dtype)
    lse_q = lse.permute(2, 0, 1).reshape(num_queries, num_q_heads)
    block_mass = None
    if mass is not None:
        block_mass = torch.zeros(table.shape[0], dtype=torch.float32, device=device)
        block_mass[start:num_logical] = mass.view(-1, block_size).sum(-1)
    return AttentionOutput(out_q, lse_q, block_mass)


@functools.lru_cache(maxsize=4)
def _folded_causal_mask(group: int, num_queries: int, context_len: int) -> Tensor:
    """[group * n, context_len] additive mask, row g * n + i for query i (keys past
    context_len - n + i are -inf), read-only: shared by the calls of one shape (a
    prefill's layers)."""
    first = context_len - num_queries
    mask = torch.zeros(num_queries, context_len)
    mask[:, first:] = torch.full((num_queries, num_queries), -math.inf).triu(1)
    return mask.repeat(group, 1)


@functools.lru_cache(maxsize=4)
def _folded_spec_mask(
    group: int, num_queries: int, context_len: int, key_base: int, spec: AttentionSpec
) -> Tensor:
    """_folded_causal_mask for keys key_base .. context_len - 1 under a window or chunks."""
    query_pos = torch.arange(context_len - num_queries, context_len)
    hidden = spec.hidden(query_pos.unsqueeze(1), torch.arange(key_base, context_len))
    return torch.zeros(hidden.shape).masked_fill_(hidden, -math.inf).repeat(group, 1)


def _prefill_flash(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor,
    context_len: int,
    scale: float,
    spec: AttentionSpec = PLAIN,
    key_base: int = 0,
) -> AttentionOutput:
    """Prefill through torch's fused CPU flash kernel, which also returns the LSE. The G
    query heads of a KV head fold into one row block (K/V are not expanded), so a KV head's
    keys are read once for all of them. Small prefills (a suffix after a cached prefix) run
    as one call with a folded causal mask (_folded_causal_mask); larger ones in two parts
    with no mask:

        keys      0 ........... first | first ............ context_len
        part A    all n queries see every cached key (no mask), folded
        part B                        | the n new tokens, causal (square, so the
                                        kernel's top-left causal mask is right)

    then A and B merge by their LSEs. No [n, context_len] score matrix is built
    (the explicit path, kept for block mass, materialises it: ~7x slower). The one
    call is fewer ops (on a 2-core VM, a 128-token suffix over 1,152 keys: 2.2 vs
    2.4 ms, 1.8 vs 3.0 ms with OMP_WAIT_POLICY=PASSIVE, where each op wakes its threads).
    A window or chunks always take the one masked call (the caller checked it fits), over the
    keys from key_base; sinks are the caller's."""
    num_queries, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    first = context_len - num_queries
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    taken: list[Tensor] = []
    try:
        k = _gather_float(k_cache, rows, taken).view(num_kv_heads, -1, head_dim)
        v = _gather_float(v_cache, rows, taken).view(num_kv_heads, -1, head_dim)
        qf = q.float()
        if spec.masks or group * num_queries * context_len <= _MASKED_PREFILL_MAX:
            if spec.masks:
                mask = _folded_spec_mask(group, num_queries, context_len, key_base, spec)
            else:
                mask = _folded_causal_mask(group, num_queries, context_len)
            q_fold = qf.reshape(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            q_fold = q_fold.reshape(1, num_kv_heads, group * num_queries, head_dim)
            num_keys = context_len - key_base
            out, lse = flash(
                q_fold, k[None, :, :num_keys], v[None, :, :num_keys], 0.0, False, attn_mask=mask, scale=scale
            )
            out = out.view(num_kv_heads, group, num_queries, head_dim).permute(2, 0, 1, 3)
            lse = lse.view(num_kv_heads, group, num_queries).permute(2, 0, 1)
            return AttentionOutput(
                out.reshape(num_queries, num_q_heads, head_dim).to(q.dtype),
                lse.reshape(num_queries, num_q_heads),
            )
        q_heads = qf.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        k_new = k[:, first:context_len].repeat_interleave(group, 0).unsqueeze(0)
        v_new = v[:, first:context_len].repeat_interleave(group, 0).unsqueeze(0)
        out, lse = flash(q_heads, k_new, v_new, 0.0, True, attn_mask=None, scale=scale)
        out, lse = out[0], lse[0]  # [Hq, n, D], [Hq, n]
        if first > 0:
            q_fold = qf.reshape(num_queries, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            q_fold = q_fold.reshape(1, num_kv_heads, group * num_queries, head_dim)
            out_a, lse_a = flash(
                q_fold, k[None, :, :first], v[None, :, :first], 0.0, False, attn_mask=None, scale=scale
            )
            out_a = out_a.reshape(num_q_heads, num_queries, head_dim)
            lse_a = lse_a.reshape(num_q_heads, num_queries)
            # out = (e^lse_a out_a + e^lse out) / (e^lse_a + e^lse): one lerp by A's share of the mass
            total = torch.logaddexp(lse_a, lse)
            out = torch.lerp(out, out_a, (lse_a - total).exp_().unsqueeze(-1))
            lse = total
    finally:
        _workspace.give(taken)
    return AttentionOutput(out.transpose(0, 1).to(q.dtype), lse.transpose(0, 1).contiguous())
