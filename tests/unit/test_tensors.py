"""Wire encoding of tensors: exact round trips and loud failures on bad bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pagedkv.protos import tensors
from pagedkv.protos.errors import InvalidArgument


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.uint8]
)
def test_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 5, 7) * 100).to(dtype)
    msg = tensors.encode(t)
    assert msg.dtype == tensors.DTYPE_NAMES[dtype]
    assert list(msg.shape) == [3, 5, 7]
    assert len(msg.data) == t.numel() * t.element_size()
    back = tensors.decode(msg)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_bfloat16_bytes_are_the_little_endian_bit_pattern() -> None:
    t = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    assert tensors.encode(t).data == t.view(torch.int16).numpy().astype("<i2").tobytes()


def test_non_contiguous_and_numpy_inputs() -> None:
    t = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    assert torch.equal(tensors.decode(tensors.encode(t)), t)
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    assert torch.equal(tensors.decode(tensors.encode(a)), torch.from_numpy(a))


def test_empty_tensor() -> None:
    t = torch.empty(0, 4)
    back = tensors.decode(tensors.encode(t))
    assert back.shape == (0, 4)


@pytest.mark.parametrize(
    ("dtype", "shape", "nbytes", "match"),
    [
        ("float32", [2, 3], 23, "23 data bytes"),
        ("float32", [2, 3], 25, "25 data bytes"),
        ("float99", [1], 4, "unknown dtype"),
        ("float32", [-1, 4], 16, "negative"),
    ],
)
def test_bad_bytes_raise_invalid_argument(dtype: str, shape: list[int], nbytes: int, match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        tensors.from_bytes(dtype, shape, bytes(nbytes), "q")


def test_chunks_reassemble_exactly() -> None:
    t = torch.randn(2, 3, 1000)
    dtype, shape, data = tensors.to_bytes(t)
    pieces = list(tensors.iter_chunks(data, 1000))
    assert len(pieces) == -(-len(data) // 1000) and all(len(p) <= 1000 for p in pieces)
    acc = tensors.ChunkAssembler(dtype, shape, "kv")
    for p in pieces:
        acc.add(p)
    assert torch.equal(acc.tensor(), t)


def test_assembler_refuses_too_many_or_too_few_bytes() -> None:
    acc = tensors.ChunkAssembler("float32", [4], "kv")
    acc.add(bytes(8))
    with pytest.raises(InvalidArgument, match="declared 16"):
        acc.tensor()
    with pytest.raises(InvalidArgument, match="more than"):
        acc.add(bytes(12))
    with pytest.raises(InvalidArgument, match="limit"):
        tensors.ChunkAssembler("float32", [1000], "kv", max_bytes=100)
