"""Building the project's small native libraries at first use (the C block-key
chain here, the node's C++ decode kernel and block-pool loops), one way for all.

A library is compiled by the system compiler into a cache directory
(~/.cache/pagedkv/kernels, $XDG_CACHE_HOME/pagedkv/kernels or PAGEDKV_KERNEL_DIR)
under a name keyed by its source, its flag sets, the compiler, the CPU's flags and
the platform, so a changed source or a different CPU never loads a stale build.
Concurrent builders (several nodes on one host, test workers) compile to a private
file and rename it into place: a loader sees the old name or a whole library.
No torch, no numpy: the coordinator loads through this too.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")
Info = TypeVar("Info")


def cache_dir() -> Path:
    # Absolute: ctypes would look a bare file name up on the library path, not here.
    if os.environ.get("PAGEDKV_KERNEL_DIR"):
        return Path(os.environ["PAGEDKV_KERNEL_DIR"]).absolute()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).absolute() / "pagedkv" / "kernels"


def cpu_identity() -> str:
    # -march=native code must not be reused on a different CPU (a shared home directory, say).
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def find_compiler(env_var: str, names: Sequence[str]) -> str | None:
    """$env_var if set, else the first of `names` on the PATH."""
    return os.environ.get(env_var) or next((p for p in map(shutil.which, names) if p), None)


def library_path(stem: str, source: bytes, flag_sets: Sequence[Sequence[str]], compiler: str) -> Path:
    """Where the build of `source` with these flags and this compiler on this CPU lives."""
    key = [source, repr(tuple(map(tuple, flag_sets))).encode(), compiler.encode()]
    key += [cpu_identity().encode(), sys.platform.encode()]
    digest = hashlib.sha256(b"\0".join(key)).hexdigest()[:16]
    return cache_dir() / f"{stem}_{digest}.so"


def is_built(library: Path) -> bool:
    """Whether a usable build of `library` is cached. An empty file (left by an earlier
    build that wrote nothing) is removed, so the caller rebuilds instead of failing to load."""
    try:
        if library.stat().st_size > 0:
            return True
    except FileNotFoundError:
        return False
    library.unlink(missing_ok=True)
    return False


def compile_library(
    compiler: str, source: Path, library: Path, flag_sets: Sequence[Sequence[str]], timeout_s: float
) -> str:
    """Compile `source` to `library` with the first flag set the compiler accepts;
    returns those flags. Raises OSError with the compiler's complaint when none works."""
    library.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=library.parent)
    os.close(fd)
    errors = []
    try:
        for flags in flag_sets:
            try:
                cmd = [compiler, *flags, str(source), "-o", tmp]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
            except (OSError, subprocess.SubprocessError) as exc:
                raise OSError(f"{compiler}: {exc}") from exc
            # A compiler that exits 0 without output (a sandbox that stubs subprocesses) is a failure.
            if proc.returncode == 0 and os.path.getsize(tmp) > 0:
                os.replace(tmp, library)
                return " ".join(flags)
            if proc.returncode == 0:
                raise OSError(f"{compiler} exited 0 but wrote an empty library")
            errors.append(" | ".join(proc.stderr.strip().splitlines()[-3:]))
        raise OSError(f"{compiler} failed: {errors[0]}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def once(
    load: Callable[[], tuple[T | None, Info]], unavailable: Callable[[Info], None]
) -> Callable[[], tuple[T | None, Info]]:
    """A function returning load()'s (library or None, report), loaded at its first call
    and once per process whatever the threads; unavailable(report) runs once when load()
    gave no library (to log why)."""
    lock = threading.Lock()
    done: list[tuple[T | None, Info]] = []

    def get() -> tuple[T | None, Info]:
        if not done:
            with lock:
                if not done:
                    loaded = load()
                    if loaded[0] is None:
                        unavailable(loaded[1])
                    done.append(loaded)
        return done[0]

    return get
