"""Prefix hit rates of the eviction policies, replayed through the node's KVCacheManager, beside
the offline optimum. Deterministic (no timing), so the numbers do not depend on the machine.

    python -m bench.hitrate [--quick] [--workloads trace16,trace1000-16,chat-issue,...]
                            [--policies lru,lfu,slru,s3fifo,arc,wtinylfu,deadpred] [--stem NAME]

Workloads: the Mooncake trace with its 512-token hash ids as the block unit (trace, trace1000:
the first 1,000 requests) and with 16-token blocks as the issue measured it (trace16,
trace1000-16); the multi-turn chat workload with long one-shot documents (chat, chat-light),
without (chat-nodoc), and the shape the issue reports (chat-issue: 300 conversations under 4
system prompts, 40 open at once, 5-17 turns; its shape is not published, so this one was
picked to give its unbounded ideal, 0.878, and LRU's 0.66-0.67 at 4,096 blocks).

Each request is admitted as the node does it (open: the cached prefix; reserve: the rest), stays
running while the next `concurrency` requests are admitted (its blocks referenced, so no policy
may evict them), then is released tail first. A request that does not fit waits for the oldest
running ones to finish. The hit rate is cached prompt tokens over prompt tokens (a prompt's last
token is always computed). `belady` is the offline optimum of the same replay: it evicts the
evictable block whose key is next wanted furthest in the future (running requests' blocks
pinned, as for every policy); `deadfirst` an oracle that only knows which keys are never wanted
again (LRU otherwise); `turnoracle` deadpred told each request's true turn number and each
turn's share of conversations that go on; `ideal` is an unbounded pool; `+host` LRU with a host
tier as large as the pool. s3fifo, arc, wtinylfu and deadpred are bench/eviction_candidates.py. Writes
bench/results/hitrate.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench import plots
from bench.eviction_candidates import CANDIDATES, BeladyPolicy, DeadFirstPolicy, TurnOraclePolicy
from bench.workloads import TRACE_BLOCK_TOKENS, ChatShape, Request, chat_requests, trace_requests
from pagedkv.cache_node.eviction import EvictionPolicy
from pagedkv.cache_node.kv_manager import KVCacheManager

ROOT = Path(__file__).resolve().parents[1]
HINTED = "+end"  # a policy name with this suffix: closes carry the end-of-conversation hint
POLICIES = ["lru", "lfu", "slru", *CANDIDATES, "lru+end"]
ORACLES = ["belady", "deadfirst", "turnoracle"]
CHAT_ISSUE = ChatShape(active=40, turns=(5, 18), document_every=0)


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[Request]
    block_size: int
    concurrency: int
    pools: list[int]
    keep: int = 0  # tokens of a request worth caching once its conversation ended (the system prompt)

    def end_hints(self) -> list[int | None]:
        """What a worker closes each request with: keep_prefix=`keep` on the last request of its
        conversation (a one-shot prompt is its own last), None (keep everything) otherwise. The
        worker knows this (it ends the session), unlike the cache; SGLang closes sessions for it."""
        last: dict[int | None, int] = {}
        for i, r in enumerate(self.requests):
            last[r.conversation if r.conversation is not None else -1 - i] = i
        ends = set(last.values())
        return [self.keep if i in ends else None for i in range(len(self.requests))]


def replay(
    w: Workload,
    num_blocks: int,
    policy: str | EvictionPolicy | Callable[[KVCacheManager], EvictionPolicy],
    num_host_blocks: int = 0,
) -> float:
    """The workload through one manager of `num_blocks` (and a host tier of `num_host_blocks`);
    returns the prefix hit rate (device and host hits). `<policy>+end`: that policy, each request
    closed with the worker's end-of-conversation hint (Workload.end_hints)."""
    bs = w.block_size
    hints: list[int | None] = [None] * len(w.requests)
    if isinstance(policy, str) and policy.endswith(HINTED):
        policy, hints = policy.removesuffix(HINTED), w.end_hints()
    wanted = [
        KVCacheManager(1, bs).block_keys(r.tokens[: (len(r.tokens) - 1) // bs * bs]) for r in w.requests
    ]
    oracle: BeladyPolicy | None = None
    if policy == "belady":
        oracle = BeladyPolicy(wanted)
    elif policy == "deadfirst":
        oracle = DeadFirstPolicy(wanted)
    elif policy == "turnoracle":
        policy = TurnOraclePolicy([r.conversation for r in w.requests])
    elif isinstance(policy, str) and policy in CANDIDATES:
        policy = CANDIDATES[policy]()
    chosen = policy if oracle is None else oracle
    observe = getattr(chosen, "observe_open", None)  # a policy that learns from opens (deadpred)
    mgr = KVCacheManager(num_blocks, bs, policy=chosen, num_host_blocks=num_host_blocks)  # type: ignore[arg-type]
    device = mgr.device
    running: deque[int] = deque()
    hit = total = 0
    for i, r in enumerate(w.requests):
        need = -(-len(r.tokens) // bs)
        if need > num_blocks:
            raise ValueError(f"{w.name}: request {i} needs {need} blocks, the pool has {num_blocks}")
        while running and (len(running) >= w.concurrency or device.num_available < need):
            done = running.popleft()
            mgr.free(str(done), hints[done])
        if oracle is not None:
            oracle.advance(wanted[i], device.block_of_key)
        rid = str(i)
        cached = mgr.open(rid, r.tokens).num_cached_tokens
        if observe is not None:
            observe(mgr.block_keys(r.tokens))
        mgr.reserve(rid, r.tokens[cached:])
        running.append(i)
        hit += cached
        total += len(r.tokens)
    return hit / total


def workloads(names: list[str], quick: bool) -> list[Workload]:
    out: list[Workload] = []
    for name in names:
        if name in ("trace", "trace1000", "trace16", "trace1000-16"):
            limit = 1000 if name.startswith("trace1000") else None
            reqs = trace_requests((150 if limit else 300) if quick else limit)
            bs, conc = (16 if name.endswith("16") else TRACE_BLOCK_TOKENS), 32
            keep = 0  # no system prompt a worker would know of
        elif name.startswith("chat"):
            shape = {
                "chat": ChatShape(active=64, document_every=4, document_tokens=(1024, 4096)),
                "chat-light": ChatShape(active=16, document_every=8, document_tokens=(1024, 4096)),
                "chat-nodoc": ChatShape(active=64, document_every=0),
                "chat-issue": CHAT_ISSUE,
            }[name]
            if quick:
                shape = ChatShape(**{**shape.__dict__, "num_conversations": 40})
            reqs = chat_requests(shape)
            bs, conc, keep = 16, 8, shape.system_tokens
        else:
            raise SystemExit(f"unknown workload {name!r}")
        distinct = len({k for r in reqs for k in KVCacheManager(1, bs).block_keys(r.tokens)})
        if name in ("trace16", "trace1000-16"):  # 10 / 40 % (Python policies: a minute a run)
            pools = [max(distinct * p // 100, 1) for p in ((10,) if name == "trace1000-16" else (10, 40))]
        elif name.startswith("trace"):  # 5 / 10 / 20 / 40 % of the distinct blocks
            pools = [max(distinct * p // 100, 1) for p in (5, 10, 20, 40)]
        else:
            pools = [1024, 2048, 4096] if quick else [2048, 4096, 8192]
        longest = max(-(-len(r.tokens) // bs) for r in reqs)
        out.append(Workload(name, reqs, bs, conc, [max(p, longest) for p in pools], keep))
    return out


def run(names: list[str], policies: list[str], quick: bool) -> dict:
    results: dict = {}
    for w in workloads(names, quick):
        unbounded = sum(-(-len(r.tokens) // w.block_size) for r in w.requests)
        row: dict = {"ideal": replay(w, unbounded, "lru"), "pools": {}}
        for pool in w.pools:
            cell = {p: replay(w, pool, p) for p in [*policies, *ORACLES]}
            if w.name.startswith("chat"):  # the host tier: LRU with as many host blocks again
                cell["+host"] = replay(w, pool, "lru", num_host_blocks=pool)
            row["pools"][pool] = cell
            print(
                f"{w.name:<11} pool {pool:>6}  " + "  ".join(f"{p} {v:.4f}" for p, v in cell.items()),
                flush=True,
            )
        results[w.name] = row
    return results


def markdown(results: dict, policies: list[str]) -> str:
    lines = [
        "# Prefix hit rate by eviction policy (bench/hitrate.py)",
        "",
        "Deterministic replay through KVCacheManager. belady: the offline optimum, running requests pinned;"
        " deadfirst: LRU that knows which keys are never wanted again; turnoracle: deadpred told the"
        " true turn numbers and each turn's chance to go on; +host: LRU with a host tier of"
        " the pool's size (device + host hits).",
        "",
        "| workload | pool blocks | "
        + " | ".join(policies)
        + " | belady | deadfirst | turnoracle | +host | best online / belady | lru / belady"
        + " | best online vs lru | ideal |",
        "|---|---:|" + "---:|" * (len(policies) + 8),
    ]
    for name, row in results.items():
        for pool, cell in row["pools"].items():
            opt, lru = cell["belady"], cell.get("lru", 0.0)
            best = max(cell[p] for p in policies)
            host = f"{cell['+host']:.4f}" if "+host" in cell else "-"
            lines.append(
                f"| {name} | {pool} | "
                + " | ".join(f"{cell[p]:.4f}" for p in policies)
                + f" | {opt:.4f} | {cell['deadfirst']:.4f} | {cell['turnoracle']:.4f} | {host}"
                f" | {best / opt:.2f} | {lru / opt:.2f}"
                f" | {best / lru - 1 if lru else 0.0:+.1%} | {row['ideal']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, policies: list[str], path: Path) -> None:
    plt = plots.pyplot()
    if plt is None:
        return
    cols = min(4, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(results) :]:
        ax.set_visible(False)
    for ax, (name, row) in zip(axes.flat, results.items(), strict=False):
        pools = list(row["pools"])
        for p in [*policies, *ORACLES]:
            style = ":" if p in ORACLES else "-"
            ax.plot(pools, [row["pools"][q][p] for q in pools], style, marker="o", label=p)
        ax.axhline(row["ideal"], color="grey", linestyle=":", label="unbounded")
        ax.set(title=name, xlabel="pool blocks", ylabel="prefix hit rate", xscale="log")
    axes[0][0].legend(fontsize=7)
    plots.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.hitrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--workloads", default="trace,trace1000,trace16,trace1000-16,chat,chat-light,chat-nodoc,chat-issue"
    )
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    p.add_argument("--stem", help="output file names (default: hitrate, or hitrate_quick)")
    args = p.parse_args(argv)
    policies = args.policies.split(",")
    start = time.perf_counter()
    results = run(args.workloads.split(","), policies, args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or ("hitrate_quick" if args.quick else "hitrate")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1))
    (out / f"{stem}.md").write_text(markdown(results, policies))
    plot(results, policies, out / f"{stem}.png")
    print(markdown(results, policies))
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
