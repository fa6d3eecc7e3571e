"""Tensors on the wire: raw little-endian bytes plus a dtype name and a shape.

One encoding for every side (client and node): `Tensor {dtype, shape, data}`,
row-major, no per-element encoding. bfloat16 has no numpy dtype, so its bytes
are taken through an int16 view. Decoding validates before it touches the bytes:
an unknown dtype, a negative dimension or `len(data) != prod(shape) * itemsize`
raises InvalidArgument naming the field.

KV ranges (Append, ReadKV) travel as streams of whole-token slabs of ~CHUNK_BYTES
(`kv_slabs` / `SlabReader`); unary messages are capped at MAX_MESSAGE_BYTES on
both ends (`MESSAGE_SIZE_OPTIONS`).
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from . import pagedkv_pb2 as pb
from .errors import InvalidArgument

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STREAM_THRESHOLD_BYTES = 4 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
MESSAGE_SIZE_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}
# torch dtypes numpy cannot hold, carried as a same-width integer view.
_BIT_VIEWS = {torch.bfloat16: torch.int16}
# The numpy dtype holding each wire dtype's bytes (bfloat16: as int16, viewed back).
NUMPY_DTYPES = {t: torch.empty(0, dtype=_BIT_VIEWS.get(t, t)).numpy().dtype for t in TORCH_DTYPES.values()}

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("pagedkv's wire encoding assumes a little-endian host")

# Decoding without a copy wraps an immutable `bytes`; torch warns once per process
# that the tensor is read-only. The node only reads request tensors, so consume
# that one warning here instead of printing it on the first request.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0\0\0\0", dtype=torch.uint8)


def tensor_at(buf: Any, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of dtype and shape viewing buf's bytes from offset (a buffer or a uint8
    numpy array; in bounds, the caller checked). Through numpy: several times cheaper
    to make than torch slices and views, which matters on the per-call data path."""
    arr = np.frombuffer(buf, NUMPY_DTYPES[dtype], math.prod(shape), offset).reshape(shape)
    t = torch.from_numpy(arr)
    return t if t.dtype == dtype else t.view(dtype)


def itemsize(dtype: str) -> int:
    if dtype not in TORCH_DTYPES:
        raise InvalidArgument(f"unknown dtype {dtype!r}; one of {sorted(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype].itemsize


def as_torch(t: Any, what: str = "tensor") -> torch.Tensor:
    """A contiguous CPU torch tensor from a torch tensor or numpy array."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    if not isinstance(t, torch.Tensor):
        raise InvalidArgument(f"{what} must be a torch tensor or numpy array, got {type(t).__name__}")
    if t.dtype not in DTYPE_NAMES:
        raise InvalidArgument(f"{what} has unsupported dtype {t.dtype}")
    return t.detach().to("cpu").contiguous()


def byte_view(t: Any, what: str = "tensor") -> tuple[str, list[int], memoryview]:
    """(dtype name, shape, a flat byte view) of a tensor: no copy when it is
    already a contiguous CPU tensor. The view keeps the tensor alive."""
    t = as_torch(t, what)
    name = DTYPE_NAMES[t.dtype]
    view = t.view(_BIT_VIEWS[t.dtype]) if t.dtype in _BIT_VIEWS else t
    return name, list(t.shape), memoryview(view.numpy().reshape(-1).view(np.uint8))


def to_bytes(t: Any, what: str = "tensor") -> tuple[str, list[int], bytes]:
    """(dtype name, shape, raw little-endian bytes) of a tensor. One copy."""
    name, shape, view = byte_view(t, what)
    return name, shape, view.tobytes()


def encode(t: Any, what: str = "tensor") -> pb.Tensor:
    dtype, shape, data = to_bytes(t, what)
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


# A dimension past int32, or a shape whose non-zero dimensions multiply past this
# many elements, is refused: even with a zero dimension (no bytes at all) torch's
# strides and numpy's sizes overflow on such shapes.
MAX_DIM = 2**31 - 1
MAX_ELEMENTS = 2**48


def _check_shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(f"{what}: negative dimension in shape {dims}")
    return check_dims(dims, what)


def check_dims(dims: tuple[int, ...], what: str) -> tuple[int, ...]:
    """dims, or InvalidArgument when a dimension or the shape is too large to make
    a tensor of (a zero-element shape included)."""
    if any(d > MAX_DIM for d in dims) or math.prod(d for d in dims if d) > MAX_ELEMENTS:
        raise InvalidArgument(f"{what}: shape {list(dims)} too large (dimensions up to {MAX_DIM})")
    return dims


def expected_bytes(dtype: str, shape: Sequence[int], what: str = "tensor") -> int:
    dims = _check_shape(shape, what)
    return math.prod(dims) * itemsize(dtype)


def from_bytes(
    dtype: str, shape: Sequence[int], data: bytes | bytearray, what: str = "tensor", *, copy: bool = True
) -> torch.Tensor:
    """The tensor held by `data`. Raises InvalidArgument when the bytes do not
    match dtype and shape. copy=False wraps `data` without copying: the result
    is read-only in spirit when `data` is an immutable `bytes` (do not write it)."""
    if dtype not in TORCH_DTYPES:
        raise InvalidArgument(f"{what}: unknown dtype {dtype!r}; one of {sorted(TORCH_DTYPES)}")
    dims = _check_shape(shape, what)
    tdtype = TORCH_DTYPES[dtype]
    want = math.prod(dims) * tdtype.itemsize
    if len(data) != want:
        raise InvalidArgument(
            f"{what}: {len(data)} data bytes for dtype {dtype} and shape {list(dims)} (expected {want})"
        )
    if want == 0:
        return torch.empty(dims, dtype=tdtype)
    t = torch.frombuffer(data, dtype=tdtype).view(dims)
    return t.clone() if copy else t


def decode(msg: pb.Tensor, what: str = "tensor", *, copy: bool = True) -> torch.Tensor:
    return from_bytes(msg.dtype, msg.shape, msg.data, what, copy=copy)


def tokens_per_chunk(bytes_per_token: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Whole tokens per streamed message (at least one)."""
    if chunk_bytes <= 0:
        raise InvalidArgument(f"chunk_bytes must be positive, got {chunk_bytes}")
    return max(1, chunk_bytes // max(1, bytes_per_token))


def kv_slabs(k: torch.Tensor, v: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[int, bytes]]:
    """(num_tokens, bytes of stack(k, v)[:, :, a:b]) for consecutive token ranges of
    k, v [num_layers, n, kv_heads, head_dim]: ~chunk_bytes each, whole tokens, at
    least one slab. Only slab-sized buffers are made."""
    n = k.shape[1]
    per_token = 2 * k[:, :1].numel() * k.element_size()
    step = tokens_per_chunk(per_token, chunk_bytes)
    for a in range(0, max(n, 1), step):
        b = min(n, a + step)
        yield b - a, byte_view(torch.stack((k[:, a:b], v[:, a:b])), "kv")[2].tobytes()


class SlabReader:
    """Checks a token-slab stream against its header ([2, layers, n, heads, dim])
    and wraps each slab without copying. A stream that sends more tokens than
    declared, a slab whose byte count does not match its token count, or a
    stream that ends early raises InvalidArgument naming the numbers."""

    def __init__(self, dtype: str, shape: Sequence[int], what: str = "kv") -> None:
        dims = _check_shape(shape, what)
        if len(dims) != 5 or dims[0] != 2:
            raise InvalidArgument(f"{what}: shape {list(dims)} is not [2, layers, tokens, heads, dim]")
        self.dtype, self.what = dtype, what
        self.num_tokens = dims[2]
        self.token_shape = (dims[1], dims[3], dims[4])
        itemsize(dtype)
        self.received = 0

    def add(self, num_tokens: int, data: bytes) -> torch.Tensor:
        """The slab [2, layers, num_tokens, heads, dim] (wrapping `data`)."""
        if num_tokens <= 0 and self.num_tokens:
            raise InvalidArgument(f"{self.what}: a slab must carry at least one token, got {num_tokens}")
        if self.received + num_tokens > self.num_tokens:
            raise InvalidArgument(
                f"{self.what}: stream sent more than the {self.num_tokens} tokens its header declared"
            )
        layers, heads, dim = self.token_shape
        slab = from_bytes(self.dtype, [2, layers, num_tokens, heads, dim], data, self.what, copy=False)
        self.received += num_tokens
        return slab

    def finish(self) -> None:
        if self.received != self.num_tokens:
            raise InvalidArgument(
                f"{self.what}: stream sent {self.received} tokens, its header declared {self.num_tokens}"
            )
