"""The flash-decoding merge: attention computed over disjoint key sets of the same
queries combines exactly by the parts' log-sum-exp. Shared by the node (its own
partial results) and the client (a sequence whose extents span several nodes)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import InvalidArgument


def merge_partials(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """outs[i] [..., D] and lses[i] [...] (natural log of the part's softmax denominator)
    over disjoint key sets; returns (out in outs[0]'s dtype, lse float32). A part with
    lse = -inf (no keys) contributes nothing; all parts empty gives out 0, lse -inf.
    InvalidArgument when the parts' shapes differ. Pure: the inputs are not changed."""
    if not outs or len(outs) != len(lses):
        raise InvalidArgument(f"need as many outs as lses, at least one; got {len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses, strict=True)):
        if o.shape != outs[0].shape or s.shape != o.shape[:-1]:
            raise InvalidArgument(
                f"part {i}: out {tuple(o.shape)} / lse {tuple(s.shape)} do not match part 0's out "
                f"{tuple(outs[0].shape)}"
            )
    stacked = torch.stack([s.float() for s in lses])  # [P, ...]
    total = torch.logsumexp(stacked, dim=0)
    # every part empty: total is -inf, and exp(-inf - -inf) would be nan; such a weight is 0
    weights = torch.exp(stacked - total.unsqueeze(0)).nan_to_num_(0.0)
    merged = torch.zeros(outs[0].shape, dtype=torch.float32, device=outs[0].device)
    for w, o in zip(weights, outs, strict=True):
        merged += w.unsqueeze(-1) * o.float()
    return merged.to(outs[0].dtype), total
