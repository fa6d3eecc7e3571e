"""Node-mode attention of one layer for one forward: the padded batch as node calls.

transformers hands the attention function [B, H, T, D] tensors in the padded layout; the node
holds each row's real tokens only (hf_cache's module docstring draws it). Three shapes of
forward, one node call per layer each:

    forward                                     node call (one per layer, every row at once)
    decode: T == 1, every row real              attend_decode: [B, H, D], token ids at layer 0
    prefill, every position of every row new    attend_prefill_batch over views of one copy
    prefill with pads or positions already      attend_prefill_batch over each row's picked
      stored (a row's prefix hit reached past)    positions; the others' outputs are zeros

A custom scale is applied to q here (exact: the scores are linear in q); attention sinks are
folded in from the LSE: out * Z / (Z + e^sink) = out * sigmoid(lse - sink).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from .hf_backend import KVBackend, join_rows


class ForwardRows(Protocol):
    """The forward's bookkeeping attend_layer reads (hf_cache._Forward)."""

    token_ids: torch.Tensor  # [B, T] int64
    rows: list[torch.Tensor]  # per row, the positions it stores among the T
    picks: list[slice | torch.Tensor]  # rows[b] as a slice when contiguous
    is_full: bool  # every position of every row is stored
    decode_tokens: list[int] | None  # decode: each row's new token id


def attend_layer(
    backend: KVBackend,
    seq_ids: Sequence[str],
    fwd: ForwardRows,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_scale: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Append this layer's new K/V of every row and attend on the node: query [B, Hq, T, D],
    key/value [B, Hk, T, D] -> out [B, T, Hq, D] on query's device (zeros where a row stores
    nothing). `q_scale`: the model's scale over the node's 1/sqrt(D); `sinks` [Hq] or None."""
    num_rows, num_q_heads, num_new, head_dim = query.shape
    device = query.device
    q, k, v = query.detach().cpu(), key.detach().cpu(), value.detach().cpu()
    if q_scale is not None:
        q = q * q_scale
    with_lse = sinks is not None
    lse: torch.Tensor | None = None  # [B, T, Hq] when with_lse
    if fwd.decode_tokens is not None:
        got = backend.attend_decode(
            seq_ids,
            layer,
            q[:, :, 0].contiguous(),
            k[:, :, 0].contiguous(),
            v[:, :, 0].contiguous(),
            fwd.decode_tokens if layer == 0 else None,
            **_lse_kw(with_lse),
        )
        out, lse = got if with_lse else (got, None)
        result = out.unsqueeze(1)
        lse = None if lse is None else lse.unsqueeze(1)
    elif fwd.is_full:
        # One transposed copy per tensor for the whole batch; the rows are views of it, so
        # the backend joins them without another copy (hf_backend.join_rows).
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))  # [B, T, H, D]
        got = backend.attend_prefill_batch(
            seq_ids,
            layer,
            list(qt.unbind(0)),
            list(kt.unbind(0)),
            list(vt.unbind(0)),
            fwd.token_ids.tolist() if layer == 0 else None,
            **_lse_kw(with_lse),
        )
        outs, lses = got if with_lse else (got, None)
        result = join_rows(outs).view(num_rows, num_new, num_q_heads, head_dim)
        lse = None if lses is None else join_rows(lses).view(num_rows, num_new, num_q_heads)
    else:
        live = [b for b, idx in enumerate(fwd.rows) if idx.numel()]
        pick = [fwd.picks[b] for b in live]
        got = backend.attend_prefill_batch(
            [seq_ids[b] for b in live],
            layer,
            [q[b][:, idx].transpose(0, 1).contiguous() for b, idx in zip(live, pick, strict=True)],
            [k[b][:, idx].transpose(0, 1).contiguous() for b, idx in zip(live, pick, strict=True)],
            [v[b][:, idx].transpose(0, 1).contiguous() for b, idx in zip(live, pick, strict=True)],
            [fwd.token_ids[b, idx].tolist() for b, idx in zip(live, pick, strict=True)]
            if layer == 0
            else None,
            **_lse_kw(with_lse),
        )
        outs, lses = got if with_lse else (got, None)
        result = q.new_zeros(num_rows, num_new, num_q_heads, head_dim)
        for b, idx, out in zip(live, pick, outs, strict=True):
            result[b, idx] = out.to(result.dtype)
        if lses is not None:
            lse = torch.zeros(num_rows, num_new, num_q_heads, dtype=torch.float32)
            for b, idx, row_lse in zip(live, pick, lses, strict=True):
                lse[b, idx] = row_lse.float()
    if sinks is not None:
        assert lse is not None
        result = result * torch.sigmoid(lse.float() - sinks).unsqueeze(-1).to(result.dtype)
    return result.to(device)


def _lse_kw(with_lse: bool) -> dict[str, bool]:
    """Ask the backend for the LSE only when it is used (a backend written before the keyword
    existed keeps working for every model without sinks)."""
    return {"with_lse": True} if with_lse else {}
