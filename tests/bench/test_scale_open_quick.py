"""`python -m bench.scale_open --quick` end to end (its own redis-server): both node counts
are measured and the table is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_open_scale_run_measures_both_counts(tmp_path: Path) -> None:
    out = tmp_path / "scale_open"
    cmd = [sys.executable, "-m", "bench.scale_open", "--quick", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert set(result["p50_us"]["1024"]) == {"2", "40"}
    assert all(v > 0 for v in result["p50_us"]["1024"].values())
    assert "| 1024 |" in out.with_suffix(".md").read_text()
