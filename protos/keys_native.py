"""Building and loading the compiled key chain (csrc/chain_keys.c) for protos/keys.py.

The same scheme as the node's attention kernel (cache_node/attention_kernel.py),
which protos cannot import: plain C99, compiled at first use with the system C
compiler, cached on disk (~/.cache/pagedkv/kernels or PAGEDKV_KERNEL_DIR) under a
name keyed by the source, the flags, the compiler and the CPU's flags; concurrent
builders compile to a private file and rename it into place. Loaded with
ctypes.PyDLL: the list entry point builds Python objects, so the GIL stays held
(a call takes microseconds). No torch, no numpy: the coordinator uses it too.

When no compiler works, the library will not load, or PAGEDKV_PURE_KEYS=1,
get_chain() returns None and keys.py hashes with hashlib: the same bytes, the
same keys.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("pagedkv.protos.keys")

_SOURCE = Path(__file__).with_name("csrc") / "chain_keys.c"
_C_FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
# Python's symbols resolve when the library loads (as an extension module's do); macOS's
# linker must be told to leave them undefined.
_C_PLATFORM_FLAGS = ("-undefined", "dynamic_lookup") if sys.platform == "darwin" else ()
# Tried in order: a compiler that refuses -march=native still gets a portable library.
_C_OPTIONAL_FLAGS = (("-march=native",), ())
_ABI_VERSION = 2


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


_lock = threading.Lock()
_loaded: tuple[NativeChain | None, NativeKeysInfo] | None = None  # set once per process


def _cache_dir() -> Path:
    # Absolute: ctypes would look a bare file name up on the library path, not here.
    if os.environ.get("PAGEDKV_KERNEL_DIR"):
        return Path(os.environ["PAGEDKV_KERNEL_DIR"]).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "pagedkv" / "kernels"


def _cpu_identity() -> str:
    # -march=native code must not be reused on a different CPU (a shared home directory, say).
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _compile(cc: str, library: Path) -> str:
    """Compile the source to `library`; returns the flags used. Raises OSError with the
    compiler's complaint when no flag set works."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    errors = []
    try:
        for optional in _C_OPTIONAL_FLAGS:
            flags = [*_C_FLAGS, *_C_PLATFORM_FLAGS, *optional]
            try:
                proc = subprocess.run(
                    [cc, *flags, str(_SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120
                )
            except (OSError, subprocess.SubprocessError) as exc:
                raise OSError(f"{cc}: {exc}") from exc
            if proc.returncode == 0:
                os.replace(tmp, library)  # atomic: a concurrent loader sees the old name or a whole file
                return " ".join(flags)
            errors.append(" | ".join(proc.stderr.strip().splitlines()[-3:]))
        raise OSError(f"{cc} failed: {errors[0]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> tuple[NativeChain | None, NativeKeysInfo]:
    if os.environ.get("PAGEDKV_PURE_KEYS", "") not in ("", "0"):
        return None, NativeKeysInfo(False, "PAGEDKV_PURE_KEYS is set")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None, NativeKeysInfo(False, "no C compiler found (set CC)")
    try:
        source = _SOURCE.read_bytes()
    except OSError as exc:
        return None, NativeKeysInfo(False, f"source missing: {exc}")
    key = [
        source,
        repr((_C_FLAGS, _C_PLATFORM_FLAGS, _C_OPTIONAL_FLAGS)).encode(),
        cc.encode(),
        _cpu_identity().encode(),
    ]
    digest = hashlib.sha256(b"\0".join([*key, sys.platform.encode()])).hexdigest()[:16]
    library = _cache_dir() / f"chain_keys_{digest}.so"
    detail = str(library)
    if not library.exists():
        try:
            detail += f" (built with {_compile(cc, library)})"
        except OSError as exc:
            return None, NativeKeysInfo(
                False, f"{exc} (cache directory {library.parent}; PAGEDKV_KERNEL_DIR)"
            )
    try:
        lib = ctypes.PyDLL(str(library))
        if lib.pagedkv_keys_abi_version() != _ABI_VERSION:
            return None, NativeKeysInfo(False, f"{library}: ABI version mismatch")
        from_bytes, from_list = lib.pagedkv_chain_keys, lib.pagedkv_chain_keys_list
    except (OSError, AttributeError) as exc:
        return None, NativeKeysInfo(False, f"cannot load {library}: {exc}")
    i64, c_char_p = ctypes.c_int64, ctypes.c_char_p
    # c_char_p passes a bytes object's own buffer: no copy of the parent or the token bytes.
    from_bytes.argtypes = [c_char_p, c_char_p, i64, i64, c_char_p]
    from_bytes.restype = i64
    from_list.argtypes = [c_char_p, ctypes.py_object, i64, i64, i64]
    from_list.restype = ctypes.py_object
    return NativeChain(from_bytes, from_list), NativeKeysInfo(True, detail)


def get_chain() -> tuple[NativeChain | None, NativeKeysInfo]:
    """The ctypes chain function (None when unavailable) and the report; loaded once per process."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                loaded = _load()
                if loaded[0] is None:
                    logger.info("block keys: compiled chain unavailable, using hashlib: %s", loaded[1].detail)
                _loaded = loaded
    return _loaded
