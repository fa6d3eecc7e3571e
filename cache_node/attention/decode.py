"""paged_decode: one decode step for a batch, checked, then handed to a backend
(decode_trusted: the same without the checks, for the engine, which checked its input)."""

from __future__ import annotations

import torch
from torch import Tensor

from pagedkv.protos.errors import InvalidArgument

from . import cpu_kernel, torch_decode
from .backends import Backend, load_triton, pick_backend, score_mods
from .checks import as_index_tensor, check_block_ids, check_out, check_q_and_cache, check_spec, first_blocks
from .output import AttentionOutput
from .spec import PLAIN, AttentionSpec


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
    spec: the layer's window, chunks, soft-cap, sinks and scale (spec.py); with a window
    or chunks, blocks wholly before the query's first visible key are never read (any value).
    """
    num_kv_heads, block_size = check_q_and_cache(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    tables = as_index_tensor(block_tables, "block_tables")
    lens = as_index_tensor(seq_lens, "seq_lens")
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
        if out is not None:
            check_out(out, (batch, num_q_heads, head_dim), q.dtype)
        check_spec(spec, num_q_heads)
        empty = AttentionOutput(q.new_empty(0, num_q_heads, head_dim), q.new_empty(0, num_q_heads).float())
        if return_block_mass:
            empty = AttentionOutput(empty.out, empty.lse, torch.zeros(0, tables.shape[1], device=q.device))
        return empty
    return decode_trusted(
        q,
        k_cache,
        v_cache,
        tables,
        lens,
        scale=scale,
        return_block_mass=return_block_mass,
        backend=backend,
        out=out,
        spec=spec,
    )


def decode_trusted(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    *,
    scale: float | None = None,
    return_block_mass: bool = False,
    backend: Backend | None = None,
    out: tuple[Tensor, Tensor] | None = None,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    """paged_decode for a caller that built q, the tables and the lengths itself against these
    caches (the engine, which checked the wire input once): only the spec and `out` are checked
    here. tables [B, max_blocks] and lens [B] integer tensors, B >= 1."""
    batch, num_q_heads, head_dim = q.shape
    if out is not None:
        check_out(out, (batch, num_q_heads, head_dim), q.dtype)
    scale = check_spec(spec, num_q_heads).resolve_scale(scale, head_dim)
    picked = pick_backend(backend, q.device)
    if picked == "kernel":
        return cpu_kernel.decode(
            q, k_cache, v_cache, tables, lens, scale, return_block_mass, out=out, spec=spec
        )
    if picked == "triton":
        res = decode_triton(
            q, k_cache, v_cache, tables, lens, int(lens.max()), scale, return_block_mass, spec=spec
        )
    else:
        res = torch_decode.decode(q, k_cache, v_cache, tables, lens, scale, return_block_mass, spec)
    if out is None:
        return res
    out[0].copy_(res.out)
    out[1].copy_(res.lse)
    return AttentionOutput(out[0], out[1], res.block_mass)


def decode_triton(
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
    tri = load_triton()
    assert tri is not None
    num_blocks, _, block_size, _ = k_cache.shape
    # Checked where the caller built them (the engine: on the host, so no device sync), then moved.
    num_logical = -(-max_len // block_size)
    logical = torch.arange(num_logical, device=lens.device)
    used = logical < ((lens + block_size - 1) // block_size).unsqueeze(1)
    if spec.masks:  # blocks before a window are never attended; the mass pass reads block 0 there
        used &= logical >= first_blocks(spec, lens, block_size).unsqueeze(1)
    tables = tables.to(lens.device)
    check_block_ids(tables[:, :num_logical], used, num_blocks, "block_tables")
    if spec.masks:
        tables = tables.clone()
        tables[:, :num_logical] = torch.where(used, tables[:, :num_logical], 0)
    tables = tables.to(device=q.device, dtype=torch.int32)
    lens = lens.to(device=q.device, dtype=torch.int32)
    res = tri.decode(
        q, k_cache, v_cache, tables, lens, max_len, scale, with_mass, num_splits, score_mods(spec, q)
    )
    return AttentionOutput(*res)
