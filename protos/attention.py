"""How a sequence's layers attend, as every side of the wire reads it: `LayerAttention`.

A sequence is opened with one LayerAttention per layer, or with none (plain causal attention
with scale 1/sqrt(head_dim) on every layer). The node keeps it for the sequence, forks inherit
it, and every attend of the sequence follows it (cache_node/windows.py); a window or chunk also
lets the node release the blocks no later query sees. Sent once per open, never per call.

    field     a query at position p sees a key at t <= p when ... (transformers' conventions)
    window    p - window < t: the last `window` positions, p's own included (sliding_window)
    chunk     t // chunk == p // chunk (Llama 4's attention_chunk_size)
    softcap   and its score s becomes softcap * tanh(s / softcap), s already scaled (Gemma 2)
    scale     s = scale * q.k (None: 1/sqrt(head_dim))

Positions count the sequence's stored tokens from 0 (a worker's left pads are never stored).

Attention sinks (gpt-oss `s_aux`, one logit per query head in the softmax denominator) are not
part of it: the client folds them in from the LSE (out * sigmoid(lse - sink)). A sequence whose
blocks span nodes is attended per node and merged by LSE on the client, and a sink must count
once in that merge; the node cannot tell whether it holds the only extent, the client can.

Pure Python, no torch: the coordinator checks a spec before it places the sequence, and the
node checks it again at its Open (a direct-mode client reaches the node alone).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument

__all__ = ["LayerAttention", "check_layers", "first_visible", "from_messages", "to_messages"]


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention (all off by default: plain causal). window, chunk: 0 = off;
    softcap: 0.0 = off; scale: None = 1/sqrt(head_dim). Raises InvalidArgument on a bad value."""

    window: int = 0
    chunk: int = 0
    softcap: float = 0.0
    scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"attention: {name} must be an int >= 0 (0 = off), got {value!r}")
        cap = self.softcap
        if isinstance(cap, bool) or not isinstance(cap, int | float) or not math.isfinite(cap) or cap < 0:
            raise InvalidArgument(f"attention: softcap must be a finite number >= 0 (0 = off), got {cap!r}")
        object.__setattr__(self, "softcap", float(cap))
        s = self.scale
        if s is not None:
            if isinstance(s, bool) or not isinstance(s, int | float) or not math.isfinite(s) or s <= 0:
                raise InvalidArgument(f"attention: scale must be a finite number > 0, got {s!r}")
            object.__setattr__(self, "scale", float(s))

    @property
    def is_plain(self) -> bool:
        return self == _PLAIN

    @property
    def masks(self) -> bool:
        """Whether it sees fewer keys than causal attention (a window or chunks)."""
        return self.window > 0 or self.chunk > 0

    def first_visible(self, pos: int) -> int:
        """The lowest key position a query at `pos` sees."""
        return first_visible(self.window, self.chunk, pos)


def first_visible(window: int, chunk: int, pos: int) -> int:
    """The lowest key position a query at `pos` sees under a window and chunks (0 = off): one
    definition for the client (which extents a query reaches) and the node (its masks)."""
    lo = 0
    if window:
        lo = max(lo, pos - window + 1)
    if chunk:
        lo = max(lo, pos - pos % chunk)
    return lo


_PLAIN = LayerAttention()


def check_layers(layers: Iterable[LayerAttention] | None, num_layers: int) -> tuple[LayerAttention, ...]:
    """`layers` as a tuple, checked against a model of `num_layers` layers: one entry per layer,
    or none (returns ()). A spec whose every layer is plain is () too: nothing to keep."""
    if layers is None:
        return ()
    got = tuple(layers)
    if not got:
        return ()
    for i, layer in enumerate(got):
        if not isinstance(layer, LayerAttention):
            raise InvalidArgument(f"attention layer {i}: a LayerAttention, got {type(layer).__name__}")
    if len(got) != num_layers:
        raise InvalidArgument(
            f"attention lists {len(got)} layers; the model has {num_layers} (one entry per layer, or none)"
        )
    return () if all(layer.is_plain for layer in got) else got


def to_messages(layers: Sequence[LayerAttention]) -> list[Any]:
    """The `repeated LayerAttention attention` field's messages ([] for none)."""
    from . import pagedkv_pb2 as pb  # the stubs load with the first wire use, not with this module

    out = []
    for layer in layers:
        msg = pb.LayerAttention(window=layer.window, chunk=layer.chunk, softcap=layer.softcap)
        if layer.scale is not None:
            msg.scale = layer.scale
        out.append(msg)
    return out


def from_messages(messages: Iterable[Any], num_layers: int) -> tuple[LayerAttention, ...]:
    """The checked spec of a request's `attention` field (check_layers); InvalidArgument names
    the layer and the field that is wrong."""
    layers = []
    for i, msg in enumerate(messages):
        scale = msg.scale if msg.HasField("scale") else None
        try:
            layers.append(LayerAttention(int(msg.window), int(msg.chunk), float(msg.softcap), scale))
        except InvalidArgument as exc:
            raise InvalidArgument(f"layer {i}: {exc}") from None
    return check_layers(layers, num_layers)
