"""The one thread that runs a node's tensor work.

Why a node funnels its engine calls onto one thread: torch's CPU ops run on
libgomp, which keeps a pool of worker threads for every thread that starts a
parallel op, and once the process holds more such threads than it has CPUs it
cuts every pool's spin-wait to ~100 rounds (its guard against oversubscription).
From then on each parallel op wakes its workers through the kernel. A node whose
gRPC and bulk-channel handler threads each called the engine held several pools
and paid that on every op: on a 2-CPU VM a 147k-element add took 76 us on a
handler thread against 9 us on the first thread that used torch, and a 128-token
prefill's attention 1.13 ms against 0.80 ms. With every engine call on one
thread the process keeps one pool, whose workers stay warm between the ops of a
call. (A GPU node wants the same: one thread owns the device's streams.)

It is a trade-off, so `pagedkv node` leaves it off unless asked (--compute-thread
on): the one pool's threads spin between ops (GOMP_SPINCOUNT, ~1 ms), which is
what makes its kernels fast, and they go on spinning for that long after each
call. On a host whose cores the workers share, that spin takes cores from the
worker's own compute: decode at batch 1 through a node on the same 2 CPUs ran at
100-118 tok/s with it against 203-219 without (the throttled pools sleep at once),
while a cached prefill's calls ran 0.3-0.6 ms faster each. A node with cores of
its own (its own host or container, a GPU node) has only the gain.

The hand-off costs two thread wake-ups, ~40 us, once per engine call; the
introspection getters (lengths, stats, events) run on their caller's thread,
under the engine lock, since they do no tensor work. A hand-off needs the GIL
twice (this thread takes the job, the caller resumes), so a thread that keeps
the GIL busy in pure Python delays each one by up to the interpreter's switch
interval (5 ms); a node's other threads wait in sockets and gRPC's C core.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class _Job:
    __slots__ = ("fn", "args", "kwargs", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.done = threading.Lock()  # held until the job has run: the cheapest one-shot signal
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None


class ComputeThread:
    """A daemon thread that runs the functions handed to `call`, one at a time, in order."""

    def __init__(self, name: str = "pagedkv-compute") -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._closing = threading.Lock()  # a job is never queued behind close's stop mark
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on this thread; its result or its exception, in the
        caller. Runs inline when called from this thread (a nested call) or after close."""
        if self.is_current():
            return fn(*args, **kwargs)
        job = _Job(fn, args, kwargs)
        with self._closing:
            queued = not self._closed
            if queued:
                self._jobs.put(job)
        if not queued:
            return fn(*args, **kwargs)
        job.done.acquire()
        error, result = job.error, job.result
        del job
        if error is not None:
            try:
                raise error
            finally:  # no cycle error -> traceback -> this frame -> error: the views it holds
                del error  # (a client's shared region) free as soon as the caller drops it
        return result  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop after the jobs already queued; later calls run inline. Idempotent."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(None)
        if not self.is_current():
            self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job.result = job.fn(*job.args, **job.kwargs)
            except BaseException as exc:  # handed to the caller, which raises it
                job.error = exc
            finally:
                job.done.release()
            # Hold nothing of a finished job while waiting for the next: its function and
            # result may view memory (a client's shared region) that must unmap when dropped.
            del job
