"""A data call's arguments, checked once on the client whatever carries them.

Each constructor turns what the user passed into the values every transport
encodes (contiguous CPU tensors of a wire dtype, int64 token ids, int32 counts) or
raises InvalidArgument naming what is wrong; nothing is sent either way. What only
the node can judge (shapes against its model, sequence ids, layers) is left to it,
so every transport reports it in the node's words.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ...protos import tensors
from ...protos.errors import InvalidArgument
from .. import codec

INT32 = 2**31


class AttendCall(NamedTuple):
    """A decode step (is_prefill_batch False) or a prefill batch at one layer."""

    seq_ids: list[str]
    layer: int
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    token_ids: np.ndarray | None  # int64
    num_tokens: list[int]  # a prefill batch's rows per sequence; a decode's appends (0/1 per row)
    return_block_mass: bool
    is_prefill_batch: bool


class PrefillCall(NamedTuple):
    seq_id: str
    layer: int
    q: Any  # the rpc's own encoding judges these (AttendPrefill has no bulk op)
    k: Any
    v: Any
    token_ids: list[int]
    return_block_mass: bool
    query_position: int | None = None  # queries past the node's tokens (an earlier extent)


class AppendCall(NamedTuple):
    seq_id: str
    token_ids: np.ndarray  # int64, one per token of k and v
    k: torch.Tensor  # [num_layers, n, kv_heads, head_dim]
    v: torch.Tensor


class ReadCall(NamedTuple):
    seq_id: str
    start: int
    end: int | None  # None: to the sequence's end
    out: codec.KVOut | None


class OpenCall(NamedTuple):
    seq_id: str
    token_ids: np.ndarray  # int64
    salt: bytes
    max_cached_tokens: int | None
    attention: Sequence[Any] = ()  # pb.LayerAttention messages (protos/attention.py), or none


def as_cpu(t: Any, what: str) -> torch.Tensor:
    """t as a contiguous CPU tensor of a wire dtype: t itself when it already is one
    that needs no grad (a decode step's q, k, v), else tensors.as_torch's copy."""
    if (
        type(t) is torch.Tensor
        and t.is_cpu
        and not t.requires_grad
        and t.dtype in tensors.DTYPE_NAMES
        and t.is_contiguous()
    ):
        return t
    return tensors.as_torch(t, what)


def token_array(token_ids: codec.TokenIds | None, *, strict: bool) -> np.ndarray:
    """Token ids as int64. strict (an open): plain ints only (a list of them, or an
    integer array or tensor), as the Open rpc's message judges them; else any value
    int() takes, as the append and attend rpcs always did. InvalidArgument otherwise."""
    if token_ids is None:
        return np.empty(0, dtype="<i8")
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.numpy(force=True)
    if isinstance(token_ids, np.ndarray):
        if strict and (token_ids.ndim != 1 or token_ids.dtype.kind not in "iu"):
            kind = f"an array of {token_ids.dtype}, {token_ids.ndim} dims"
            raise InvalidArgument(f"token ids must be ints in the int64 range: {kind}")
        if token_ids.dtype.kind == "u" and token_ids.size and int(token_ids.max()) >= 2**63:
            raise InvalidArgument("token ids must be ints in the int64 range: one is over it")
        if token_ids.dtype.kind in "iu":
            return token_ids.reshape(-1).astype("<i8", copy=False)
    ids = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
    if strict and not set(map(type, ids)) <= {int}:
        kinds = sorted({type(i).__name__ for i in ids} - {"int"})
        raise InvalidArgument(f"token ids must be ints in the int64 range, got {', '.join(kinds)}")
    try:
        return np.asarray(codec.token_list(ids), dtype="<i8")
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"token ids must be ints in the int64 range: {exc}") from None


def attend_call(
    seq_ids: Sequence[str],
    layer: int,
    q: Any,
    k: Any,
    v: Any,
    token_ids: codec.TokenIds | None,
    num_tokens: Sequence[int] | None,
    return_block_mass: bool,
    appends: Sequence[bool] | None = None,
) -> AttendCall:
    """num_tokens None: a decode step (appends: which rows append, None: all); else a
    prefill batch's rows per sequence."""
    ids = list(seq_ids) if type(seq_ids) is not list else seq_ids
    if not all(type(s) is str for s in ids):
        raise InvalidArgument("sequence ids must be str")
    try:
        layer = operator.index(layer)  # an int or a numpy integer, not a float
    except TypeError:
        raise InvalidArgument(f"layer must be an int, got {type(layer).__name__}") from None
    counts: list[int] = [] if appends is None else [int(bool(a)) for a in appends]
    if num_tokens is not None:
        counts = [int(n) for n in num_tokens]
        if any(not -INT32 <= n < INT32 for n in counts):
            raise InvalidArgument(f"num_tokens {counts} outside int32")
    tokens = None if token_ids is None else token_array(token_ids, strict=False)
    return AttendCall(
        ids,
        layer,
        as_cpu(q, "q"),
        None if k is None else as_cpu(k, "k"),
        None if v is None else as_cpu(v, "v"),
        tokens,
        counts,
        bool(return_block_mass),
        num_tokens is not None,
    )


def append_call(seq_id: str, token_ids: codec.TokenIds, k: Any, v: Any) -> AppendCall:
    k, v = tensors.as_torch(k, "k"), tensors.as_torch(v, "v")
    if k.shape != v.shape or k.dtype != v.dtype:
        raise InvalidArgument(f"k {tuple(k.shape)} {k.dtype} and v {tuple(v.shape)} {v.dtype} differ")
    if k.dim() != 4:
        raise InvalidArgument(f"k must be [num_layers, n, kv_heads, head_dim], got shape {tuple(k.shape)}")
    if k.dtype not in tensors.DTYPE_NAMES:
        raise InvalidArgument(f"k has unsupported dtype {k.dtype}")
    ids = token_array(token_ids, strict=False)
    if len(ids) != k.shape[1]:
        shape = tuple(k.shape)
        raise InvalidArgument(f"k/v of shape {shape} hold {shape[1]} tokens for {len(ids)} token ids")
    return AppendCall(seq_id, ids, k, v)


def read_call(seq_id: str, start: int, end: int | None, out: Any) -> ReadCall:
    if start < 0 or (end is not None and end < 0):
        raise InvalidArgument(f"range [{start}, {end}) outside the sequence {seq_id!r}")
    return ReadCall(seq_id, start, end, codec.check_kv_out(out))


def open_call(
    seq_id: str,
    token_ids: codec.TokenIds,
    salt: bytes,
    max_cached_tokens: int | None,
    attention: Sequence[Any] = (),
) -> OpenCall:
    if not isinstance(seq_id, str):
        raise InvalidArgument(f"sequence id must be a str, got {type(seq_id).__name__}")
    limit = max_cached_tokens
    if limit is not None and (type(limit) is not int or not 0 <= limit < 2**63):
        raise InvalidArgument(f"max_cached_tokens must be an int in [0, 2**63), got {limit!r}")
    return OpenCall(seq_id, token_array(token_ids, strict=True), bytes(salt), limit, attention)
