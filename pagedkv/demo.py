"""`pagedkv demo`: the main job. A local cluster (coordinator + cache nodes; Redis
when a redis-server is on the PATH, else the embedded store) and several worker
processes, each running a transformers model (random weights, built from a
config: nothing is downloaded) whose KV cache lives on the nodes. Requests share
a few system prompts, so workers reuse each other's prefix blocks instead of
recomputing them. It prints, and plots to a PNG, the prefix hit rate, prefill
tokens and blocks saved, per-node usage, and time to first token with the
shared cache vs transformers' own DynamicCache.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .cluster import LocalCluster, NodeOptions, add_cluster_args, cluster_from_args
from .usage import Parser, UsageError, run


def make_requests(args: argparse.Namespace, vocab: int) -> list[list[dict]]:
    """Per worker, its requests: one of the system prompts + a unique user suffix (seeded)."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(3, vocab, args.system_tokens).tolist() for _ in range(args.system_prompts)]
    per_worker: list[list[dict]] = [[] for _ in range(args.workers)]
    for i in range(args.workers * args.requests):
        s = int(rng.integers(0, args.system_prompts))
        prompt = systems[s] + rng.integers(3, vocab, args.user_tokens).tolist()
        per_worker[i % args.workers].append({"id": i, "system": s, "prompt": prompt})
    return per_worker


def run_workers(
    cluster: LocalCluster, model_dir: Path, per_worker: list[list[dict]], new_tokens: int
) -> list[dict]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pagedkv.demo_worker",
                cluster.coordinator_address,
                str(model_dir),
                json.dumps(reqs),
                str(new_tokens),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **cluster.env},  # (TLS, when the cluster has it: the worker's CA)
        )
        for reqs in per_worker
    ]
    # One reader thread per worker feeds one queue, so progress prints as each request finishes,
    # interleaved across workers (reading the pipes in turn would print worker 0's to the end first).
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()

    def read(w: int, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put((w, line))
        lines.put((w, None))

    readers = [threading.Thread(target=read, args=(w, proc), daemon=True) for w, proc in enumerate(procs)]
    for reader in readers:
        reader.start()
    results: list[dict] = []
    total, running = sum(len(r) for r in per_worker), len(procs)
    while running:
        w, line = lines.get()
        if line is None:
            running -= 1
            continue
        row = json.loads(line)
        row["worker"] = w
        results.append(row)
        print(
            f"  [{len(results):>3}/{total}] worker {w} request {row['request']:>3}: "
            f"{row['cached_tokens']:>4}/{row['prompt_tokens']} prompt tokens cached, "
            f"TTFT {row['ttft_s'] * 1e3:6.1f} ms (recompute {row['ttft_local_s'] * 1e3:6.1f} ms)",
            flush=True,
        )
    for w, proc in enumerate(procs):
        if proc.wait() != 0:
            raise UsageError(f"demo worker {w} failed with exit code {proc.returncode} (its error is above)")
    return sorted(results, key=lambda r: r["request"])


def node_usage(cluster: LocalCluster) -> dict[str, dict[str, int]]:
    from .client import CacheClient
    from .client.config import ClientConfig

    config = ClientConfig(tls=cluster.tls)
    with CacheClient(coordinator=cluster.coordinator_address, config=config) as client:
        nodes = client.cluster_stats().nodes
        # Every worker has closed its sequences, but a close answers before the coordinator's node
        # Free lands: give the frees a moment to drain so the figures show the settled state.
        deadline = time.monotonic() + 3.0
        while True:
            usage = {n.node_id: client.node_stats(n.address).counters for n in nodes}
            if all(c["num_sequences"] == 0 for c in usage.values()) or time.monotonic() > deadline:
                return usage
            time.sleep(0.05)


def summarize(results: list[dict], usage: dict[str, dict[str, int]], block_size: int) -> dict:
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0,
        "prefill_tokens_saved": cached,
        "blocks_saved": cached // block_size,
        "ttft_median_ms": 1e3 * statistics.median(r["ttft_s"] for r in results),
        "ttft_recompute_median_ms": 1e3 * statistics.median(r["ttft_local_s"] for r in results),
        "ttft_hit_median_ms": 1e3
        * statistics.median([r["ttft_s"] for r in results if r["cached_tokens"]] or [0]),
        "same_tokens_as_recompute": all(r["same_tokens"] for r in results),
        "nodes": usage,
    }


def plot(results: list[dict], summary: dict, path: Path, block_size: int = 16) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    order = [r["request"] for r in results]
    ax = axes[0]
    ax.plot(
        order,
        [1e3 * r["ttft_local_s"] for r in results],
        "o-",
        color="#999",
        label="recompute (DynamicCache)",
    )
    ax.plot(order, [1e3 * r["ttft_s"] for r in results], "o-", color="#1f77b4", label="pagedkv shared cache")
    ax.set(xlabel="request (arrival order)", ylabel="time to first token (ms)", title="Time to first token")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)  # below: off the points
    ax = axes[1]
    hit = [r["cached_tokens"] / r["prompt_tokens"] for r in results]
    running = np.cumsum([r["cached_tokens"] for r in results]) / np.cumsum(
        [r["prompt_tokens"] for r in results]
    )
    ax.bar(order, hit, color="#2ca02c", alpha=0.5, label="per request")
    ax.plot(order, running, "k-", label="cumulative")
    ax.set(
        xlabel="request",
        ylabel="prompt tokens served from cache",
        ylim=(0, 1),
        title=f"Prefix hit rate {summary['hit_rate']:.0%} ({summary['prefill_tokens_saved']} tokens saved)",
    )
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax = axes[2]
    # What each node's pool did for the run: the blocks it keeps cached, the blocks prefix hits
    # reused (hit tokens / block size; a block reused by n requests counts n times) and its
    # host tier. Free blocks are left out: a demo-sized workload leaves most of the pool free.
    names = sorted(summary["nodes"])
    nodes = [summary["nodes"][n] for n in names]
    x = np.arange(len(names))
    bars = (
        ("cached blocks", [c["cached_blocks"] for c in nodes], "#1f77b4"),
        ("blocks reused by hits", [c["prefix_hit_tokens"] // block_size for c in nodes], "#2ca02c"),
        ("host-tier blocks", [c["host_cached_blocks"] + c["host_used_blocks"] for c in nodes], "#9467bd"),
    )
    for i, (label, values, color) in enumerate(bars):
        ax.bar(x + (i - 1) * 0.27, values, width=0.27, color=color, label=label)
    ax.set_xticks(x, names)
    pool = nodes[0]["num_blocks"] if nodes else 0
    ax.set(ylabel="blocks", title=f"What each node's pool held and served ({pool} blocks each)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False, fontsize="small")
    fig.suptitle("pagedkv demo: workers sharing system prompts through a local cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="pagedkv demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(p)
    p.add_argument("--workers", type=int, default=3, help="worker processes (default 3)")
    p.add_argument("--requests", type=int, default=4, help="requests per worker (default 4)")
    p.add_argument("--system-prompts", type=int, default=2, help="distinct system prompts (default 2)")
    p.add_argument("--system-tokens", type=int, default=512, help="tokens per system prompt (default 512)")
    p.add_argument("--user-tokens", type=int, default=48, help="unique tokens per request (default 48)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    p.add_argument("--layers", type=int, default=4, help="model layers (default 4)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="pagedkv-demo", help="folder for demo.png and demo.json")
    args = p.parse_args(argv)
    run("pagedkv demo", lambda: demo(args))


def demo(args: argparse.Namespace) -> None:
    from .client.transformers import demo_model, node_spec

    t0 = time.perf_counter()
    model, config = demo_model(
        seed=args.seed, num_layers=args.layers, hidden_size=args.hidden, num_heads=8, num_kv_heads=2
    )
    spec = node_spec(config, block_size=16)
    cluster = cluster_from_args(args, NodeOptions.for_spec(spec))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedkv-demo-") as tmp:
        model_dir = Path(tmp) / "model"
        model.save_pretrained(model_dir)
        cluster.log_dir = tmp
        print(f"model: Llama, {args.layers} layers, hidden {args.hidden}, random weights (seed {args.seed})")
        print("starting a local cluster ...", flush=True)
        with cluster:
            print(cluster.describe(), flush=True)
            per_worker = make_requests(args, config.vocab_size)
            shape = f"{args.system_prompts} system prompts of {args.system_tokens} tokens"
            print(
                f"{args.workers} workers x {args.requests} requests; {shape} + {args.user_tokens} unique "
                "tokens each",
                flush=True,
            )
            results = run_workers(cluster, model_dir, per_worker, args.new_tokens)
            usage = node_usage(cluster)
    summary = summarize(results, usage, spec.block_size)
    summary["store"] = cluster.store
    (out / "demo.json").write_text(json.dumps({"summary": summary, "requests": results}, indent=1))
    plot(results, summary, out / "demo.png", spec.block_size)
    report(summary, usage)
    print(f"plot: {out / 'demo.png'}   data: {out / 'demo.json'}   ({time.perf_counter() - t0:.0f} s)")


def report(s: dict, usage: dict[str, dict[str, int]]) -> None:
    print()
    print(f"prefix hit rate       {s['hit_rate']:.1%} of {s['prompt_tokens']} prompt tokens")
    print(f"prefill tokens saved  {s['prefill_tokens_saved']} ({s['blocks_saved']} blocks of KV reused)")
    print(f"TTFT median           {s['ttft_median_ms']:.1f} ms with the shared cache")
    print(f"                      {s['ttft_hit_median_ms']:.1f} ms on prefix hits")
    print(f"                      {s['ttft_recompute_median_ms']:.1f} ms recomputing (DynamicCache)")
    print(f"same tokens as recompute: {s['same_tokens_as_recompute']}")
    for name, c in sorted(usage.items()):
        blocks = f"used {c['used_blocks']:>4}  cached {c['cached_blocks']:>4}  free {c['free_blocks']:>4}"
        print(f"{name:<8} {blocks}  prefix hits {c['prefix_hit_tokens']} tokens")
