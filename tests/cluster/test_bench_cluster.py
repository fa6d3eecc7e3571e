"""`python -m bench.cluster --quick` end to end (real redis-server, coordinator and node
processes): every set-up replays every request, and the JSON it writes says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_cluster_replay_runs_every_setup_over_every_request(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "bench.cluster",
        "--quick",
        "--nodes",
        "2",
        "--limit",
        "40",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "cluster_quick.json").read_text())["summary"]
    assert set(summary) == {"cluster", "one node", "random"}
    assert [sum(row["opens_per_node"]) for row in summary.values()] == [40, 40, 40]
    assert len(summary["cluster"]["opens_per_node"]) == 2 and len(summary["one node"]["opens_per_node"]) == 1
    # The quick chat shares system prompts and histories: every set-up hits some of it.
    assert all(0.0 < row["hit_rate"] < 1.0 for row in summary.values())
    assert (tmp_path / "cluster_quick.md").read_text().count("|") > 20
