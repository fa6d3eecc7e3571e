"""Which attention mask a transformers model asks for, in terms the node computes.

transformers builds each forward's masks from a mask function (causal_mask_function, or
and_masks of an overlay and it) and hands every layer the mask of its kind. In node mode none
is built: the node applies the sequence's attention spec itself (protos/attention.py). What is
checked instead, per forward and per kind of mask, is that the function is one the node
computes, and which:

    mask function                                          kind          node spec of the layer
    causal_mask_function                                   None          plain
    and_masks(sliding_window_overlay(W), causal)           ("window", W) window = W
    and_masks(chunked_overlay(C, left_padding), causal)    ("chunk", C)  chunk = C

The structure is read from the closures (the functions' names), the size by evaluating the
function at the pairs of positions around its boundaries, against each size the model's config
declares: a change of meaning in a later transformers fails the probe, and is refused, instead
of being computed differently. Anything else (packed sequences, bidirectional or block masks,
or_masks) is refused with the pieces named. The plain causal mask costs one identity check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers.masking_utils import causal_mask_function

MaskKind = tuple[str, int]  # ("window", W) or ("chunk", C); None is plain causal

_OVERLAYS = {"sliding_window_overlay": "window", "chunked_overlay": "chunk"}


def describe(kind: MaskKind | None) -> str:
    if kind is None:
        return "plain causal attention"
    what, size = kind
    if what == "both":
        return "a sliding window and chunks"
    return f"a sliding window of {size} tokens" if what == "window" else f"chunked attention of {size} tokens"


def recognise(
    mask_function: Any, windows: Iterable[int], chunks: Iterable[int], attention_mask: Any
) -> MaskKind | None | str:
    """The kind of mask `mask_function` makes (None: plain causal), or why the node cannot apply
    it (a str). `windows`, `chunks`: the sizes the config declares; `attention_mask`: the
    forward's 2-D padding mask (chunks count from a row's first real token)."""
    if mask_function is causal_mask_function:
        return None
    parts = _and_parts(mask_function)
    names = [_name(f) for f in parts] if parts is not None else []
    overlays = [(f, _OVERLAYS[n]) for f, n in zip(parts or (), names, strict=False) if n in _OVERLAYS]
    if parts is None or len(parts) != 2 or causal_mask_function not in parts or len(overlays) != 1:
        pieces = " + ".join(_flat_names(mask_function)) or repr(mask_function)
        return f"the attention mask {pieces} is not one the node applies (causal, a sliding window or chunks)"
    what = overlays[0][1]
    sizes = sorted(set(windows if what == "window" else chunks))
    offset = _left_pads(attention_mask) if what == "chunk" else 0
    found = [n for n in sizes if _probe(mask_function, what, n, offset)]
    if len(found) != 1:
        declared = ", ".join(map(str, sizes)) or "none"
        return (
            f"the attention mask {' + '.join(names)} selects other keys than any {what} the model's config "
            f"declares ({declared}): the config and the model disagree"
        )
    return what, found[0]


def _and_parts(fn: Any, depth: int = 0) -> list[Callable] | None:
    """The functions an and_masks(...) intersects, flattened; None when an or_masks or
    anything else that is not a plain function sits inside."""
    name = getattr(fn, "__qualname__", "")
    if not name.startswith("and_masks."):
        return None if name.startswith("or_masks.") else [fn]
    if depth > 4:
        return None
    out: list[Callable] = []
    for inner in _closure(fn).get("mask_functions", ()):
        got = _and_parts(inner, depth + 1)
        if got is None:
            return None
        out += got
    return out


def _flat_names(fn: Any, depth: int = 0) -> list[str]:
    """Every named piece of a combined mask function (for a refusal's message)."""
    name = getattr(fn, "__qualname__", "")
    inner = _closure(fn).get("mask_functions")
    if inner and depth < 4:
        return [n for f in inner for n in _flat_names(f, depth + 1)]
    return [_name(fn)] if name else []


def _name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", "")).split(".<locals>")[0]


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    out = {}
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # a closure variable not yet bound
            continue
    return out


def _left_pads(attention_mask: Any) -> int:
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2 or not attention_mask.numel():
        return 0
    return int((attention_mask[0].long().cumsum(-1) == 0).sum())


def _probe(mask_function: Any, what: str, size: int, offset: int) -> bool:
    """Whether the function agrees with the node's rule for `size` at the pairs (query, key)
    on either side of every boundary: the window's far edge, the chunk's start and end, and
    causality. Positions are row 0's, `offset` its left pads."""
    n = size
    if what == "window":  # visible: p - n < t <= p
        pairs = [(n - 1, 0), (n, 0), (n, 1), (n, n), (n, n + 1), (2 * n + 3, n + 4), (2 * n + 3, n + 3)]
        want = [p - n < t <= p for p, t in pairs]
    else:  # visible: t <= p and t // n == p // n
        pairs = [
            (n - 1, 0),
            (n, n - 1),
            (n, n),
            (n + 1, n),
            (n, n + 1),
            (2 * n + 2, n + 5),
            (2 * n + 2, 2 * n),
        ]
        want = [t <= p and t // n == p // n for p, t in pairs]
    q = torch.tensor([p + offset for p, _ in pairs])
    kv = torch.tensor([t + offset for _, t in pairs])
    zero = torch.zeros_like(q)
    try:
        got = mask_function(zero, zero, q, kv)
    except Exception:  # a function that does not take index tensors: not one of transformers'
        return False
    return isinstance(got, torch.Tensor) and got.shape == q.shape and got.tolist() == want
