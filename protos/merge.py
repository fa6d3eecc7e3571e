"""The flash-decoding merge: attention computed over disjoint key sets of the same
queries combines exactly by the parts' log-sum-exp. Shared by the node (its own
partial results) and the client (a sequence whose extents span several nodes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .errors import InvalidArgument

_LOWEST = np.float32(np.finfo(np.float32).min)
_TINY = np.float32(np.finfo(np.float32).tiny)
Merged = tuple[torch.Tensor, torch.Tensor]  # out, lse


def merge_partials(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """outs[i] [..., D] and lses[i] [...] (natural log of the part's softmax denominator)
    over disjoint key sets; returns (out in outs[0]'s dtype, lse float32). A part with
    lse = -inf (no keys) contributes nothing; all parts empty gives out 0, lse -inf.
    InvalidArgument when the parts' shapes differ. Pure: the inputs are not changed."""
    if not outs or len(outs) != len(lses):
        raise InvalidArgument(f"need as many outs as lses, at least one; got {len(outs)} and {len(lses)}")
    shape, is_cpu = outs[0].shape, True
    for i, (o, s) in enumerate(zip(outs, lses, strict=True)):
        if o.shape != shape or s.shape != shape[:-1]:
            raise InvalidArgument(
                f"part {i}: out {tuple(o.shape)} / lse {tuple(s.shape)} do not match part 0's out "
                f"{tuple(shape)}"
            )
        is_cpu = is_cpu and o.is_cpu and s.is_cpu and not (o.requires_grad or s.requires_grad)
    return _merge_cpu(outs, lses) if is_cpu else _merge_torch(outs, lses)


def _merge_torch(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Merged:
    """merge_partials in torch ops, on the parts' device (and keeping their autograd)."""
    stacked = torch.stack([s.float() for s in lses])  # [P, ...]
    total = torch.logsumexp(stacked, dim=0)
    # every part empty: total is -inf, and exp(-inf - -inf) would be nan; such a weight is 0
    weights = torch.exp(stacked - total.unsqueeze(0)).nan_to_num_(0.0)
    merged = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for w, o in zip(weights, outs, strict=True):
        merged += w.unsqueeze(-1) * o.float()
    return merged.to(outs[0].dtype), total


def _merge_cpu(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]) -> Merged:
    """merge_partials on CPU, in numpy: the same float32 arithmetic (out = sum w_i o_i / sum
    w_i, w_i = exp(lse_i - max)), at a fraction of torch's per-op cost on a decode step's
    few hundred values. The max is floored at float32's lowest so that parts that are all
    empty give weights 0 (not nan): then out 0, lse -inf."""
    lse_parts = [_f32(s) for s in lses]
    top = lse_parts[0]
    for part in lse_parts[1:]:
        top = np.maximum(top, part)
    top = np.maximum(top, _LOWEST)
    acc = total = None
    for lse, out in zip(lse_parts, outs, strict=True):
        w = np.exp(lse - top)
        term = _f32(out) * w[..., None]
        acc, total = (term, w) if acc is None else (np.add(acc, term, out=acc), total + w)
    assert acc is not None and total is not None
    acc /= np.maximum(total, _TINY)[..., None]  # (a sum of weights is >= 1 unless every part is empty)
    with np.errstate(divide="ignore"):
        merged_lse = np.log(total) + top
    merged = torch.from_numpy(acc)
    dtype = outs[0].dtype
    return merged if dtype == torch.float32 else merged.to(dtype), torch.from_numpy(np.asarray(merged_lse))


def _f32(t: torch.Tensor) -> np.ndarray:
    return (t if t.dtype == torch.float32 else t.float()).numpy()
