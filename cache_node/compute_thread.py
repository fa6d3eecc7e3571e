"""The one thread that runs a node's tensor work.

torch's CPU ops run on libgomp, which keeps a worker pool per thread that starts a
parallel op and throttles every pool's spin-wait once the process holds more such
threads than CPUs; one compute thread keeps one warm pool (and on a GPU node, one
owner of the device's streams). The price: that pool spins between ops, taking
cores from anything sharing them, so `pagedkv node` turns it on only when asked
(--compute-thread on). Introspection getters (lengths, stats, events) do no tensor
work and run on their caller's thread, under the engine lock.
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
