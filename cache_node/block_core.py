"""Building and loading the block pool's compiled core (csrc/: the pool's loops and the
eviction orders, see csrc/block_core.c), a CPython extension module, for block_pool.py
and eviction.py.

The same scheme as the project's other native code (protos/native_build.py):
compiled at first use with the system C compiler against the running Python's
headers, cached on disk (~/.cache/pagedkv/kernels or PAGEDKV_KERNEL_DIR) under a
name keyed by the source, the flags (the include directory names the Python
version), the compiler, the CPU and the extension suffix; concurrent builders
compile to a private file and rename it into place. An extension module rather
than ctypes: its functions run a handful of list operations, and a ctypes call
costs more than that.

Its types own the state they work on (a Pool's refcounts, free stack, keys and
pins; an order's lists or heap). When no compiler works, the module will not load,
or PAGEDKV_PURE_POOL=1, get_core() returns None and the pool and the policies run
their Python reference code: the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from ..protos import native_build
from ..protos.keys_native import get_chain

logger = logging.getLogger("pagedkv.cache_node.block_core")

_CSRC = Path(__file__).with_name("csrc")
_SOURCE = _CSRC / "block_core.c"  # the module; the other translation units ride in the flags
_UNITS = (
    "order_base.c",
    "order_list.c",
    "order_heap.c",
    "pool.c",
    "pool_type.c",
    "decode_group.c",
    "lifecycle.c",
)
_HEADERS = ("order.h", "pool.h")
_ABI_VERSION = 13
_C_FLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden")
_C_PLATFORM_FLAGS = ("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()


@dataclass(frozen=True)
class BlockCoreInfo:
    """Whether the compiled loops are in use in this process, and why not if they are not."""

    is_available: bool
    detail: str  # the library path, or the reason it is not used


def _load() -> tuple[ModuleType | None, BlockCoreInfo]:
    if os.environ.get("PAGEDKV_PURE_POOL", "") not in ("", "0"):
        return None, BlockCoreInfo(False, "PAGEDKV_PURE_POOL is set")
    if sys.implementation.name != "cpython":
        return None, BlockCoreInfo(False, f"{sys.implementation.name} is not CPython")
    cc = native_build.find_compiler("CC", ("cc", "gcc", "clang"))
    if cc is None:
        return None, BlockCoreInfo(False, "no C compiler found (set CC)")
    include = sysconfig.get_paths().get("include", "")
    if not include or not os.path.exists(os.path.join(include, "Python.h")):
        return None, BlockCoreInfo(False, f"no Python.h under {include!r}")
    units = [_CSRC / name for name in _UNITS]
    try:  # the build's cache key covers every source and header
        source = b"\0".join(p.read_bytes() for p in (_SOURCE, *units, *(_CSRC / h for h in _HEADERS)))
    except OSError as exc:
        return None, BlockCoreInfo(False, f"source missing: {exc}")
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    flag_sets = [
        (*_C_FLAGS, *_C_PLATFORM_FLAGS, f"-I{include}", f"-I{_CSRC}", f'-DPAGEDKV_EXT_SUFFIX="{suffix}"')
        + tuple(map(str, units))
    ]
    library = native_build.library_path("block_core", source, flag_sets, cc)
    detail = str(library)
    if not native_build.is_built(library):
        try:
            detail += f" (built with {native_build.compile_library(cc, _SOURCE, library, flag_sets, 120)})"
        except OSError as exc:
            return None, BlockCoreInfo(False, f"{exc} (cache directory {library.parent}; PAGEDKV_KERNEL_DIR)")
    try:
        loader = importlib.machinery.ExtensionFileLoader("_block_core", str(library))
        spec = importlib.util.spec_from_file_location("_block_core", str(library), loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as exc:
        return None, BlockCoreInfo(False, f"cannot load {library}: {exc}")
    if getattr(module, "ABI_VERSION", None) != _ABI_VERSION:
        return None, BlockCoreInfo(False, f"{library}: ABI version mismatch")
    chain = get_chain()[0]
    # has_chain: one-block keys (a decode step filling a block) by a direct call of the compiled chain.
    setattr(module, "has_chain", chain is not None)  # noqa: B010 (an attribute mypy cannot see)
    if chain is not None:
        module.set_chain(ctypes.cast(chain.from_bytes, ctypes.c_void_p).value)
    else:
        detail += " (no compiled key chain: one-block keys by hashlib)"
    return module, BlockCoreInfo(True, detail)


_get = native_build.once(
    _load, lambda info: logger.info("block pool: compiled loops unavailable, using Python: %s", info.detail)
)


def get_core() -> tuple[ModuleType | None, BlockCoreInfo]:
    """The compiled module (None when unavailable) and the report; loaded once per process."""
    return _get()
