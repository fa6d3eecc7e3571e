"""What every attention backend returns."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


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
