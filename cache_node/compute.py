"""The node's compute thread: the engine's tensor work runs on one OS thread per process.

Why one thread: torch's CPU kernels parallelise with OpenMP, and every OS thread
that starts a parallel region gets a thread team of its own. libgomp counts the
threads of all teams, and once they outnumber the CPUs it stops spinning at its
barriers (the "throttled" spin count), so every parallel region of every call pays
futex wake-ups. A node serves from many threads (gRPC handlers, one thread per bulk
connection), which is exactly that case. Measured on this project's 2-core VMs: an
AttendPrefillBatch of the TTFT benchmark's shape (128 queries over 1,152 keys) took
4.7-6.4 ms per layer through a node whose handler threads ran the engine, 3.2-4.5 ms
with the engine's tensor work on one thread (alternating node processes, same
client). One thread also matches the device model: one stream per GPU.

`run(fn, ...)` runs fn on that thread and returns its result (or raises its error);
called on the compute thread itself it runs inline, so engine methods may call each
other. Nothing that runs here may wait for another call to come through here (the
engine's waits for an asynchronous Open, `awaiting_open`, stay on the caller's
thread). A forked child starts without the parent's thread and makes its own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_ident: int | None = None


def _start() -> ThreadPoolExecutor:
    global _executor, _ident
    with _lock:
        if _executor is None:
            executor = ThreadPoolExecutor(1, thread_name_prefix="pagedkv-compute")
            _ident = executor.submit(threading.get_ident).result()
            _executor = executor
        return _executor


def run(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """fn(*args, **kwargs) on the compute thread (inline when already on it)."""
    if threading.get_ident() == _ident:
        return fn(*args, **kwargs)
    executor = _executor or _start()
    return executor.submit(fn, *args, **kwargs).result()


def _forget_after_fork() -> None:
    global _executor, _ident, _lock
    _executor, _ident, _lock = None, None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
