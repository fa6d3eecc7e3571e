"""Building and loading the compiled key chain (csrc/chain_keys.c) for protos/keys.py.

The same scheme as the node's attention kernel (cache_node/attention/cpu_kernel.py),
which protos cannot import: plain C99, compiled at first use with the system C
compiler, cached on disk (~/.cache/pagedkv/kernels or PAGEDKV_KERNEL_DIR) under a
name keyed by the source, the flags, the compiler and the CPU's flags; concurrent
builders compile to a private file and rename it into place. Loaded with
ctypes.PyDLL: the list entry point builds Python objects, so the GIL stays held
(a call takes microseconds). No torch, no numpy: the coordinator uses it too.

The library hashes with the SHA-256 of the libcrypto that hashlib loaded (its
SHA256_Init / _Update / _Final, passed in here), and is used only after one key
it computes equals hashlib's. When no compiler works, there is no such libcrypto,
the library will not load or disagrees, or PAGEDKV_PURE_KEYS=1, get_chain()
returns None and keys.py hashes with hashlib: the same bytes, the same keys.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import native_build

logger = logging.getLogger("pagedkv.protos.keys")

_SOURCE = Path(__file__).with_name("csrc") / "chain_keys.c"
_C_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
# Python's symbols resolve when the library loads (as an extension module's do); macOS's
# linker must be told to leave them undefined.
_C_PLATFORM_FLAGS = ("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()
_ABI_VERSION = 3
# libcrypto as hashlib's _hashlib links it on common systems (tried after find_library).
_CRYPTO_NAMES = ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.dylib")


@dataclass(frozen=True)
class NativeChain:
    """The two ctypes entry points of csrc/chain_keys.c (sizes checked by the caller)."""

    # (parent, packed little-endian int64 tokens, block_size, num_blocks, out buffer) -> 0
    from_bytes: Callable[[bytes, bytes, int, int, ctypes.Array[ctypes.c_char]], int]
    # (parent, list of ints, first index, block_size, num_blocks) -> list of 16-byte keys
    from_list: Callable[[bytes, list[int], int, int, int], list[bytes]]


@dataclass(frozen=True)
class NativeKeysInfo:
    """Whether the compiled key chain is in use in this process, and why not if it is not."""

    is_available: bool
    detail: str  # the library path, or the reason it is not used


def _load() -> tuple[NativeChain | None, NativeKeysInfo]:
    if os.environ.get("PAGEDKV_PURE_KEYS", "") not in ("", "0"):
        return None, NativeKeysInfo(False, "PAGEDKV_PURE_KEYS is set")
    cc = native_build.find_compiler("CC", ("cc", "gcc", "clang"))
    if cc is None:
        return None, NativeKeysInfo(False, "no C compiler found (set CC)")
    try:
        source = _SOURCE.read_bytes()
    except OSError as exc:
        return None, NativeKeysInfo(False, f"source missing: {exc}")
    flag_sets = [(*_C_FLAGS, *_C_PLATFORM_FLAGS)]
    library = native_build.library_path("chain_keys", source, flag_sets, cc)
    detail = str(library)
    if not native_build.is_built(library):
        try:
            detail += f" (built with {native_build.compile_library(cc, _SOURCE, library, flag_sets, 120)})"
        except OSError as exc:
            return None, NativeKeysInfo(
                False, f"{exc} (cache directory {library.parent}; PAGEDKV_KERNEL_DIR)"
            )
    crypto = _libcrypto()
    if crypto is None:
        return None, NativeKeysInfo(False, "no libcrypto with SHA256_Init/_Update/_Final found")
    try:
        lib = ctypes.PyDLL(str(library))
        if lib.pagedkv_keys_abi_version() != _ABI_VERSION:
            return None, NativeKeysInfo(False, f"{library}: ABI version mismatch")
        from_bytes, from_list = lib.pagedkv_chain_keys, lib.pagedkv_chain_keys_list
        lib.pagedkv_keys_set_sha256.argtypes = [ctypes.c_void_p] * 3
        lib.pagedkv_keys_set_sha256.restype = None
        lib.pagedkv_keys_set_sha256(*(ctypes.cast(f, ctypes.c_void_p) for f in crypto))
    except (OSError, AttributeError) as exc:
        return None, NativeKeysInfo(False, f"cannot load {library}: {exc}")
    i64, c_char_p = ctypes.c_int64, ctypes.c_char_p
    # c_char_p passes a bytes object's own buffer: no copy of the parent or the token bytes.
    from_bytes.argtypes = [c_char_p, c_char_p, i64, i64, c_char_p]
    from_bytes.restype = i64
    from_list.argtypes = [c_char_p, ctypes.py_object, i64, i64, i64]
    from_list.restype = ctypes.py_object
    parent, tokens = bytes(range(16)), bytes(range(128))
    out = ctypes.create_string_buffer(16)
    want = hashlib.sha256(parent + tokens).digest()[:16]
    if from_bytes(parent, tokens, 16, 1, out) != 0 or out.raw != want:
        return None, NativeKeysInfo(False, f"{library}: its key disagrees with hashlib's; not used")
    return NativeChain(from_bytes, from_list), NativeKeysInfo(True, detail)


def _libcrypto() -> tuple[Any, Any, Any] | None:
    """SHA256_Init, SHA256_Update and SHA256_Final of the libcrypto hashlib uses, or None."""
    names = [ctypes.util.find_library("crypto"), *_CRYPTO_NAMES]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            return lib.SHA256_Init, lib.SHA256_Update, lib.SHA256_Final
        except (OSError, AttributeError):
            continue
    return None


_get = native_build.once(
    _load, lambda info: logger.info("block keys: compiled chain unavailable, using hashlib: %s", info.detail)
)


def get_chain() -> tuple[NativeChain | None, NativeKeysInfo]:
    """The ctypes chain function (None when unavailable) and the report; loaded once per process."""
    return _get()
