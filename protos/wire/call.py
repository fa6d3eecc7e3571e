"""The bulk channel's request and reply bodies, encoded and decoded in one place
(spec: docs/bulk-protocol.md): the per-step CALL (ATTEND, ATTEND_PREFILL_BATCH),
its REPLY, and OPEN. The client encodes what the node decodes with the same code.

Encoding never judges the request's meaning (the engine does, for every
transport); it raises Unencodable for a value the frame has no room for.
Decoding treats every byte as wire input: InvalidArgument naming what is wrong.
"""

from __future__ import annotations

import itertools
import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from ..errors import InvalidArgument
from ..tensors import DTYPE_NAMES, TORCH_DTYPES, check_dims, tensor_at
from .frame import (
    CALL,
    FLAG_BLOCK_MASS,
    FLAG_K,
    FLAG_V,
    MAX_CALL_BYTES,
    MAX_TEXT_BYTES,
    OP_ATTEND,
    OP_OPEN,
    REPLY,
    REPLY_SIZE,
    TENSOR,
    Frame,
    ProtocolError,
    pack_tensor,
    pad,
    unpack_tensor,
)


class Unencodable(InvalidArgument):
    """A value the frame has no room for (an id over 64 KiB, a count outside int32,
    a body over MAX_CALL_BYTES); nothing was sent."""


def byte_view(t: torch.Tensor) -> memoryview:
    """A flat writable byte view of a contiguous CPU tensor (any dtype, bfloat16 too)."""
    return t.reshape(-1).view(torch.uint8).numpy().data


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class IdsMemo:
    """The last batch of sequence ids and their CALL section (u16 lengths, then the
    UTF-8): a decode loop sends the same batch at every layer of every step, so each
    side keeps one entry. Thread-safe (one tuple, swapped whole)."""

    def __init__(self) -> None:
        self._last: tuple[list[str], bytes] = ([], b"")

    def encode(self, seq_ids: Sequence[str]) -> bytes:
        """The ids' section; Unencodable past 65535 bytes an id or for an id that is
        not a str. Compared by value (a caller that changes its list gets a fresh one)."""
        last = self._last
        is_list = type(seq_ids) is list
        if is_list and last[0] == seq_ids and seq_ids:
            return last[1]
        try:
            joined = "".join(seq_ids)
            if joined.isascii():  # one encode; character lengths are byte lengths
                lens, id_text = list(map(len, seq_ids)), joined.encode()
            else:
                ids = [s.encode() for s in seq_ids]
                lens, id_text = list(map(len, ids)), b"".join(ids)
            section = struct.pack(f"<{len(lens)}H", *lens) + id_text
        except (TypeError, AttributeError, UnicodeEncodeError, struct.error) as exc:
            raise Unencodable(f"sequence ids not expressible on the bulk channel: {exc}") from None
        if is_list:
            self._last = (list(seq_ids), section)
        return section

    def decode(self, raw: bytes, num_seqs: int) -> list[str]:
        """A new list of the section's ids (the caller's to keep); InvalidArgument
        when the section is malformed. Compared by the section's bytes."""
        last = self._last
        if raw == last[1] and num_seqs == len(last[0]) and num_seqs:
            return list(last[0])
        ids = _seq_ids(raw, num_seqs)
        self._last = (ids, raw)
        return list(ids)


def _seq_ids(raw: bytes, num_seqs: int) -> list[str]:
    """num_seqs u16 lengths, then the ids' UTF-8 back to back (one decode and slices)."""
    ids_len = len(raw)
    if 2 * num_seqs > ids_len:
        raise InvalidArgument(f"bulk call: {num_seqs} sequence ids cannot fit in {ids_len} bytes")
    ends = list(itertools.accumulate(struct.unpack_from(f"<{num_seqs}H", raw, 0)))
    extra = ids_len - 2 * num_seqs - (ends[-1] if ends else 0)
    if extra < 0:
        raise InvalidArgument(f"bulk call: {num_seqs} sequence ids overrun their {ids_len} bytes")
    if extra:
        raise InvalidArgument(f"bulk call: {extra} bytes after the {num_seqs} sequence ids")
    text_bytes = raw[2 * num_seqs :]
    starts = [0, *ends][:-1]
    try:
        if text_bytes.isascii():  # byte offsets are character offsets
            text = text_bytes.decode("ascii")
            return [text[a:b] for a, b in zip(starts, ends, strict=True)]
        return [text_bytes[a:b].decode("utf-8") for a, b in zip(starts, ends, strict=True)]
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"bulk call: a sequence id is not UTF-8: {exc}") from None


# -- CALL -------------------------------------------------------------------------


class Call(NamedTuple):
    """A decoded ATTEND* body: the rpc's arguments, tensors viewing the body."""

    layer: int
    want_mass: bool
    seq_ids: list[str]
    counts: list[int]  # a prefill batch's rows per sequence; a decode's appends (0/1 per row)
    token_ids: list[int] | None
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None


def encode_call_body(
    seq_ids: Sequence[str],
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    token_ids: np.ndarray | None,
    num_tokens: Sequence[int],
    mass: bool,
    memo: IdsMemo,
) -> tuple[bytes, int]:
    """(CALL + descriptors + ids + counts + sequence ids, the whole body's length
    with the tensors at their ALIGN offsets). token_ids: int64 ids (validated by the
    caller). Unencodable for a value the frame cannot carry."""
    id_bytes = memo.encode(seq_ids)
    tokens = b"" if token_ids is None else token_ids.astype("<i8", copy=False).tobytes()
    try:
        counts = struct.pack(f"<{len(num_tokens)}i", *num_tokens) if num_tokens else b""
        flags = (FLAG_BLOCK_MASS if mass else 0) | (0 if k is None else FLAG_K) | (0 if v is None else FLAG_V)
        call = CALL.pack(layer, flags, len(seq_ids), len(num_tokens), len(tokens) // 8, len(id_bytes))
        descs = [pack_tensor(DTYPE_NAMES[t.dtype], tuple(t.shape)) for t in (q, k, v) if t is not None]
    except (TypeError, ValueError, OverflowError, KeyError, struct.error) as exc:
        raise Unencodable(f"not expressible on the bulk channel: {exc}") from None
    head = b"".join([call, *descs, tokens, counts, id_bytes])
    size = len(head)
    for t in (q, k, v):
        if t is not None:
            size += pad(size) + nbytes(t)
    if size > MAX_CALL_BYTES:
        raise Unencodable(f"a {size}-byte call exceeds the channel's {MAX_CALL_BYTES}")
    return head, size


def call_parts(head: bytes, tensors: Sequence[torch.Tensor]) -> list[bytes | memoryview]:
    """The body's pieces to send after the frame: head, then each tensor's bytes at
    its ALIGN offset."""
    parts: list[bytes | memoryview] = [head]
    at = len(head)
    for t in tensors:
        parts.append(bytes(pad(at)))
        parts.append(byte_view(t))
        at += pad(at) + nbytes(t)
    return parts


def decode_call(op: int, mv: memoryview, memo: IdsMemo) -> Call:
    """The CALL body in `mv`; InvalidArgument naming what is wrong when its sections
    do not add up to its length."""
    size = len(mv)

    def need(at: int, n: int, what: str) -> None:
        if at + n > size:
            raise InvalidArgument(f"bulk call: {what} runs past the {size}-byte body")

    need(0, CALL.size, "the CALL header")
    layer, flags, num_seqs, num_counts, num_tokens, ids_len = CALL.unpack_from(mv, 0)
    if op == OP_ATTEND and num_counts and num_counts != num_seqs:  # a decode's counts: per-row appends
        raise InvalidArgument(f"bulk attend: {num_counts} append flags for {num_seqs} sequences")
    names = ["q"] + ["k"] * bool(flags & FLAG_K) + ["v"] * bool(flags & FLAG_V)
    at, descs = CALL.size, []
    for name in names:
        need(at, TENSOR.size, f"the {name} descriptor")
        try:
            descs.append(unpack_tensor(mv, at))
        except ProtocolError as exc:
            raise InvalidArgument(f"bulk call: {name}: {exc}") from None
        at += TENSOR.size
    need(at, 8 * num_tokens + 4 * num_counts + ids_len, "the token ids, counts and sequence ids")
    tokens = np.frombuffer(mv, "<i8", num_tokens, at).tolist() if num_tokens else []
    at += 8 * num_tokens
    counts = np.frombuffer(mv, "<i4", num_counts, at).tolist() if num_counts else []
    at += 4 * num_counts
    seq_ids = memo.decode(bytes(mv[at : at + ids_len]), num_seqs)
    at += ids_len
    views: list[torch.Tensor] = []
    for name, (dtype, shape) in zip(names, descs, strict=True):
        at += pad(at)
        check_dims(shape, f"bulk call: {name}")
        tdtype = TORCH_DTYPES[dtype]
        size_t = math.prod(shape) * tdtype.itemsize
        need(at, size_t, f"{name} {list(shape)} {dtype}")
        views.append(tensor_at(mv, at, tdtype, shape))
        at += size_t
    if at != size:
        raise InvalidArgument(f"bulk call: {size} body bytes, its sections take {at}")
    q, k, v = views[0], (views[1] if flags & FLAG_K else None), None
    if flags & FLAG_V:
        v = views[-1]
    return Call(layer, bool(flags & FLAG_BLOCK_MASS), seq_ids, counts, tokens or None, q, k, v)


# -- REPLY ------------------------------------------------------------------------


def encode_reply(
    op: int, request_id: int, descs: Sequence[tuple[str, tuple[int, ...]]], placement: int, inline_bytes: int
) -> bytes:
    """FRAME + REPLY for result tensors (dtype name, shape) each; their bytes follow
    (inline_bytes of them) unless placed in the region. ValueError for a shape the
    descriptor cannot carry."""
    return Frame(op, request_id, payload_len=REPLY_SIZE + inline_bytes).pack() + reply_body(descs, placement)


def reply_body(descs: Sequence[tuple[str, tuple[int, ...]]], placement: int) -> bytes:
    """REPLY: the count, the placement byte and three descriptors (absent ones zero)."""
    packed = [pack_tensor(dtype, shape) for dtype, shape in descs]
    return REPLY.pack(len(descs), placement) + b"".join(packed) + bytes(TENSOR.size * (3 - len(descs)))


def decode_reply(
    head: bytes | bytearray | memoryview,
) -> tuple[int, list[tuple[torch.dtype, tuple[int, ...]]]]:
    """(placement, [(dtype, shape)] of out, lse and block_mass if sent) of a REPLY;
    ProtocolError when malformed."""
    num, placement = REPLY.unpack_from(head, 0)
    if not 2 <= num <= 3:
        raise ProtocolError(f"attend reply with {num} tensors")
    descs = []
    for i in range(num):
        dtype, shape = unpack_tensor(head, REPLY.size + i * TENSOR.size)
        descs.append((TORCH_DTYPES[dtype], shape))
    return placement, descs


def decode_result_head(q: torch.Tensor, placement: int) -> bytes | None:
    """The REPLY a plain call with this q gets (out in q's shape and dtype, lse float32
    per row and head, no block mass); None when q cannot be described. Lets a client
    prepare the results while the node computes and only compare the head after."""
    if q.dtype not in DTYPE_NAMES:
        return None
    try:
        return reply_body(
            [(DTYPE_NAMES[q.dtype], tuple(q.shape)), ("float32", tuple(q.shape[:-1]))], placement
        )
    except ValueError:
        return None


# -- OPEN -------------------------------------------------------------------------


def encode_open(
    request_id: int, seq_id: str, ids: np.ndarray, salt: bytes, max_cached_tokens: int | None
) -> bytes:
    """FRAME + token ids (int64, validated by the caller) + salt; Unencodable for a
    value the frame cannot carry."""
    try:
        text_len = len(seq_id.encode())
    except (AttributeError, UnicodeEncodeError) as exc:
        raise Unencodable(f"sequence id not expressible on the bulk channel: {exc}") from None
    if text_len > MAX_TEXT_BYTES:
        raise Unencodable(f"a {text_len}-byte sequence id exceeds the frame's {MAX_TEXT_BYTES}")
    raw = ids.astype("<i8", copy=False).tobytes()
    if len(raw) + len(salt) > MAX_CALL_BYTES:
        raise Unencodable(f"an open of {len(ids)} tokens exceeds the channel's cap")
    limit = 0 if max_cached_tokens is None else max_cached_tokens + 1
    frame = Frame(
        OP_OPEN, request_id, start=limit, end=len(ids), text=seq_id, payload_len=len(raw) + len(salt)
    )
    return frame.pack() + raw + salt


class Open(NamedTuple):
    seq_id: str
    token_ids: np.ndarray
    salt: bytes
    max_cached_tokens: int | None


def decode_open(f: Frame, payload: bytes | bytearray) -> Open:
    """An OPEN's arguments from its frame and payload; InvalidArgument when the
    payload cannot hold the token ids the frame declares."""
    num_ids = f.end
    if 8 * num_ids > len(payload):
        raise InvalidArgument(
            f"bulk open: {len(payload)} payload bytes cannot hold {num_ids} token ids ({8 * num_ids} bytes)"
        )
    ids = np.frombuffer(payload, "<i8", num_ids)
    return Open(f.text, ids, bytes(payload[8 * num_ids :]), f.start - 1 if f.start else None)
