"""The commands a newcomer runs: `pagedkv up` (+ `status`, `health`) and
`pagedkv demo`, as real processes, on the embedded store."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

PAGEDKV = [sys.executable, "-m", "pagedkv"]


def test_up_prints_addresses_serves_status_and_stops_cleanly_on_ctrl_c(tmp_path):
    proc = subprocess.Popen(
        [*PAGEDKV, "up", "--embedded", "--nodes", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C stops everything" in line or not line:
                break
        text = "".join(lines)
        assert "store: embedded" in text, text
        coordinator = next(ln.split()[1] for ln in lines if ln.startswith("coordinator"))
        nodes = [ln.split()[1] for ln in lines if ln.startswith("node-")]
        assert len(nodes) == 2
        # every port it opened is printed: each node's bulk port, every /metrics endpoint
        assert re.search(r"^coordinator +\S+ +metrics http://127\.0\.0\.1:\d+/metrics", text, re.M), text
        node_line = r"^node-\d +\S+ +bulk 127\.0\.0\.1:\d+ +metrics http://\S+/metrics"
        assert len(re.findall(node_line, text, re.M)) == 2, text
        assert "model spec   2 layers x 2 KV heads x head_dim 32, float32" in text
        for url in re.findall(r"metrics (http://\S+/metrics)", text):
            assert "pagedkv_" in urllib.request.urlopen(url, timeout=10).read().decode()
        status = subprocess.run(
            [*PAGEDKV, "status", "--coordinator", coordinator], capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 0, status.stderr
        assert "2 live nodes" in status.stdout and "node-0" in status.stdout and "node-1" in status.stdout
        for address in [coordinator, *nodes]:
            health = subprocess.run([*PAGEDKV, "health", address], capture_output=True, text=True, timeout=30)
            assert health.stdout.strip() == "SERVING"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        for address in nodes:  # everything it started is gone
            health = subprocess.run(
                [*PAGEDKV, "health", address, "--timeout-s", "0.5"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert health.returncode == 1 and health.stdout.strip() == "UNREACHABLE"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_reports_hits_and_writes_its_plot(tmp_path):
    out = tmp_path / "demo"
    args = [
        *PAGEDKV,
        "demo",
        "--embedded",
        "--workers",
        "2",
        "--requests",
        "2",
        "--system-prompts",
        "1",
        "--system-tokens",
        "64",
        "--user-tokens",
        "8",
        "--new-tokens",
        "3",
        "--layers",
        "2",
        "--hidden",
        "64",
        "--out",
        str(out),
    ]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    summary = json.loads((out / "demo.json").read_text())["summary"]
    assert summary["requests"] == 4 and summary["store"] == "embedded"
    # One system prompt of 4 blocks: at least the two requests after each worker's first hit it.
    assert summary["cached_tokens"] >= 2 * 64
    assert summary["same_tokens_as_recompute"] is True
    assert sum(n["used_blocks"] for n in summary["nodes"].values()) == 0  # every sequence was closed
    assert (out / "demo.png").stat().st_size > 10_000
    assert "prefix hit rate" in done.stdout
