"""What a layer's attention changes in the scores: the one definition every backend follows.

For a query at position p (0-based in its sequence) and a key at position t, with the scaled score
s = scale * q . k:

    visible    t <= p                                  (causal, always)
               and p - window < t       if window      (the last `window` positions, p's own
                                                        included: transformers' sliding_window)
               and t // chunk == p // chunk  if chunk  (Llama 4 chunked attention)
    score      cap * tanh(s / cap)      if softcap     (Gemma 2, on the scaled score)
    softmax    exp(s_t) / (sum_visible exp(s) + exp(sinks[h]))   if sinks (gpt-oss s_aux:
               one logit per query head in the denominator, with no value)

The LSE a backend returns is log(sum_visible exp(s) + exp(sinks[h])): a sink is one more key with
value 0. So a result with sinks is an ordinary partial over "its keys plus the sink", and the
flash-decoding merge (`merge_partials`) stays exact as long as the sink is counted in exactly one
of the parts merged: compute one extent with the spec and the others with `without_sinks()`, or
all without and fold the sinks in once after the merge with `apply_sinks`.

A window or chunk also bounds the keys a query can reach: `first_visible(p)` is the lowest
visible position, and the backends never read blocks wholly before it (those may be released).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from pagedkv.protos.attention import LayerAttention, first_visible
from pagedkv.protos.errors import InvalidArgument

__all__ = ["PLAIN", "AttentionSpec", "apply_sinks", "dead_prefix_blocks", "from_layer"]


def _nonneg_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"attention spec: {name} must be an int >= 0 (0 = off), got {value!r}")
    return value


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's score modifiers (all off by default: plain causal attention with 1/sqrt(D)).

    scale: the score multiplier (Granite's attention multiplier, Gemma's query_pre_attn_scalar**-0.5);
    None means head_dim**-0.5. window, chunk: 0 = off. softcap: 0.0 = off. sinks: one float per
    query head, or None."""

    scale: float | None = None
    window: int = 0
    chunk: int = 0
    softcap: float = 0.0
    sinks: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.scale is not None:
            s = self.scale
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
                raise InvalidArgument(f"attention spec: scale must be a finite number > 0, got {s!r}")
            object.__setattr__(self, "scale", float(s))
        _nonneg_int(self.window, "window")
        _nonneg_int(self.chunk, "chunk")
        c = self.softcap
        if isinstance(c, bool) or not isinstance(c, int | float) or not math.isfinite(c) or c < 0:
            raise InvalidArgument(f"attention spec: softcap must be finite and >= 0 (0 = off): got {c!r}")
        object.__setattr__(self, "softcap", float(c))
        if self.sinks is not None:
            try:
                sinks = tuple(float(x) for x in self.sinks)
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"attention spec: sinks must be a sequence of floats: {exc}") from exc
            if not sinks or not all(math.isfinite(x) for x in sinks):
                raise InvalidArgument("attention spec: sinks must be one finite float per query head")
            object.__setattr__(self, "sinks", sinks)

    @property
    def masks(self) -> bool:
        """Whether visibility is narrower than causal (a window or chunks)."""
        return self.window > 0 or self.chunk > 0

    @property
    def is_plain(self) -> bool:
        """No modifier but possibly the scale: every backend's fast path applies."""
        return not self.masks and self.softcap == 0.0 and self.sinks is None

    def resolve_scale(self, scale: float | None, head_dim: int) -> float:
        """The scale to use: the spec's, or the call's `scale`, or 1/sqrt(head_dim); both set and
        different is an error (one of them is stale)."""
        if self.scale is not None:
            if scale is not None and float(scale) != self.scale:
                raise InvalidArgument(f"scale={scale!r} contradicts the attention spec's scale {self.scale}")
            return self.scale
        if scale is None:
            return head_dim**-0.5
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
            raise InvalidArgument(f"scale must be a finite number, got {scale!r}")
        return float(scale)

    def check_heads(self, num_q_heads: int) -> None:
        if self.sinks is not None and len(self.sinks) != num_q_heads:
            raise InvalidArgument(
                f"attention spec: {len(self.sinks)} sinks for {num_q_heads} query heads (need one per head)"
            )

    def first_visible(self, pos: int) -> int:
        """The lowest key position a query at `pos` sees."""
        return first_visible(self.window, self.chunk, pos)

    def first_visible_t(self, pos: Tensor) -> Tensor:
        """first_visible for a tensor of positions."""
        lo = torch.zeros_like(pos)
        if self.window:
            lo = torch.clamp(pos - self.window + 1, min=0)
        if self.chunk:
            lo = torch.maximum(lo, pos - pos % self.chunk)
        return lo

    def hidden(self, query_pos: Tensor, key_pos: Tensor) -> Tensor:
        """Bool, the broadcast of query_pos and key_pos (e.g. [n, 1] and [L]): True where the key
        is NOT visible to the query."""
        out = key_pos > query_pos
        if self.window:
            out |= key_pos <= query_pos - self.window
        if self.chunk:
            out |= key_pos // self.chunk != query_pos // self.chunk
        return out

    def cap_(self, scores: Tensor) -> Tensor:
        """Soft-cap scaled scores in place (a no-op without a cap)."""
        if self.softcap:
            scores.div_(self.softcap).tanh_().mul_(self.softcap)
        return scores

    def sinks_tensor(self, device: torch.device) -> Tensor | None:
        return None if self.sinks is None else torch.tensor(self.sinks, dtype=torch.float32, device=device)

    def without_sinks(self) -> AttentionSpec:
        """The spec for every extent but one when partials of one query are merged."""
        return replace(self, sinks=None) if self.sinks is not None else self


PLAIN = AttentionSpec()


def from_layer(layer: LayerAttention) -> AttentionSpec:
    """The spec of one layer of a sequence's wire attention (protos/attention.py; no sinks:
    the client folds them in)."""
    if layer.is_plain:
        return PLAIN
    return AttentionSpec(layer.scale, layer.window, layer.chunk, layer.softcap)


def dead_prefix_blocks(specs: Sequence[AttentionSpec], next_pos: int, block_size: int) -> int:
    """How many leading logical blocks of a sequence no query at `next_pos` or later sees in any
    of the layers' specs: the blocks a window lets the node release as decoding moves on.
    first_visible never decreases with the position, so a block dead now stays dead; one full
    layer (no window, no chunks) keeps every block."""
    if isinstance(next_pos, bool) or not isinstance(next_pos, int) or next_pos < 0:
        raise InvalidArgument(f"next_pos must be an int >= 0, got {next_pos!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgument(f"block_size must be an int >= 1, got {block_size!r}")
    if not specs:
        return 0
    return min(spec.first_visible(next_pos) for spec in specs) // block_size


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Fold per-head sink logits into a result computed without them: out [..., Hq, D], lse
    [..., Hq], sinks [Hq]. The same as merging with a part whose out is 0 and whose LSE is the
    sink: out * sigmoid(lse - sink), lse = logaddexp(lse, sink)."""
    sink = sinks.to(device=lse.device, dtype=torch.float32)
    lse32 = lse.float()
    total = torch.logaddexp(lse32, sink)
    share = torch.exp(lse32 - total).nan_to_num_(0.0)  # no keys at all: lse = -inf, share 0
    return (out.float() * share.unsqueeze(-1)).to(out.dtype), total
