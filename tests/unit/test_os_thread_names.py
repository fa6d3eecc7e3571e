"""Threads name themselves to the OS, so a process's CPU splits by role (bench.scale)."""

from __future__ import annotations

import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pagedkv.protos.serving import name_os_thread


def _comm() -> str:
    return Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()


@pytest.mark.skipif(sys.platform != "linux", reason="/proc and prctl are Linux's")
def test_pool_threads_carry_their_python_name_to_the_os() -> None:
    with ThreadPoolExecutor(1, thread_name_prefix="node-calls", initializer=name_os_thread) as pool:
        assert pool.submit(_comm).result() == "node-calls_0"
    with ThreadPoolExecutor(1, thread_name_prefix="a-very-long-pool-name") as pool:
        assert pool.submit(_comm).result() != "a-very-long-poo"  # not named without the initializer
    with ThreadPoolExecutor(1, thread_name_prefix="a-very-long-pool-name", initializer=name_os_thread) as p:
        assert p.submit(_comm).result() == "a-very-long-poo"  # the OS keeps 15 bytes
