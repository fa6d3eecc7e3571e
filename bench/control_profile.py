"""bench.control's profile of the coordinator: py-spy samples of its Open / Close handlers,
split by what Coordinator.open / close was calling."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.control_setup import log


def find_pyspy() -> str | None:
    for cand in (os.environ.get("PYSPY", ""), shutil.which("py-spy") or "", "/tmp/pyspy/bin/py-spy"):
        if cand and os.path.exists(cand):
            return cand
    return None


def _fname(frame: str) -> str:
    """'Coordinator.open (coordinator/core.py:270)' -> 'Coordinator.open@core.py'"""
    fn, _, where = frame.partition(" (")
    return f"{fn}@{os.path.basename(where.split(':')[0])}"


def summarize_profile(raw_path: Path) -> dict[str, Any]:
    """Split the samples of the coordinator's Open / Close handlers by what they were calling."""
    per: dict[str, Counter] = {"Open": Counter(), "Close": Counter()}
    totals: Counter = Counter()
    threads: Counter = Counter()
    for line in raw_path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [_fname(f) for f in stack.split(";")]
        totals["all"] += n
        handler = next(
            (
                h
                for h in ("CoordinatorServicer.Open@service.py", "CoordinatorServicer.Close@service.py")
                if h in frames
            ),
            None,
        )
        if handler is None:
            threads["other (idle pool workers, reaper, grpc, metrics)"] += n
            continue
        method = handler.split("@")[0].split(".")[-1]
        core = f"Coordinator.{method.lower()}@core.py"
        if core in frames:
            i = frames.index(core)
            cat = frames[i + 1] if i + 1 < len(frames) else f"{core} (own code)"
            # one level deeper for the store / node hops, which is where time goes
            if cat == "Coordinator._call@core.py":
                cat = "node " + ("Open" if method == "Open" else "Free") + " gRPC (Coordinator._call)"
            cat = f"Coordinator.{method.lower()} -> {cat}"
        else:
            i = frames.index(handler)
            rest = frames[i + 1 :]
            inner = [
                f
                for f in rest
                if f.split("@")[0] not in ("observe", "CoordinatorServicer._run")
                and not f.startswith(f"CoordinatorServicer.{method}.<locals>.run@")
            ]
            cat = f"handler (outside Coordinator.{method.lower()}) -> {inner[0] if inner else 'own code'}"
        per[method][cat] += n
    out: dict[str, Any] = {"total_samples": totals["all"], "non_handler_samples": sum(threads.values())}
    for method, c in per.items():
        tot = sum(c.values())
        out[method] = {
            "samples": tot,
            "breakdown": [{"what": k, "samples": v, "share": v / tot} for k, v in c.most_common()],
        }
    return out


def profile_coordinator(
    pid: int, log_dir: str, out_dir: str, seconds: float, op: Callable[[int], object]
) -> dict:
    """A py-spy profile (wall clock, --idle) of the coordinator process `pid` while op(i) runs
    for i = 0, 1, ... until it ends, summarized; {} when seconds is 0, {"error": ...} when
    py-spy is missing or fails. Copies the raw samples to out_dir/control.pyspy.txt."""
    profile: dict[str, Any] = {}
    pyspy = find_pyspy()
    if seconds > 0 and pyspy:
        raw = Path(log_dir) / "coordinator.pyspy.txt"
        log(f"profiling the coordinator (pid {pid}) with py-spy for {seconds:.0f} s ...")
        cmd = [
            pyspy,
            "record",
            "--pid",
            str(pid),
            "--duration",
            str(int(seconds)),
            "--rate",
            "1000",
            "--idle",
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.5)
        n_ops = 0
        while spy.poll() is None:  # prompts reused in turn: the W2 list can run out on a quick host
            op(n_ops)
            n_ops += 1
        err = spy.stderr.read().decode()[-500:] if spy.stderr else ""
        if spy.returncode == 0 and raw.exists():
            profile = summarize_profile(raw)
            profile.update(
                {
                    "tool": "py-spy record --idle --rate 1000 --nonblocking (wall clock)",
                    "open_close_ops": n_ops,
                    "raw": str(raw),
                }
            )
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy(raw, Path(out_dir) / "control.pyspy.txt")
            for m in ("Open", "Close"):
                log(
                    f"  {m}: "
                    + ", ".join(f"{b['what']} {b['share']:.0%}" for b in profile[m]["breakdown"][:6])
                )
        else:
            profile = {"error": f"py-spy exited {spy.returncode}: {err}"}
            log(f"  py-spy failed: {err}")
    elif seconds > 0:
        profile = {"error": "py-spy not found (pip install py-spy, or set PYSPY=/path/to/py-spy)"}

    return profile
