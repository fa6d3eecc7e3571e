"""Data calls that overtake the coordinator's asynchronous node Open.

The coordinator opens a sequence on its node in the background and answers the client at
once, so the client's first data call (another connection) may reach the node first. The
engine gives an unknown sequence id a grace to appear, and remembers opens that failed
(tombstones) so that first call raises the open's own error (e.g. PrefixEvicted) instead
of NOT_FOUND. All methods run under the engine's lock (the condition shares it).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..protos.errors import PagedKVError


def _fresh_copy(exc: PagedKVError) -> PagedKVError:
    """A new instance of a stored error (same class, message and ids), so concurrent
    callers never share one exception object and its traceback."""
    err = PagedKVError.__new__(type(exc))
    Exception.__init__(err, *exc.args)
    err.__dict__.update(exc.__dict__)
    return err


class OpenWaits:
    """The engine's record of opens that arrived or failed, and the waits on them."""

    def __init__(self, lock: threading.RLock, max_tombstones: int) -> None:
        self._opened = threading.Condition(lock)  # notified by every open, successful or not
        self._tombstones: OrderedDict[str, PagedKVError] = OrderedDict()  # seq id -> why its open failed
        self._max_tombstones = max_tombstones

    def opened(self, seq_id: str) -> None:
        """seq_id was opened (lock held): forget any earlier failure, wake the waiters."""
        self._tombstones.pop(seq_id, None)
        self._opened.notify_all()

    def failed(self, seq_id: str, exc: PagedKVError) -> None:
        """seq_id's asynchronous open failed with exc (lock held; not called when a live
        sequence of that id exists). The oldest tombstones go beyond max_tombstones."""
        self._tombstones[seq_id] = exc
        self._tombstones.move_to_end(seq_id)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
        self._opened.notify_all()

    def wait(self, seq_id: str, exists: Callable[[str], bool], grace_s: float) -> bool:
        """Wait at most grace_s until exists(seq_id): True once it does, False if it still does
        not; raises the open's own error if it failed. Takes the lock itself."""
        deadline = time.monotonic() + grace_s
        with self._opened:
            # A failure already on record may be an earlier open's, with a reopen (which its
            # error told the client to do) still on its way: it stands only if no newer
            # open arrives within the grace. A failure recorded during the wait is raised at once.
            earlier = self._tombstones.get(seq_id)
            while True:
                if exists(seq_id):
                    return True
                failed = self._tombstones.get(seq_id)
                if failed is not None and failed is not earlier:
                    raise _fresh_copy(failed)
                if failed is None:
                    earlier = None  # a newer open arrived (and may have closed since)
                left = deadline - time.monotonic()
                if left <= 0:
                    if earlier is not None:
                        raise _fresh_copy(earlier)
                    return False
                self._opened.wait(left)

    def clear(self) -> None:
        self._tombstones.clear()
