"""`python -m bench.scale --quick` end to end (a real redis-server, a real coordinator
process, fake nodes over real rpcs): every point is measured, nobody is reaped, and
the report, JSON and plot are written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_scale_run_measures_every_point_and_reaps_nobody(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    # pinned where there are two CPUs: the coordinator's core apart, as `--pin` sets it
    pin = ["--pin"] if (os.cpu_count() or 1) >= 2 and shutil.which("taskset") else []
    cmd = [sys.executable, "-m", "bench.scale", "--quick", *pin, "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["pinned"] == bool(pin)
    points = result["points"]
    assert [(p["nodes"], p["coordinators"]) for p in points] == [(2, 1), (20, 1)]
    for p in points:
        assert p["nodes_reaped"] == 0 and p["beats_unregistered"] == 0
        assert p["register_s"] < 30
        opens = p["prompts"]["2048"]
        assert opens["opens"] == 20 and 0.0 <= opens["hit_share"] <= 1.0
        assert opens["open_script_p50_us"] > 0 and opens["delete_script_p50_us"] > 0
        assert opens["open_p99_ms"] >= opens["open_p50_ms"] > 0
        (sat,) = opens["saturated_by_clients"]  # two client processes back to back for a second
        assert sat["clients"] == 2 and sat["open_close_per_s"] > 20 and sat["coord_cores"] > 0
        assert sat["opens_per_s_per_core"] == sat["open_close_per_s"] / sat["coord_cores"]
        assert p["events"]["batch256_apply_events_p50_us"] > 0
        by_mode = p["prompts_by_mode"]  # the same opens each way: framed with refs (above), gRPC, ...
        assert by_mode["framed_ref"]["2048"] == opens
        assert opens["named_share"] >= 0.5 and by_mode["framed"]["2048"]["named_share"] == 0
        for mode in ("worker", "coordinator", "framed_varints", "framed"):
            other = by_mode[mode]["2048"]
            assert other["opens"] == 20 and other["coord_cpu_per_open_close_ms"] >= 0
            assert other["open_p50_ms"] > 0
        # the fake nodes report the prompt on one node only: as placement spreads the hot prefix
        # to other nodes (which never report it here) later rounds hit less; the first mode hits
        assert by_mode["coordinator"]["2048"]["hit_share"] > 0
        # CPU comes from /proc in 10 ms ticks: 20 opens a mode may read 0, all four modes do not
        assert sum(m["2048"]["coord_cpu_raw_per_open_close_ms"] for m in by_mode.values()) > 0
        assert (
            p["events"]["batch1_coord_cpu_per_event_us"] > 0
            and "batch1_grpc_coord_cpu_per_event_us" in p["events"]
        )
    assert out.with_suffix(".md").read_text().count("|") > 20
    assert out.with_suffix(".png").stat().st_size > 1000
