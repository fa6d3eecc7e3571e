"""Building and loading the compiled shortlist ranking (csrc/rank_rooms.c) for room_index.py.

Built at first use by protos.native_build (the system C compiler, a cache keyed by source,
flags, compiler and CPU), loaded with ctypes.PyDLL: a call takes microseconds, so it keeps the
GIL rather than pay for giving it back. Used only after it ranks a known case as the numpy
ranking does. When no compiler works, the library will not load or disagrees, or
PAGEDKV_PURE_RANK=1, get_rank() returns None and room_index.py ranks in numpy: the same choice.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..protos import native_build

logger = logging.getLogger("pagedkv.coordinator.rank")

_SOURCE = Path(__file__).with_name("csrc") / "rank_rooms.c"
# ISO C (no GNU extensions) and no contraction: every multiply and add rounds as numpy's do.
_C_FLAGS = ("-O2", "-std=c99", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC")
_ABI_VERSION = 1
MAX_WANT = 64  # csrc/rank_rooms.c's bound on the rows ranked first


@dataclass(frozen=True)
class NativeRankInfo:
    """Whether the compiled ranking is in use in this process, and why not if it is not."""

    is_available: bool
    detail: str


def _self_check(rank: Any) -> bool:
    """Three rows ranked as the numpy ranking ranks them: the least loaded first, the other
    two tied at the cut (loads 4, 4, 1; none over the balance bound)."""
    free, total, evictable, active = [4, 4, 4], [8, 8, 8], [0, 0, 0], [4, 4, 1]
    ints = np.array([free, total, evictable, active], dtype=np.int64)
    opens = np.zeros(3)
    out = np.zeros(3 + 2 * 2 + 3, dtype=np.int64)
    # need 2, c0 2, lw 1, s1 1, opens_scale 1, k1 1.5, margin 1, not both, k2 2, m2 2, want 2
    terms = (2, 2.0, 1.0, 1.0, 1.0, 1.5, 1.0, 0, 2.0, 2.0, 2)
    code = rank(3, ints.ctypes.data, opens.ctypes.data, None, None, *terms, out.ctypes.data)
    return code == 0 and out[:4].tolist() == [1, 2, 24, 2] and sorted(out[7:9].tolist()) == [0, 1]


def _load() -> tuple[Any, NativeRankInfo]:
    if os.environ.get("PAGEDKV_PURE_RANK", "") not in ("", "0"):
        return None, NativeRankInfo(False, "PAGEDKV_PURE_RANK is set")
    cc = native_build.find_compiler("CC", ("cc", "gcc", "clang"))
    if cc is None:
        return None, NativeRankInfo(False, "no C compiler found (set CC)")
    try:
        source = _SOURCE.read_bytes()
    except OSError as exc:
        return None, NativeRankInfo(False, f"source missing: {exc}")
    library = native_build.library_path("rank_rooms", source, [_C_FLAGS], cc)
    if not native_build.is_built(library):
        try:
            native_build.compile_library(cc, _SOURCE, library, [_C_FLAGS], 120)
        except OSError as exc:
            return None, NativeRankInfo(
                False, f"{exc} (cache directory {library.parent}; PAGEDKV_KERNEL_DIR)"
            )
    try:
        lib = ctypes.PyDLL(str(library))
        if lib.pagedkv_rank_abi_version() != _ABI_VERSION:
            return None, NativeRankInfo(False, f"{library}: ABI version mismatch")
        rank = lib.pagedkv_rank_rooms
    except (OSError, AttributeError) as exc:
        return None, NativeRankInfo(False, f"cannot load {library}: {exc}")
    i64, f64, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
    rank.argtypes = [i64, ptr, ptr, ptr, ptr, i64, f64, f64, f64, f64, f64, f64, i64, f64, f64, i64, ptr]
    rank.restype = i64
    if not _self_check(rank):
        return None, NativeRankInfo(False, f"{library}: ranks a known case wrongly; not used")
    return rank, NativeRankInfo(True, str(library))


_get = native_build.once(
    _load, lambda info: logger.info("shortlist: compiled ranking unavailable, using numpy: %s", info.detail)
)


def get_rank() -> tuple[Any, NativeRankInfo]:
    """The ctypes ranking function (None when unavailable) and the report; loaded once per process."""
    return _get()
