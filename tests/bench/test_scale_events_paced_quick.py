"""`python -m bench.scale_events_paced` at its smallest (its own redis-server and coordinator):
both ways of sending are measured for each flush interval, every report is taken, and the
table is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCHEDSTAT = Path(f"/proc/self/task/{os.getpid()}/schedstat").exists()


def test_a_small_paced_events_run_measures_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "paced"
    args = ["--nodes", "3", "--rate", "300", "--seconds", "0.2", "--rounds", "1", "--flush-s", "0.005,0.05"]
    args += ["--out", str(out)]
    cmd = [sys.executable, "-m", "bench.scale_events_paced", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    flushes = json.loads(out.with_suffix(".json").read_text())["flushes"]
    assert set(flushes) == {"0.005", "0.05"}
    for modes in flushes.values():
        assert set(modes) == {"one-way", "framed call"}
        # the coordinator works for every report, and the clocks read nanoseconds
        assert all(len(m["rounds_us"]) == 1 and m["per_report_us"] > 0 for m in modes.values())
        # by thread: what the coordinator's threads spent, together no more than the whole
        # (one clock tick a report of slack on a kernel without schedstat, which reads ticks)
        slack = 0.0 if SCHEDSTAT else 1e6 / os.sysconf("SC_CLK_TCK") / 60
        for m in modes.values():
            assert all(us >= 0 for us in m["by_thread_us"].values())
            assert sum(m["by_thread_us"].values()) <= m["per_report_us"] * (1 + 1e-9) + slack
    table = out.with_suffix(".md").read_text()
    assert "| 0.005 | one-way |" in table and "| 0.05 | framed call |" in table
