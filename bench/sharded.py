"""Decode step latency of a sequence sharded over nodes vs the same length on one node (issue 20).

A local cluster of node processes (real gRPC, the bulk channel, a coordinator on Redis
when a redis-server is on the PATH): sequences of the same length L held on 1, 2 and 3
nodes (extents of L/E tokens, made by `max_extent_tokens`), each decoded step by step
(every layer one attend per node, the new token's K/V to the tail), the modes
interleaved (in turn forward and backward) so load drifts hit them alike. "2 nodes, one
by one" makes the same calls, each answered before the next is sent: what overlapping
the nodes' attends saves.

    python -m bench.sharded [--length 8192] [--steps 60] [--smoke] [--out DIR] [--window W] [--pin-nodes]
                            [--budget N] [--pool-fraction F]

--window W opens every sequence with a sliding window of W tokens on every layer: the client
attends only the extents the window reaches (the others are skipped: client/extent_masks.py).

--budget N sets a token budget of N tokens on every sequence: one node keeps it; over several
the client does (client/budget.py: a BlockMass round per attend, a DropBlocks per drop). Its
results go to sharded_budget.*.

--pool-fraction F sizes each node's pool to F of the sequence (0.4: three nodes of 40%): the
sequence is longer than any node holds and spills when its node is full (4 node processes:
the fourth holds "1 node", a sequence of the sharded one's largest extent, the per-node
attend it is made of).

--pin-nodes pins each node process to one core (round robin, the 2-node sequence's nodes
first, so its halves get a core each; the client is left free): a node with compute of its
own, as on a device each. Unpinned, this 2-core VM's scheduler may keep both nodes on one
core for a whole run (Linux skips balancing a core whose idle periods are short), and their
attends then cannot overlap however the client sends them.

Writes sharded.json (every step's time, each mode's median and its ratio to one node) and
sharded.md (the table) into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.plots import pyplot, save
from pagedkv.client import CacheClient, LayerAttention, Sequence
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos.spec import ModelSpec

Q_HEADS = 8
RESULTS = Path(__file__).resolve().parent / "results"


class Inline(Executor):
    """Runs every submitted call at once on the caller's thread (the sequential baseline)."""

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)
        return future


class Answered:
    """A node call's reply, already read (the one-by-one baseline's start_attend)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


@contextmanager
def one_by_one(client: CacheClient, seq: Sequence) -> Iterator[None]:
    """seq's steps with each node call answered before the next is sent: its nodes'
    start_attend made blocking (and, for a revision that ran the calls on the client's
    threads, those threads replaced by the caller's)."""
    datas = [client.node(e.route.address).data for e in seq.extents]
    pool = client._pool
    client._pool = Inline()  # type: ignore[assignment]
    for data in datas:
        data.start_attend = lambda *a, _data=data, **kw: Answered(_data.attend(*a, **kw))  # type: ignore[method-assign]
    try:
        yield
    finally:
        client._pool = pool
        for data in datas:
            vars(data).pop("start_attend", None)


def pin_nodes(cluster: LocalCluster, first: Sequence) -> dict[str, int]:
    """Every thread of each node process pinned to one core, round robin over this process's
    cores, the nodes of `first`'s extents first; {node address: core}."""
    cores = sorted(os.sched_getaffinity(0))
    pids = {a: cluster.procs[f"node-{i}"].pid for i, a in enumerate(cluster.node_addresses)}
    order = [e.route.address for e in first.extents]
    order += [a for a in pids if a not in order]
    placed = {}
    for i, address in enumerate(order):
        placed[address] = core = cores[i % len(cores)]
        for tid in os.listdir(f"/proc/{pids[address]}/task"):
            os.sched_setaffinity(int(tid), {core})
    return placed


def fill(seq: Sequence, spec: ModelSpec, length: int, first_id: int = 0) -> None:
    chunk = 1024
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        k = torch.randn(spec.num_layers, n, spec.num_kv_heads, spec.head_dim)
        seq.append(list(range(first_id + start, first_id + start + n)), k, k)


def step(client: CacheClient, seq: Sequence, spec: ModelSpec, token: int) -> float:
    q = torch.randn(Q_HEADS, spec.head_dim)
    kv = torch.randn(spec.num_kv_heads, spec.head_dim)
    start = time.perf_counter()
    for layer in range(spec.num_layers):
        seq.attend(layer, q, kv, kv, token if layer == 0 else None)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=60, help="timed decode steps per mode")
    p.add_argument("--smoke", action="store_true", help="the smallest run (tests)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    p.add_argument(
        "--node-threads",
        type=int,
        default=0,
        help="torch threads per node process (OMP_NUM_THREADS; 0: torch's default, every core)",
    )
    p.add_argument("--window", type=int, default=0, help="a sliding window on every layer (0: none)")
    p.add_argument("--pin-nodes", action="store_true", help="each node process on one core (see above)")
    p.add_argument(
        "--budget",
        type=int,
        default=0,
        help="a token budget of this many tokens on every sequence, 0: none (results in sharded_budget.*)",
    )
    p.add_argument(
        "--pool-fraction",
        type=float,
        default=0.0,
        help="each node's pool holds this fraction of the sequence (e.g. 0.4): it spills on capacity, "
        "over 4 node processes; 1 node holds its largest extent (results in sharded_pool.*)",
    )
    args = p.parse_args()
    length, steps = (256, 4) if args.smoke else (args.length, args.steps)
    fraction = args.pool_fraction
    margin = (2 * steps + 10) // 16 + 2  # blocks the decode steps may add to a sequence's tail
    # with a fraction, a node holds its share and room for the decode steps
    num_blocks = -(-int(fraction * length) // 16) + margin if fraction else 2 * length // 16 + 64
    node = NodeOptions(
        num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, num_blocks=num_blocks, host_blocks=0
    )
    spec = ModelSpec(node.num_layers, node.num_kv_heads, node.head_dim, node.dtype, node.block_size)
    log_dir = tempfile.mkdtemp(prefix="sharded-")
    env = {"OMP_NUM_THREADS": str(args.node_threads)} if args.node_threads else {}
    with LocalCluster(4 if fraction else 3, node, secure=False, log_dir=log_dir, env=env) as cluster:
        client = CacheClient(coordinator=cluster.coordinator_address, spec=spec)
        try:
            client.connect()
            seqs: dict[str, Sequence] = {}
            for extents in () if fraction else (1, 2, 3):
                cap = -(-length // extents // 16) * 16
                attention = [LayerAttention(window=args.window)] * node.num_layers if args.window else None
                seq = client.open(f"len-{extents}", [0], max_extent_tokens=cap, attention=attention)
                fill(seq, spec, length)
                seq.max_extent_tokens = None  # decode grows the tail
                assert len(seq.extents) == extents, seq.extents
                if args.budget:  # one node keeps it; over several the client does (exact mass rounds)
                    seq.set_budget(args.budget, 1, 4)
                seqs[f"{extents} node{'s' if extents > 1 else ''}"] = seq
            if fraction:  # longer than any node holds: it spills when a node is full
                seq = client.open("spills", [0])
                fill(seq, spec, length)
                # a full extent's tokens less the margin, other ids (no prefix hit): opened with
                # its prompt, so that placement sees the blocks it needs and picks the empty node
                held = (num_blocks - margin) * 16
                time.sleep(cluster.lease_ttl_s)  # the nodes' beats tell the coordinator which are full
                share = client.open("share", list(range(1 << 20, (1 << 20) + held)))
                fill(share, spec, held, first_id=1 << 20)
                seqs = {"1 node": share, f"{len(seq.extents)} nodes": seq}
                assert len(share.extents) == 1, share.extents
            # the one by one mode and the pinning follow the goal's 2 nodes, or the spilled one
            sharded = max(seqs, key=lambda m: len(seqs[m].extents)) if fraction else "2 nodes"
            if args.pin_nodes:
                pin_nodes(cluster, seqs[sharded])
            modes = [*seqs, f"{sharded}, one by one"]
            times: dict[str, list[float]] = {m: [] for m in modes}
            attends = dict.fromkeys(modes, 0)
            for i in range(steps + 5):
                for mode in modes if i % 2 else modes[::-1]:  # each mode after every other
                    seq = seqs.get(mode, seqs[sharded])
                    before = client.counters["sharded_attends"]
                    if mode.endswith("one by one"):
                        with one_by_one(client, seq):
                            took = step(client, seq, spec, 100 + i)
                    else:
                        took = step(client, seq, spec, 100 + i)
                    if i >= 5:  # warm-up
                        times[mode].append(took)
                        attends[mode] += client.counters["sharded_attends"] - before
            for seq in seqs.values():
                seq.close()
        finally:
            client.close()
    base = statistics.median(times["1 node"])
    load = os.getloadavg()[0]
    title = (
        f"decode step ({spec.num_layers} layers, {length} tokens, {Q_HEADS} q heads, "
        f"{node.num_kv_heads} kv heads, D {node.head_dim}), median of {steps}, load {load:.1f}, "
        f"torch threads per node: {args.node_threads or 'default'}"
        + (f", window {args.window}" if args.window else "")
        + (", nodes pinned to cores" if args.pin_nodes else "")
        + (f", token budget {args.budget}" if args.budget else "")
        + (
            f", node pools {fraction:.0%} of it (spilled on capacity; 1 node holds "
            f"{(num_blocks - margin) * 16} tokens, a full extent's less the decode margin)"
            if fraction
            else ""
        )
    )
    lines = [title, "", "| mode | ms | x one node | node calls a layer |", "|---|---|---|---|"]
    print(title)
    for mode in modes:
        med = statistics.median(times[mode])
        # sharded_attends counts the calls of steps over several nodes; a single call is not counted
        calls = max(attends[mode] / (steps * spec.num_layers), 1.0)
        lines.append(f"| {mode} | {med * 1e3:.3f} | {med / base:.2f}x | {calls:.1f} |")
        print(f"  {mode:22s} {med * 1e3:8.3f} ms   {med / base:5.2f}x one node   {calls:.1f} calls a layer")
    args.out.mkdir(parents=True, exist_ok=True)
    name = "sharded_pool" if fraction else "sharded_budget" if args.budget else "sharded"
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    medians = {mode: statistics.median(times[mode]) for mode in modes}
    raw = {
        "length": length,
        "steps": steps,
        "load": load,
        "window": args.window,
        "pinned": args.pin_nodes,
        "budget": args.budget,
        "pool_fraction": fraction,
        "median_ms": {mode: med * 1e3 for mode, med in medians.items()},
        "ratio": {mode: med / base for mode, med in medians.items()},
        "seconds": times,
    }
    (args.out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    plot(times, title, args.out / f"{name}.png")


def plot(times: dict[str, list[float]], title: str, path: Path) -> None:
    """Step latency (median, quartiles) against the number of nodes the sequence spans."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for mode, label in (("nodes", "parallel attends"), ("one by one", "one by one")):
        xs, meds, lows, highs = [], [], [], []
        for name, samples in times.items():
            if (mode == "one by one") != name.endswith("one by one"):
                continue
            ms = sorted(t * 1e3 for t in samples)
            xs.append(int(name.split()[0]))
            meds.append(statistics.median(ms))
            lows.append(ms[len(ms) // 4])
            highs.append(ms[3 * len(ms) // 4])
        ax.errorbar(
            xs,
            meds,
            yerr=[
                [m - lo for m, lo in zip(meds, lows, strict=True)],
                [h - m for m, h in zip(meds, highs, strict=True)],
            ],
            marker="o",
            capsize=3,
            label=label,
        )
    ax.set_xlabel("nodes holding the sequence (extents)")
    ax.set_ylabel("decode step, ms (median, quartiles)")
    ax.set_xticks([1, 2, 3])
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=6)
    ax.legend()
    save(fig, path)


if __name__ == "__main__":
    main()
