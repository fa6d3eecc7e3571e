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


@pytest.mark.parametrize("chunk_bytes", [1, 999, 1000, 10**6])
def test_kv_slabs_carry_whole_tokens_and_reassemble_exactly(chunk_bytes: int) -> None:
    k, v = torch.randn(3, 37, 2, 8), torch.randn(3, 37, 2, 8)  # 384 bytes per token (K and V)
    slabs = list(tensors.kv_slabs(k, v, chunk_bytes))
    per_slab = max(1, chunk_bytes // 384)
    assert [t for t, _ in slabs] == [min(per_slab, 37 - a) for a in range(0, 37, per_slab)]
    reader = tensors.SlabReader("float32", [2, 3, 37, 2, 8])
    got = [reader.add(t, data) for t, data in slabs]
    reader.finish()
    assert torch.equal(torch.cat([g[0] for g in got], 1), k) and torch.equal(
        torch.cat([g[1] for g in got], 1), v
    )


def test_slab_reader_refuses_wrong_counts() -> None:
    reader = tensors.SlabReader("float32", [2, 1, 2, 1, 4])  # 32 bytes per token
    with pytest.raises(InvalidArgument, match="31 data bytes"):
        reader.add(1, bytes(31))
    reader.add(1, bytes(32))
    with pytest.raises(InvalidArgument, match="sent 1 tokens, its header declared 2"):
        reader.finish()
    with pytest.raises(InvalidArgument, match="more than the 2 tokens"):
        reader.add(2, bytes(64))
    with pytest.raises(InvalidArgument, match="not \\[2, layers"):
        tensors.SlabReader("float32", [3, 1, 2, 1, 4])
