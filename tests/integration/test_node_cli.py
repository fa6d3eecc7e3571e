"""`pagedkv node` as a real process: prints its address, serves, drains on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from pagedkv.cache_node.cli import parse_bytes
from pagedkv.client import CacheClient


def test_parse_bytes() -> None:
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("10") == 10
    with pytest.raises(Exception, match="not a size"):
        parse_bytes("lots")


def test_node_process_serves_and_stops_on_sigterm() -> None:
    env = {**os.environ, "PAGEDKV_NUM_BLOCKS": "16", "PAGEDKV_DTYPE": "float32"}
    args = [
        "--num-layers",
        "2",
        "--num-kv-heads",
        "2",
        "--head-dim",
        "8",
        "--host-bytes",
        "64KiB",
        "--listen",
        "127.0.0.1:0",
        "--metrics-port",
        "-1",
        "--grace-s",
        "1",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cache_node.cli", *args], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"listening on (\S+) \((\d+) blocks of \d+ B, (\d+) host blocks", line)
        assert m, line
        assert m.group(2) == "16" and m.group(3) == str((64 << 10) // (2 * 2 * 2 * 8 * 4 * 16))
        with CacheClient(m.group(1)) as client:
            client.ping()
            assert client.stats().counters["num_blocks"] == 16
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
