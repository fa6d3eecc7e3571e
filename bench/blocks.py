"""Block-manager throughput beside the peers: pagedkv's KVCacheManager (full node
bookkeeping: chained SHA-256-128 keys, refcounts, eviction policy, event queue) with
each eviction policy vs vLLM's BlockPool and KVCacheManager and SGLang's radix cache,
on the shared kvbench workloads (../shared/peers: W1 allocate/free, W1c with prefix
caching, W2 shared system prompts with forced eviction).

    python -m bench.blocks [--runs 3] [--workloads W1,W1c,W2] [--adapters ...] [--baseline REV]

`--baseline REV` also runs our adapters on the code of commit REV (extracted with git
archive), in the same rounds: the before/after of a change, side by side. Every
(adapter, workload, run) is a fresh process of the peers' venv (/tmp/peers/venv, or
PEERS_VENV; built by ../shared/peers/setup_and_run.sh if missing; this interpreter when
only our adapters run), and the adapters are
interleaved in a shuffled order within each run so machine noise hits all alike. Each
variant imports pagedkv from its own tree (a directory of links on PYTHONPATH), with
this checkout's adapter (bench/kvbench_adapter.py), so nothing is installed.
Writes bench/results/blocks.{json,md,png} (--stem names them otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import plots

ROOT = Path(__file__).resolve().parents[1]
# ../shared/peers beside the checkout (or beside the folder of worktrees), or PAGEDKV_PEERS
PEERS = Path(
    os.environ.get("PAGEDKV_PEERS")
    or next(
        (p for p in (ROOT.parent / "shared" / "peers", ROOT.parents[1] / "shared" / "peers") if p.is_dir()),
        "",
    )
    or ROOT.parent / "shared" / "peers"
)
VENV = Path(os.environ.get("PEERS_VENV", "/tmp/peers/venv"))
OURS = {  # short name -> the adapter class, one per eviction policy
    "pagedkv": "bench.kvbench_adapter:PagedKVAdapter",
    "pagedkv-lfu": "bench.kvbench_adapter:PagedKVLFUAdapter",
    "pagedkv-slru": "bench.kvbench_adapter:PagedKVSLRUAdapter",
    "pagedkv-score": "bench.kvbench_adapter:PagedKVScoreAdapter",
    "harness-floor": "bench.kvbench_adapter:HarnessFloorAdapter",  # a no-op: the runner's own cost
}
ADAPTERS = ["naive", "vllm-blockpool", "vllm", "sglang", *OURS]
RUN = (
    "import json, sys, time\n"
    "from kvbench import runner\n"
    "if sys.argv[3] == 'cpu':\n"  # the runner's clock reads this thread's CPU time (see --clock)
    "    time.perf_counter = time.thread_time\n"
    "r = runner.run(sys.argv[1], sys.argv[2])\n"
    "r['rss_delta_mb'] = r['peak_rss_mb'] - r['rss_before_mb']\n"
    "print('KVBENCH_RESULT ' + json.dumps(r))\n"
)
PROBE = "from pagedkv.cache_node.kv_manager import KVCacheManager as M; M(8, 4).open('a', [1] * 9)"


def ensure_venv(adapters: list[str]) -> Path:
    """The interpreter every run uses: the peers' venv when a peer runs (built if missing),
    else this one, which imports our adapters and kvbench's runner without the peers' packages."""
    if all(a in OURS for a in adapters):
        return Path(sys.executable)
    python = VENV / "bin" / "python"
    if not python.exists():
        print(f"building the peers' venv at {VENV} (a few minutes) ...", flush=True)
        env = {**os.environ, "SKIP_RUN": "1", "VENV": str(VENV)}
        if subprocess.run(["bash", str(PEERS / "setup_and_run.sh")], env=env).returncode:
            shutil.rmtree(VENV, ignore_errors=True)  # half-built: the next run starts over
            raise SystemExit(
                f"the peers' venv at {VENV} did not build (its pip output is above); "
                f"run only our adapters with --adapters {','.join(OURS)}"
            )
    return python


def make_site(tree: Path, site: Path) -> Path:
    """A directory that imports as `tree`'s pagedkv (its roles linked in, as the wheel lays
    them out) and this checkout's `bench`, to put first on PYTHONPATH."""
    package = site / "pagedkv"
    package.mkdir(parents=True)
    for entry in (tree / "pagedkv").iterdir():
        (package / entry.name).symlink_to(entry)
    for role in ("protos", "cache_node", "client", "coordinator"):
        (package / role).symlink_to(tree / role)
    (site / "bench").symlink_to(ROOT / "bench")
    return site


def baseline_tree(rev: str, into: Path) -> tuple[str, Path]:
    """Commit `rev` of this repository extracted under `into`: (its short hash, the tree)."""
    short = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    tree = into / f"tree-{short}"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", short], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return short, tree


def env_for(site: Path | None) -> dict[str, str]:
    path = [str(site)] if site is not None else [str(ROOT)]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([*path, str(PEERS)]),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONHASHSEED": "0",
    }


def one_run(python: Path, adapter: str, workload: str, clock: str, site: Path | None) -> dict:
    done = subprocess.run(
        [str(python), "-c", RUN, OURS.get(adapter, adapter), workload, clock],
        capture_output=True,
        text=True,
        env=env_for(site),
        cwd=PEERS,
        timeout=900,
    )
    for line in done.stdout.splitlines():
        if line.startswith("KVBENCH_RESULT "):
            return json.loads(line.removeprefix("KVBENCH_RESULT "))
    return {"adapter": adapter, "workload": workload, "error": (done.stderr or done.stdout)[-1500:]}


def summarize(runs: list[dict]) -> dict:
    table: dict = {}
    for r in runs:
        if "error" not in r:
            table.setdefault(r["workload"], {}).setdefault(r["label"], []).append(r)
    out: dict = {}
    keys = ("ops_per_s", "us_per_start", "us_per_token_append", "us_per_finish", "hit_rate", "peak_rss_mb")
    for workload, by_label in table.items():
        out[workload] = {
            label: {k: statistics.median(r[k] for r in rs) for k in (*keys, "rss_delta_mb")}
            | {"runs": len(rs)}
            for label, rs in by_label.items()
        }
        base = out[workload].get("vllm-blockpool", {}).get("ops_per_s")
        for label, row in out[workload].items():
            row["vs_vllm_blockpool"] = row["ops_per_s"] / base if base else None
            # this code / the baseline's, on our rows that have a baseline twin
            twin = next((v for k, v in out[workload].items() if k.startswith(label + "@")), None)
            row["vs_baseline"] = row["ops_per_s"] / twin["ops_per_s"] if twin else None
    return out


def markdown(summary: dict, meta: dict) -> str:
    head = (
        "| workload | adapter | ops/s | vs vLLM BlockPool | vs baseline | start µs | append µs | finish µs "
        "| hit rate | peak RSS MB | runs |"
    )
    lines = ["# Block-manager throughput beside the peers (bench/blocks.py)", "", meta["note"], "", head]
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for workload in sorted(summary):
        for label, r in sorted(summary[workload].items(), key=lambda kv: -kv[1]["ops_per_s"]):
            ratio = f"{r['vs_vllm_blockpool']:.2f}x" if r["vs_vllm_blockpool"] else "-"
            vs_base = f"{r['vs_baseline']:.2f}x" if r["vs_baseline"] else "-"
            lines.append(
                f"| {workload} | {label} | {r['ops_per_s']:,.0f} | {ratio} | {vs_base} | "
                f"{r['us_per_start']:.1f} | {r['us_per_token_append']:.2f} | {r['us_per_finish']:.1f} | "
                f"{r['hit_rate']:.4f} | "
                f"{r['peak_rss_mb']:.0f} | {r['runs']} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    """Per workload, each of our policies against vLLM's BlockPool: this code and any baseline."""
    plt = plots.pyplot()
    if plt is None:
        return
    workloads = sorted(summary)
    policies = [a for a in OURS if a != "harness-floor" and any(a in summary[w] for w in workloads)]
    baselines = sorted({k[k.index("@") :] for w in workloads for k in summary[w] if "@" in k})
    variants = [("", "this code"), *((b, b.lstrip("@")) for b in baselines)]
    width = 0.8 / len(variants)
    fig, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads, strict=True):
        rows = summary[workload]
        for j, (suffix, variant) in enumerate(variants):
            values = [(rows.get(p + suffix) or {}).get("vs_vllm_blockpool") or 0 for p in policies]
            ax.bar([i + j * width for i in range(len(policies))], values, width, label=variant)
        ax.axhline(2.0, color="grey", linestyle="--", linewidth=0.8)
        names = [p.removeprefix("pagedkv-") if p != "pagedkv" else "lru" for p in policies]
        ax.set_xticks([i + width * (len(variants) - 1) / 2 for i in range(len(policies))], names)
        ax.set(title=workload, ylabel="ops/s vs vLLM BlockPool (median)")
        ax.legend(fontsize=7)
    fig.suptitle("Block-manager throughput by eviction policy, side by side in one run")
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
    p.add_argument("--baseline", help="a commit whose code our adapters also run, in the same rounds")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--stem", default="blocks", help="the result files' name: STEM.json, STEM.md, STEM.png")
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
    python = ensure_venv(args.adapters.split(","))
    scratch = Path(tempfile.mkdtemp(prefix="pagedkv-blocks-"))
    try:
        sites: dict[str, Path] = {"": make_site(ROOT, scratch / "site")}
        if args.baseline:
            short, tree = baseline_tree(args.baseline, scratch)
            sites["@" + short] = make_site(tree, scratch / f"site-{short}")
        for suffix, site in sites.items():  # import (and build the native code) outside the clock
            probe = subprocess.run(
                [str(python), "-c", PROBE], env=env_for(site), cwd=PEERS, capture_output=True
            )
            if probe.returncode:
                raise SystemExit(f"pagedkv{suffix} does not import: {probe.stderr.decode()[-800:]}")
        jobs = []
        for run in range(args.runs):
            for workload in args.workloads.split(","):
                group = []
                for adapter in args.adapters.split(","):
                    variants: list[tuple[str, Path | None]]
                    if adapter not in OURS:  # a peer: its own packages
                        variants = [("", None)]
                    elif adapter == "harness-floor":  # imports our adapter module, runs none of our code
                        variants = [("", sites[""])]
                    else:
                        variants = list(sites.items())
                    group += [(workload, adapter, suffix, site, run) for suffix, site in variants]
                jobs.append(group)
        runs = run_jobs(python, jobs, args.clock)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(runs)
    clock = "wall time" if args.clock == "wall" else "timers reading thread CPU time (--clock cpu)"
    baseline = (
        f" `@{args.baseline}` rows: our adapters on that commit's code, in the same rounds."
        if args.baseline
        else ""
    )
    note = (
        f"{args.runs} runs per cell, {clock}, each a fresh process (OMP_NUM_THREADS=1), adapters "
        f"interleaved in a shuffled order per run; medians. Load average {os.getloadavg()[0]:.2f} at the "
        f"end; runtime {meta_runtime(runs):.0f} s. `harness-floor` is a no-op adapter: the runner's own "
        f"loop, so its ops/s is the most any adapter can show here.{baseline}"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"note": note, "runs": args.runs, "clock": args.clock, "baseline": args.baseline}
    (out / f"{args.stem}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=1)
    )
    (out / f"{args.stem}.md").write_text(markdown(summary, meta))
    plot(summary, out / f"{args.stem}.png")
    print(markdown(summary, meta))


def run_jobs(python: Path, jobs: list[list[tuple]], clock: str) -> list[dict]:
    """Each (run, workload) group in a shuffled order; prints progress."""
    total = sum(map(len, jobs))
    rng = random.Random(0)
    runs: list[dict] = []
    start = time.perf_counter()
    for group in jobs:
        rng.shuffle(group)
        for workload, adapter, suffix, site, run in group:
            r = one_run(python, adapter, workload, clock, site)
            r["label"], r["loadavg_1m"] = adapter + suffix, os.getloadavg()[0]
            r["elapsed_s"] = time.perf_counter() - start
            runs.append(r)
            shown = f"{r['ops_per_s']:>10,.0f} ops/s" if "error" not in r else "ERROR " + r["error"][-300:]
            print(f"[{len(runs):>3}/{total}] run {run} {workload:<4} {r['label']:<24} {shown}", flush=True)
    return runs


def meta_runtime(runs: list[dict]) -> float:
    return max((r.get("elapsed_s", 0.0) for r in runs), default=0.0)


if __name__ == "__main__":
    main(sys.argv[1:])
