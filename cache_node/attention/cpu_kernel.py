"""Building and loading the C++ paged-decode kernel (../csrc/paged_attention.cpp), and the call
that runs it on one decode batch..

Plain C++17 + OpenMP, no torch headers, so it compiles in seconds (torch's
cpp_extension took 45 s on these 2 cores) and needs no ninja. The library is
cached on disk (~/.cache/pagedkv/kernels or PAGEDKV_KERNEL_DIR), keyed by the
source, the flags, the compiler and the CPU's flags; concurrent builders compile
to a temporary file and rename it into place. If -march=native or -fopenmp is
refused it retries without them. Called through ctypes, which releases the GIL.
"""

from __future__ import annotations

import ctypes
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pagedkv.protos import native_build
from pagedkv.protos.errors import InvalidArgument

from .checks import DTYPE_CODES
from .output import AttentionOutput
from .spec import PLAIN, AttentionSpec

logger = logging.getLogger("pagedkv.cache_node.attention")


@dataclass(frozen=True)
class KernelInfo:
    """Whether the C++ decode kernel is usable in this process, and why not if it is not."""

    is_available: bool
    detail: str  # library path, or the reason it could not be built / loaded
    build_s: float  # seconds spent compiling in this process (0.0 when loaded from the disk cache)


_SOURCE = Path(__file__).parent.parent / "csrc" / "paged_attention.cpp"
_CXX_FLAGS = (
    "-O3",
    "-ffp-contract=fast",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-std=c++17",
    "-shared",
    "-fPIC",
)
# Tried in order: a compiler without -march=native support or without OpenMP (Apple clang) still
# gets a kernel, portable or single-threaded, rather than none.
_CXX_OPTIONAL_FLAGS = (("-march=native", "-fopenmp"), ("-fopenmp",), ())
_ABI_VERSION = 2
DecodeFn = Callable[..., int]  # the ctypes function pagedkv_paged_decode


def _build_kernel() -> tuple[DecodeFn | None, KernelInfo]:
    cxx = native_build.find_compiler("CXX", ("c++", "g++", "clang++"))
    if cxx is None:
        return None, KernelInfo(False, "no C++ compiler found (set CXX)", 0.0)
    try:
        source = _SOURCE.read_bytes()
    except OSError as exc:
        return None, KernelInfo(False, f"kernel source missing: {exc}", 0.0)
    flag_sets = [(*_CXX_FLAGS, *optional) for optional in _CXX_OPTIONAL_FLAGS]
    library = native_build.library_path("paged_attention", source, flag_sets, cxx)
    build_s, detail = 0.0, str(library)
    if not native_build.is_built(library):
        start = time.perf_counter()
        try:
            flags = native_build.compile_library(cxx, _SOURCE, library, flag_sets, 300)
        except OSError as exc:
            return None, KernelInfo(
                False, f"{exc} (cache directory {library.parent}; PAGEDKV_KERNEL_DIR)", 0.0
            )
        build_s = time.perf_counter() - start
        detail = f"{library} (built with {flags})"
    try:
        lib = ctypes.CDLL(str(library))  # CDLL releases the GIL during calls
        if lib.pagedkv_abi_version() != _ABI_VERSION:
            return None, KernelInfo(False, f"{library}: ABI version mismatch", build_s)
        fn = lib.pagedkv_paged_decode
    except (OSError, AttributeError) as exc:
        return None, KernelInfo(False, f"cannot load {library}: {exc}", build_s)
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    argtypes: list[Any] = (
        [i64, ptr, ptr, ptr, ptr, ptr]
        + [i64] * 8
        + [ctypes.c_float, i64, i64, ctypes.c_float]
        + [ptr, ptr, ptr, ptr, i64, ptr]
    )
    fn.argtypes = argtypes
    fn.restype = i64
    return fn, KernelInfo(True, detail, build_s)


def _unavailable(info: KernelInfo) -> None:
    logger.warning("paged attention: C++ kernel unavailable, using torch: %s", info.detail)


_get = native_build.once(_build_kernel, _unavailable)  # tests swap in a fresh one to rebuild


def get_kernel() -> tuple[DecodeFn | None, KernelInfo]:
    """The ctypes decode function (None when unavailable) and the report; built once per process."""
    return _get()


def kernel_info() -> KernelInfo:
    """Build (or load from the disk cache) the C++ decode kernel if not done yet, and report on it."""
    return get_kernel()[1]


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Tensor,
    lens: Tensor,
    scale: float,
    with_mass: bool,
    num_partitions: int | None = None,  # tests force the split; None picks from the thread count
    out: tuple[Tensor, Tensor] | None = None,
    spec: AttentionSpec = PLAIN,
) -> AttentionOutput:
    fn = get_kernel()[0]
    assert fn is not None
    batch, num_q_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    tables = tables.to(device="cpu", dtype=torch.int64).contiguous()
    lens = lens.to(device="cpu", dtype=torch.int64).contiguous()
    q32 = q.to(torch.float32).contiguous()
    if out is not None and q.dtype == torch.float32:  # the kernel writes straight into the caller's
        o, lse = out
    else:
        o = torch.empty(batch, num_q_heads, head_dim, dtype=torch.float32)
        lse = torch.empty(batch, num_q_heads, dtype=torch.float32) if out is None else out[1]
    block_lse = None
    if with_mass:  # blocks the kernel never visits (padding) keep -inf, so their mass is 0
        block_lse = torch.full((batch, num_q_heads, tables.shape[1]), -math.inf, dtype=torch.float32)
    # Split long sequences across threads when there are too few (sequence, kv head) pairs to go round.
    num_threads = torch.get_num_threads()
    if num_partitions is None:
        num_partitions = 1
        if batch * num_kv_heads < 2 * num_threads:
            max_logical = -(-int(lens.max()) // block_size)
            num_partitions = max(1, min(-(-4 * num_threads // (batch * num_kv_heads)), max_logical // 8))
    bad = (ctypes.c_int64 * 3)()
    sinks = spec.sinks_tensor(torch.device("cpu"))
    status = fn(
        DTYPE_CODES[q.dtype],
        q32.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        batch,
        num_q_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        tables.shape[1],
        num_partitions,
        scale,
        spec.window,
        spec.chunk,
        spec.softcap,
        0 if sinks is None else sinks.data_ptr(),
        o.data_ptr(),
        lse.data_ptr(),
        0 if block_lse is None else block_lse.data_ptr(),
        num_threads,
        bad,
    )
    if status == 1:
        raise InvalidArgument(
            f"block_tables[{bad[0]}, {bad[1]}] = {bad[2]} is not a physical block id in [0, {num_blocks})"
        )
    if status != 0:
        raise RuntimeError(f"paged attention kernel failed with status {status}")
    mass = None
    if block_lse is not None:
        mass = torch.exp(block_lse - lse.unsqueeze(-1)).sum(dim=1)
    if out is not None and o is not out[0]:
        o = out[0].copy_(o)
    return AttentionOutput(o.to(q.dtype), lse, mass)
