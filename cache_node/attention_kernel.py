"""Building and loading the C++ paged-decode kernel (csrc/paged_attention.cpp).

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..protos import native_build

logger = logging.getLogger("pagedkv.cache_node.attention")


@dataclass(frozen=True)
class KernelInfo:
    """Whether the C++ decode kernel is usable in this process, and why not if it is not."""

    is_available: bool
    detail: str  # library path, or the reason it could not be built / loaded
    build_s: float  # seconds spent compiling in this process (0.0 when loaded from the disk cache)


_SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
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
