"""cache_node/open_waits.py: a data call that finds an earlier open's failure on record
waits out the grace for a reopen before it reports that failure (the reopen race: the
error tells the client to open again, and its next data call may overtake that open)."""

from __future__ import annotations

import threading
import time

import pytest

from pagedkv.cache_node.open_waits import OpenWaits
from pagedkv.protos.errors import PrefixEvicted

GRACE_S = 2.0


LOCK = threading.RLock()  # the engine's lock: opened() and failed() run under it


@pytest.fixture
def waits() -> tuple[OpenWaits, set[str]]:
    return OpenWaits(LOCK, max_tombstones=8), set()


def locked(fn):
    def run() -> None:
        with LOCK:
            fn()

    return run


def later(delay_s: float, fn) -> threading.Thread:
    thread = threading.Thread(target=lambda: (time.sleep(delay_s), fn()))
    thread.start()
    return thread


def test_a_reopen_that_arrives_within_the_grace_supersedes_the_recorded_failure(waits):
    record, live = waits
    locked(lambda: record.failed("s", PrefixEvicted("s", 0, 40)))()

    def reopen() -> None:
        live.add("s")
        record.opened("s")

    thread = later(0.1, locked(reopen))
    assert record.wait("s", live.__contains__, GRACE_S) is True
    thread.join()


def test_a_failure_on_record_stands_once_the_grace_passes_without_a_reopen(waits):
    record, live = waits
    locked(lambda: record.failed("s", PrefixEvicted("s", 0, 40)))()
    start = time.monotonic()
    with pytest.raises(PrefixEvicted, match="holds 0 of 40"):
        record.wait("s", live.__contains__, 0.2)
    assert time.monotonic() - start >= 0.2


def test_a_reopen_that_fails_again_is_reported_at_once(waits):
    record, live = waits
    locked(lambda: record.failed("s", PrefixEvicted("s", 0, 40)))()
    thread = later(0.1, locked(lambda: record.failed("s", PrefixEvicted("s", 4, 40))))
    start = time.monotonic()
    with pytest.raises(PrefixEvicted, match="holds 4 of 40"):
        record.wait("s", live.__contains__, GRACE_S)
    assert time.monotonic() - start < GRACE_S / 2
    thread.join()


def test_without_any_record_an_unknown_id_is_false_after_the_grace(waits):
    record, live = waits
    assert record.wait("s", live.__contains__, 0.05) is False
