"""The input checks every attention entry point shares: a malformed call raises InvalidArgument
naming what was wrong before any backend runs (the kernels trust their input)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from pagedkv.protos.errors import InvalidArgument

from .spec import AttentionSpec

DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the C++ kernel's codes


def as_index_tensor(value: Tensor | Sequence[int], name: str) -> Tensor:
    try:
        tensor = value if isinstance(value, Tensor) else torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgument(f"{name} must be an integer tensor: {exc}") from exc
    if tensor.dtype not in (torch.int32, torch.int64):
        raise InvalidArgument(f"{name} must be int32 or int64, got {tensor.dtype}")
    return tensor


def check_q_and_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> tuple[int, int]:
    """Returns (Hk, block_size) after checking everything q and the caches must agree on."""
    for name, value in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(value, Tensor):
            raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if q.dim() != 3:
        raise InvalidArgument(f"q must be 3-d, got shape {tuple(q.shape)}")
    if q.dtype not in DTYPE_CODES:
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


def check_block_ids(table: Tensor, used: Tensor, num_blocks: int, what: str) -> None:
    """table[used] must be valid physical block ids; names the first offender."""
    bad = used & ((table < 0) | (table >= num_blocks))
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise InvalidArgument(
            f"{what}{list(where)} = {int(table[where])} is not a physical block id in [0, {num_blocks})"
        )


def check_spec(spec: AttentionSpec, num_q_heads: int) -> AttentionSpec:
    if not isinstance(spec, AttentionSpec):
        raise InvalidArgument(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    spec.check_heads(num_q_heads)
    return spec


def first_blocks(spec: AttentionSpec, lens: Tensor, block_size: int) -> Tensor:
    """[B] the first logical block each decode query (at lens - 1) can see."""
    if not spec.masks:
        return torch.zeros_like(lens)
    return spec.first_visible_t(lens - 1) // block_size


def check_out(out: tuple[Tensor, Tensor], shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """The caller's destination for out and lse: the shapes, dtypes and layout paged_decode writes."""
    o, lse = out
    for name, t, want_shape, want_dtype in (("out", o, shape, dtype), ("lse", lse, shape[:2], torch.float32)):
        if tuple(t.shape) != want_shape or t.dtype != want_dtype or not t.is_contiguous() or t.is_cuda:
            raise InvalidArgument(
                f"paged_decode {name}= must be a contiguous CPU {want_dtype} tensor of shape "
                f"{list(want_shape)}, got {t.dtype} {list(t.shape)}"
            )
