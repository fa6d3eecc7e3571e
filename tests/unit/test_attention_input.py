"""What paged attention refuses (each malformed argument, with the message naming it) and how it
picks its backend (the environment, a failed build falling back to torch, the portable build)."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from attention_reference import (
    BACKENDS,
    check_decode,
    make_scenario,
    require_backend,
)

from pagedkv.cache_node import attention
from pagedkv.cache_node.attention import (
    cpu_kernel,
    kernel_info,
    paged_decode,
    paged_prefill,
)
from pagedkv.protos import native_build
from pagedkv.protos.errors import FailedPrecondition, InvalidArgument


@pytest.fixture(scope="module", autouse=True)
def _kernel_built() -> None:
    kernel_info()  # build once up front so the first test's time is not the compile


# --------------------------------------------------------------------------- bad input


_BAD = make_scenario([10, 20], num_kv_heads=2, block_size=4, head_dim=16, seed=1)  # 8 blocks + 3 spare


def _decode_args(**overrides):
    args = dict(
        q=torch.randn(2, 4, 16),
        k_cache=_BAD.k_cache,
        v_cache=_BAD.v_cache,
        block_tables=_BAD.tables,
        seq_lens=_BAD.seq_lens,
    )
    args.update(overrides)
    return args


def _bad_table(block_id: int) -> torch.Tensor:
    table = _BAD.tables.clone()
    table[1, 4] = block_id  # logical block 4 of the 20-token sequence: in use
    return table


BAD_DECODE: dict[str, tuple[dict[str, Any], str]] = {
    "q 2-d": (dict(q=torch.randn(2, 64)), "must be 3-d"),
    "q int": (dict(q=torch.ones(2, 4, 16, dtype=torch.int32)), "q dtype"),
    "q float64": (dict(q=torch.randn(2, 4, 16, dtype=torch.float64)), "q dtype"),
    "q dtype != cache": (dict(q=torch.randn(2, 4, 16, dtype=torch.float16)), "dtype mismatch"),
    "cache shapes differ": (dict(k_cache=_BAD.k_cache[:5]), "k_cache and v_cache must both be"),
    "cache 3-d": (dict(k_cache=torch.zeros(11, 2, 64)), "k_cache and v_cache must both be"),
    "heads": (dict(q=torch.randn(2, 3, 16)), "multiple of kv heads"),
    "head_dim": (dict(q=torch.randn(2, 4, 8)), "head_dim mismatch"),
    "table batch": (dict(block_tables=torch.zeros(3, 5, dtype=torch.int32)), "block_tables must be"),
    "table float": (dict(block_tables=torch.zeros(2, 5)), "int32 or int64"),
    "seq_lens shape": (dict(seq_lens=torch.tensor([3])), "seq_lens must be"),
    "seq_len 0": (dict(seq_lens=torch.tensor([0, 5])), r"seq_lens\[0\] = 0"),
    "seq_len > capacity": (dict(seq_lens=torch.tensor([5, 1000])), r"seq_lens\[1\] = 1000 outside"),
    "block id too big": (dict(block_tables=_bad_table(999)), r"block_tables\[1, 4\] = 999"),
    "block id negative": (dict(block_tables=_bad_table(-3)), r"block_tables\[1, 4\] = -3"),
    "scale nan": (dict(scale=math.nan), "scale"),
    "q not a tensor": (dict(q=[[1.0]]), "q must be a torch.Tensor"),
    "zero query heads": (dict(q=torch.randn(2, 0, 16)), "empty dimension"),
    "seq_lens strings": (dict(seq_lens=["a", "b"]), "seq_lens must be an integer tensor"),
    "backend name": (dict(backend="cuda-graphs"), "backend"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BAD_DECODE))
def test_decode_rejects_bad_input(backend: str, case: str) -> None:
    require_backend(backend)
    overrides, message = BAD_DECODE[case]
    args = _decode_args(**overrides)
    args.setdefault("backend", backend)
    with pytest.raises(InvalidArgument, match=message):
        paged_decode(**args)


def test_decode_rejects_non_contiguous_cache() -> None:
    args = _decode_args()
    k = args["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)
    with pytest.raises(InvalidArgument, match="contiguous"):
        paged_decode(**{**args, "k_cache": k})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(context_len=5), r"n \(8\) <= context_len \(5\)"),
        (dict(context_len=99), "capacity"),
        (dict(context_len=True), "context_len must be an int"),
        (dict(block_table=torch.zeros(2, 5, dtype=torch.int32)), "1-d"),
        (dict(block_table=torch.tensor([0, 1, 50, 2, 3])), r"block_table\[2\] = 50"),
        (dict(q=torch.randn(8, 4)), "3-d"),
    ],
)
def test_prefill_rejects_bad_input(overrides: dict, message: str) -> None:
    sc = make_scenario([20], num_kv_heads=2, block_size=4, head_dim=16, seed=1)
    args = dict(
        q=torch.randn(8, 4, 16),
        k_cache=sc.k_cache,
        v_cache=sc.v_cache,
        block_table=sc.tables[0],
        context_len=20,
    )
    args.update(overrides)
    with pytest.raises(InvalidArgument, match=message):
        paged_prefill(**args)


# --------------------------------------------------------------------------- backend selection


def test_env_selects_torch_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_kernel(*args, **kwargs):
        raise AssertionError("kernel used although the torch backend was selected")

    monkeypatch.setattr(cpu_kernel, "decode", no_kernel)
    monkeypatch.setenv(attention.BACKEND_ENV, "torch")
    args = _decode_args()
    assert paged_decode(**args).out.shape == (2, 4, 16)


def test_failed_build_falls_back_to_torch_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = native_build.once(cpu_kernel._build_kernel, cpu_kernel._unavailable)
    monkeypatch.setattr(cpu_kernel, "_get", fresh)  # forget this process's kernel; restored after
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path))  # and the disk cache
    monkeypatch.setenv("CXX", "false")  # a "compiler" that always fails
    args = _decode_args()
    with caplog.at_level(logging.WARNING, logger=cpu_kernel.logger.name):
        info = kernel_info()
        assert not info.is_available and "failed" in info.detail
        reference_out = paged_decode(**args, backend="torch").out
        torch.testing.assert_close(paged_decode(**args).out, reference_out)  # auto -> torch
        paged_decode(**args)
    assert len([r for r in caplog.records if "kernel unavailable" in r.message]) == 1
    with pytest.raises(FailedPrecondition, match="kernel unavailable"):
        paged_decode(**args, backend="kernel")


def test_portable_build_without_openmp_or_native_flags(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The flag sets are tried in order; the last one (plain C++17: SSE2 only, no OpenMP, software
    fp16 conversion) is what a compiler without OpenMP gets, and it must be just as correct."""
    require_backend("kernel")
    fresh = native_build.once(cpu_kernel._build_kernel, cpu_kernel._unavailable)
    monkeypatch.setattr(cpu_kernel, "_get", fresh)
    monkeypatch.setenv("PAGEDKV_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_CXX_OPTIONAL_FLAGS", (("-fno-such-flag-for-pagedkv",), ()))
    info = kernel_info()
    assert info.is_available and info.build_s > 0, info.detail
    assert "-fopenmp" not in info.detail and "-march" not in info.detail
    for dtype, seed in ((torch.float32, 1), (torch.float16, 2), (torch.bfloat16, 3)):
        sc = make_scenario([1, 8, 29, 40], num_kv_heads=2, block_size=8, head_dim=40, dtype=dtype, seed=seed)
        q = torch.randn(4, 8, 40).to(dtype)
        result = paged_decode(
            q, sc.k_cache, sc.v_cache, sc.tables, sc.seq_lens, return_block_mass=True, backend="kernel"
        )
        check_decode(result, sc, q, 40**-0.5, 8)
