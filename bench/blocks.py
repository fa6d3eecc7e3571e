"""Block-manager throughput beside the peers: pagedkv's KVCacheManager (full node
bookkeeping: chained SHA-256-128 keys, refcounts, eviction policy, event queue) vs
vLLM's BlockPool and KVCacheManager and SGLang's radix cache, on the shared
kvbench workloads (../shared/peers: W1 allocate/free, W1c with prefix caching,
W2 shared system prompts with forced eviction).

    python -m bench.blocks [--runs 3] [--workloads W1,W1c,W2] [--adapters ...]

Every (adapter, workload, run) is a fresh process of the peers' venv
(/tmp/peers/venv, built by ../shared/peers/setup_and_run.sh if missing), and the
adapters are interleaved within each run so machine noise hits all alike.
Writes bench/results/blocks.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path(os.environ.get("PAGEDKV_PEERS", ROOT.parent / "shared" / "peers"))
VENV = Path(os.environ.get("PEERS_VENV", "/tmp/peers/venv"))
OURS = "bench.kvbench_adapter:PagedKVAdapter"
FLOOR = "bench.kvbench_adapter:HarnessFloorAdapter"  # a no-op adapter: the runner's own cost
ADAPTERS = ["naive", "vllm-blockpool", "vllm", "sglang", OURS, FLOOR]
RUN = (
    "import json, sys, time\n"
    "from kvbench import runner\n"
    "if sys.argv[3] == 'cpu':\n"  # the runner's clock reads this thread's CPU time (see --clock)
    "    time.perf_counter = time.thread_time\n"
    "r = runner.run(sys.argv[1], sys.argv[2])\n"
    "r['rss_delta_mb'] = r['peak_rss_mb'] - r['rss_before_mb']\n"
    "print('KVBENCH_RESULT ' + json.dumps(r))\n"
)


def ensure_venv() -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"building the peers' venv at {VENV} (a few minutes) ...", flush=True)
        env = {**os.environ, "SKIP_RUN": "1", "VENV": str(VENV)}
        subprocess.run(["bash", str(PEERS / "setup_and_run.sh")], check=True, env=env)
    # Probe from the peers' directory: from the repo root `pagedkv/` alone would import.
    probe = subprocess.run(
        [str(python), "-c", "import pagedkv.cache_node.kv_manager"], capture_output=True, cwd=PEERS
    )
    if probe.returncode != 0:  # our package, without its dependencies (torch/numpy are there)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "-e", str(ROOT)], check=True)
    return python


def one_run(python: Path, adapter: str, workload: str, clock: str = "wall") -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{PEERS}",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }
    done = subprocess.run(
        [str(python), "-c", RUN, adapter, workload, clock],
        capture_output=True,
        text=True,
        env=env,
        cwd=PEERS,
        timeout=900,
    )
    for line in done.stdout.splitlines():
        if line.startswith("KVBENCH_RESULT "):
            return json.loads(line.removeprefix("KVBENCH_RESULT "))
    return {"adapter": adapter, "workload": workload, "error": (done.stderr or done.stdout)[-1500:]}


def name(adapter: str) -> str:
    return {OURS: "pagedkv", FLOOR: "harness-floor"}.get(adapter, adapter)


def summarize(runs: list[dict]) -> dict:
    table: dict = {}
    for r in runs:
        if "error" in r:
            continue
        cell = table.setdefault(r["workload"], {}).setdefault(name(r["adapter"]), [])
        cell.append(r)
    out: dict = {}
    for workload, by_adapter in table.items():
        out[workload] = {}
        for adapter, rs in by_adapter.items():
            out[workload][adapter] = {
                k: statistics.median(r[k] for r in rs)
                for k in (
                    "ops_per_s",
                    "us_per_start",
                    "us_per_token_append",
                    "us_per_finish",
                    "hit_rate",
                    "peak_rss_mb",
                    "rss_delta_mb",
                )
            } | {"runs": len(rs)}
        base = out[workload].get("vllm-blockpool", {}).get("ops_per_s")
        for row in out[workload].values():
            row["vs_vllm_blockpool"] = row["ops_per_s"] / base if base else None
    return out


def markdown(summary: dict, meta: dict) -> str:
    head = (
        "| workload | adapter | ops/s | vs vLLM BlockPool | start µs | append µs | finish µs | hit rate "
        "| peak RSS MB | RSS Δ MB | runs |"
    )
    lines = [
        "# Block-manager throughput beside the peers (bench/blocks.py)",
        "",
        meta["note"],
        "",
        head,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for workload in sorted(summary):
        for adapter, r in sorted(summary[workload].items(), key=lambda kv: -kv[1]["ops_per_s"]):
            ratio = f"{r['vs_vllm_blockpool']:.2f}x" if r["vs_vllm_blockpool"] else "-"
            lines.append(
                f"| {workload} | {adapter} | {r['ops_per_s']:,.0f} | {ratio} | {r['us_per_start']:.1f} | "
                f"{r['us_per_token_append']:.2f} | {r['us_per_finish']:.1f} | {r['hit_rate']:.4f} | "
                f"{r['peak_rss_mb']:.0f} | {r['rss_delta_mb']:.1f} | {r['runs']} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    plt = plots.pyplot()
    if plt is None:
        return
    workloads = sorted(summary)
    adapters = sorted({a for w in summary.values() for a in w})
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(adapters)
    for i, adapter in enumerate(adapters):
        values = [summary[w].get(adapter, {}).get("ops_per_s", 0) / 1e3 for w in workloads]
        ax.bar([x + i * width for x in range(len(workloads))], values, width, label=adapter)
    ax.set_xticks([x + width * (len(adapters) - 1) / 2 for x in range(len(workloads))], workloads)
    ax.set(ylabel="k ops/s (median)", title="Block-manager throughput, one run side by side")
    ax.legend(fontsize=8)
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.blocks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--workloads", default="W1,W1c,W2")
    p.add_argument("--adapters", default=",".join(ADAPTERS))
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="what the runner's timers read: wall time (perf_counter, as kvbench does), or "
        "this thread's CPU time (thread_time), which time slices lost to other processes "
        "on a shared machine do not inflate; each read costs ~0.5 us more, for every "
        "adapter",
    )
    args = p.parse_args(argv)
    python = ensure_venv()
    adapters = args.adapters.split(",")
    jobs = [(w, a, r) for r in range(args.runs) for w in args.workloads.split(",") for a in adapters]
    runs: list[dict] = []
    start = time.perf_counter()
    rng = random.Random(0)
    for i in range(0, len(jobs), len(adapters)):  # one (run, workload): adapters in a shuffled order
        group = jobs[i : i + len(adapters)]
        rng.shuffle(group)
        for workload, adapter, run in group:
            r = one_run(python, adapter, workload, args.clock)
            runs.append(r)
            shown = f"{r['ops_per_s']:>10,.0f} ops/s" if "error" not in r else "ERROR " + r["error"][-200:]
            print(
                f"[{len(runs):>3}/{len(jobs)}] run {run} {workload:<4} {name(adapter):<15} {shown}",
                flush=True,
            )
    summary = summarize(runs)
    clock = "wall time" if args.clock == "wall" else "timers reading thread CPU time (--clock cpu)"
    note = (
        f"{args.runs} runs per cell, {clock}, each a fresh process (OMP_NUM_THREADS=1), adapters "
        f"interleaved in a shuffled order per run; medians. Load average {os.getloadavg()[0]:.2f} at the "
        f"end; runtime {time.perf_counter() - start:.0f} s. `harness-floor` is a no-op adapter: the "
        f"runner's own loop, so its ops/s is the most any adapter can show here."
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"note": note, "runs": args.runs, "clock": args.clock}
    (out / "blocks.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1))
    (out / "blocks.md").write_text(markdown(summary, meta))
    plot(summary, out / "blocks.png")
    print(markdown(summary, meta))


if __name__ == "__main__":
    main(sys.argv[1:])
