"""Cluster-level prefix caching: does a coordinator + N nodes cache like one pool?

    python -m bench.cluster [--quick] [--workload chat|trace] [--nodes 4] [--pool 2048] [--repeats 3]

The same request stream (bench/workloads.py: the multi-turn chat workload, with a shared
system prompt, growing histories and long one-shot documents; or the first requests of the
Mooncake trace) is replayed by one worker through three real set-ups, each started fresh
(redis-server, `pagedkv coordinator`, `pagedkv node` processes on free ports):

- cluster: a coordinator and N nodes of P blocks; the coordinator places every open;
- one node: a coordinator and one node of N x P blocks (the same memory, pooled);
- random: N standalone nodes of P blocks, each open sent to a node chosen by a seeded RNG.

The worker keeps `concurrency` sequences open (a request's KV is appended after its open,
tiny model shape, zeros), closing the oldest as the next one opens. Reported: the prefix hit
rate (cached prompt tokens over prompt tokens, from each open's reply), opens per node and the
busiest node over the mean, and from the coordinator the opens it placed as scans and why each
open missed (coordinator/misses.py). With --repeats every set-up runs that many times, fresh
processes each, interleaved (random placement is seeded: once). Writes
bench/results/cluster[_quick].{json,md,png} (the JSON keeps each open's node and cached tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import plots
from bench.workloads import ChatShape, Request, chat_requests, trace_requests
from pagedkv.client import CacheClient
from pagedkv.cluster import LocalCluster, NodeOptions, free_port
from pagedkv.protos.errors import CapacityExceeded, PrefixEvicted
from pagedkv.protos.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16", "block_size": 16}
SPEC = ModelSpec(**SHAPE)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Setup:
    name: str
    num_nodes: int
    pool: int
    placement: str  # "coordinator" or "random"


@dataclass
class Replay:
    hit_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.opens: Counter[str] = Counter()
        self.reopens = 0
        self.misses: dict[str, int] = {}  # the coordinator's miss reasons (coordinator set-ups)
        self.per_request: list[tuple[str, int]] = []  # (node, cached tokens) of each request
        self.scan_opens = 0  # opens the coordinator placed as scans

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def node_options(pool: int, policy: str) -> NodeOptions:
    return NodeOptions(**SHAPE, num_blocks=pool, host_blocks=0, policy=policy, bulk_port="off")  # type: ignore[arg-type]


@contextmanager
def started(num_nodes: int, options: NodeOptions, log_dir: str, coordinator: bool) -> Iterator[LocalCluster]:
    """redis-server, a coordinator and N nodes (coordinator=True), or N standalone nodes: the
    nodes' processes start side by side (each imports torch: seconds), then all are waited for."""
    cluster = LocalCluster(num_nodes, options, use_redis=coordinator, log_dir=log_dir)
    try:
        if coordinator:
            cluster.num_nodes = 0  # LocalCluster.start() brings up Redis and the coordinator only
            cluster.start()
        for i in range(num_nodes):
            address = f"127.0.0.1:{free_port()}"
            cluster.node_addresses.append(address)
            link = [f"--coordinator={cluster.coordinator_address}", f"--advertise={address}"]
            link = link if coordinator else []
            cluster._pagedkv(
                f"node-{i}",
                [
                    "node",
                    f"--listen={address}",
                    f"--node-id=node-{i}",
                    "--metrics-port=0",
                    *link,
                    *options.args(),
                ],
            )
        for i, address in enumerate(cluster.node_addresses):
            cluster._wait_healthy(f"node-{i}", address)
        if coordinator:
            cluster.wait_registered(num_nodes)
        yield cluster
    finally:
        cluster.stop()


def replay(
    clients: list[CacheClient],
    names: list[str],
    requests: list[Request],
    concurrency: int,
    rng: random.Random | None,
) -> Replay:
    """One worker: open, append the uncached rest, keep `concurrency` open, close the oldest.
    With one client (a coordinator) the open goes where it places it; with several (standalone
    nodes) to a node drawn by `rng`."""
    out = Replay()
    running: deque = deque()
    start = time.perf_counter()
    for i, r in enumerate(requests):
        while len(running) >= concurrency:
            running.popleft().close()
        pick = rng.randrange(len(clients)) if rng is not None else 0
        for attempt in range(8):
            seq = clients[pick].open(f"r{i}.{attempt}", r.tokens)
            cached = seq.num_cached_tokens
            n = len(r.tokens) - cached
            kv = torch.zeros(SPEC.num_layers, n, SPEC.num_kv_heads, SPEC.head_dim, dtype=torch.float16)
            try:
                seq.append(r.tokens[cached:], kv, kv)
                break
            except PrefixEvicted:  # the index promised blocks the node evicted since: open again
                out.reopens += 1
            except CapacityExceeded:  # placed on a node the running ones fill: wait for the oldest
                seq.close()
                if not running:
                    raise
                running.popleft().close()
                out.reopens += 1
        else:
            raise RuntimeError(f"request {i}: no room or its prefix evicted under eight opens in a row")
        running.append(seq)
        out.opens[seq.route.node_id or names[pick]] += 1
        out.per_request.append((seq.route.node_id or names[pick], cached))
        out.hit_tokens += cached
        out.prompt_tokens += len(r.tokens)
    for seq in running:
        seq.close()
    out.seconds = time.perf_counter() - start
    return out


def run_setup(setup: Setup, requests: list[Request], concurrency: int, policy: str, log_dir: str) -> Replay:
    coordinator = setup.placement == "coordinator"
    with started(setup.num_nodes, node_options(setup.pool, policy), log_dir, coordinator) as cluster:
        if coordinator:
            with CacheClient(coordinator=cluster.coordinator_address, spec=SPEC) as client:
                out = replay([client], ["?"], requests, concurrency, None)
                counters = client.cluster_stats().counters
                out.misses = {k[len("misses_") :]: v for k, v in counters.items() if k.startswith("misses_")}
                out.scan_opens = counters.get("scan_opens", 0)
                return out
        clients = [CacheClient(a) for a in cluster.node_addresses]
        try:
            names = [f"node-{i}" for i in range(len(clients))]
            return replay(clients, names, requests, concurrency, random.Random(0))
        finally:
            for c in clients:
                c.close()


def workload(name: str, quick: bool, limit: int | None) -> tuple[list[Request], int]:
    """The requests and the concurrency they run at."""
    if name == "trace":
        return trace_requests(limit or (60 if quick else 400)), 8
    if name != "chat":
        raise SystemExit(f"unknown workload {name!r} (chat or trace)")
    shape = ChatShape(active=64, document_every=4, document_tokens=(1024, 4096))
    if quick:
        shape = ChatShape(num_conversations=24, active=12, document_every=4, document_tokens=(512, 1024))
    reqs = chat_requests(shape)
    return reqs[:limit] if limit else reqs, 8


def summarize(results: dict[str, list[Replay]], num_nodes: int) -> dict:
    """Per set-up: the median run's hit rate, opens and misses, every run's hit rate, and the
    worst balance over the runs."""
    out = {}
    for name, runs in results.items():
        ordered = sorted(runs, key=lambda r: r.hit_rate)
        r = ordered[len(ordered) // 2]
        size = num_nodes if name != "one node" else 1
        balances = []
        for run in runs:
            counts = [run.opens.get(f"node-{i}", 0) for i in range(size)]
            balances.append(max(counts) / (sum(counts) / len(counts)) if sum(counts) else 0.0)
        out[name] = {
            "hit_rate": r.hit_rate,
            "hit_rates": [run.hit_rate for run in runs],
            "opens_per_node": [r.opens.get(f"node-{i}", 0) for i in range(size)],
            "busiest_over_mean": max(balances),
            "seconds": r.seconds,
            "reopens": r.reopens,
            "misses": r.misses,
            "scan_opens": r.scan_opens,
        }
    return out


def markdown(summary: dict, meta: dict) -> str:
    lines = [
        "# Cluster replay (bench/cluster.py)",
        "",
        meta["note"],
        "",
        "| configuration | prefix hit rate (median) | runs | vs one node | opens per node | busiest / mean"
        " (worst run) | scans | misses: host / in flight / other node / evicted / not cached | s |",
        "|---|---:|---|---:|---|---:|---:|---|---:|",
    ]
    one = summary.get("one node", {}).get("hit_rate", 0.0)
    for name, row in summary.items():
        ratio = f"{row['hit_rate'] / one:.2f}x" if one else "-"
        if one and len(row["hit_rates"]) > 1:
            ratio += f" ({min(row['hit_rates']) / one:.2f}-{max(row['hit_rates']) / one:.2f})"
        per = " / ".join(str(c) for c in row["opens_per_node"])
        runs = ", ".join(f"{h:.4f}" for h in row["hit_rates"])
        m = row["misses"]
        reasons = ("host_tier", "in_flight", "other_node", "evicted", "not_cached")
        misses = " / ".join(str(m.get(k, 0)) for k in reasons) if m else "-"
        lines.append(
            f"| {name} | {row['hit_rate']:.4f} | {runs} | {ratio} | {per} | {row['busiest_over_mean']:.2f} | "
            f"{row['scan_opens']} | {misses} | {row['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path, title: str) -> None:
    plt = plots.pyplot()
    if plt is None:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(summary)
    a.bar(names, [summary[n]["hit_rate"] for n in names], color=["C0", "C1", "C2"][: len(names)])
    for i, n in enumerate(names):  # every run
        a.scatter([i] * len(summary[n]["hit_rates"]), summary[n]["hit_rates"], color="k", s=8, zorder=3)
    a.set(ylabel="prefix hit rate", title=title)
    spread = [n for n in names if len(summary[n]["opens_per_node"]) > 1]
    for i, n in enumerate(spread):
        counts = summary[n]["opens_per_node"]
        mean = sum(counts) / len(counts)
        b.scatter([i] * len(counts), [c / mean for c in counts], label=n)
    b.axhline(1.1, color="grey", linestyle=":", label="goal: busiest <= 1.1x")
    b.set_xticks(range(len(spread)), spread)
    b.set(ylabel="opens per node / mean", title="balance")
    b.legend(fontsize=8)
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--workload", default="chat", choices=["chat", "trace"])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--pool", type=int, default=None, help="blocks per node (default: 2048, quick 1024)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first LIMIT requests")
    p.add_argument("--policy", default="lru", help="every node's eviction policy")
    p.add_argument("--setups", default="cluster,one node,random", help="which of the three to run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each set-up, fresh processes each")
    p.add_argument("--quick", action="store_true", help="a small replay (CI smoke, well under a minute)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    pool = args.pool or (1024 if args.quick else 2048)
    requests, concurrency = workload(args.workload, args.quick, args.limit)
    setups = [
        Setup("cluster", args.nodes, pool, "coordinator"),
        Setup("one node", 1, args.nodes * pool, "coordinator"),
        Setup("random", args.nodes, pool, "random"),
    ]
    setups = [s for s in setups if s.name in args.setups.split(",")]
    log_dir = tempfile.mkdtemp(prefix="pagedkv-bench-cluster-")
    start = time.perf_counter()
    results: dict[str, list[Replay]] = {s.name: [] for s in setups}
    for repeat in range(args.repeats):  # set-ups interleaved, so a noisy spell hits all alike
        for s in setups:
            if repeat and s.placement == "random":  # seeded: every run the same
                continue
            r = run_setup(s, requests, concurrency, args.policy, log_dir)
            results[s.name].append(r)
            print(
                f"{s.name:<9} hit rate {r.hit_rate:.4f}  opens {dict(r.opens)}  {r.seconds:.1f} s  "
                f"scans {r.scan_opens}  misses {r.misses}",
                flush=True,
            )
    summary = summarize(results, args.nodes)
    tokens = sum(len(r.tokens) for r in requests)
    note = (
        f"{args.workload}: {len(requests)} requests, {tokens:,} prompt tokens, {concurrency} open at "
        f"once; {args.nodes} nodes x {pool} blocks of 16 tokens vs one node of {args.nodes * pool}; "
        f"policy {args.policy}; tiny shape {SHAPE}; {args.repeats} run(s) of each; "
        f"load {os.getloadavg()[0]:.1f} at the end; "
        f"{time.perf_counter() - start:.0f} s in all."
    )
    stem = "cluster_quick" if args.quick else f"cluster_{args.workload}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"note": note, "args": vars(args)}
    per_request = {name: [r.per_request for r in runs] for name, runs in results.items()}
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "per_request": per_request}, indent=1)
    )
    (out / f"{stem}.md").write_text(markdown(summary, meta))
    plot(summary, out / f"{stem}.png", f"{args.workload}, {args.nodes} x {pool} blocks")
    print(markdown(summary, meta))
    subprocess.run(["rm", "-rf", log_dir], check=False)


if __name__ == "__main__":
    main(sys.argv[1:])
