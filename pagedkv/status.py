"""`pagedkv status`: the nodes of a running cluster, their usage and hit rates."""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedkv status", description=__doc__)
    p.add_argument(
        "--coordinator",
        default=os.environ.get("PAGEDKV_COORDINATOR", "127.0.0.1:50050"),
        help="coordinator host:port [PAGEDKV_COORDINATOR] (default 127.0.0.1:50050)",
    )
    p.add_argument(
        "--token", default=os.environ.get("PAGEDKV_TOKEN", ""), help="bearer token [PAGEDKV_TOKEN]"
    )
    args = p.parse_args(argv)  # fmt: skip

    from .client import CacheClient, PagedKVError

    try:
        with CacheClient(coordinator=args.coordinator, token=args.token or None) as client:
            cluster = client.cluster_stats()
            c = cluster.counters
            hit = c.get("cached_tokens", 0) / c["prompt_tokens"] if c.get("prompt_tokens") else 0.0
            live, opens, reaped = c.get("nodes_live", 0), c.get("opens", 0), c.get("nodes_reaped", 0)
            print(f"coordinator {args.coordinator}: {live} live nodes, {opens} opens, "
                  f"prefix hit rate {hit:.1%} at open, {reaped} nodes reaped")  # fmt: skip
            print(f"{'node':<10} {'address':<22} {'usage':>6} {'used':>6} {'cached':>6} {'free':>6} "
                  f"{'host':>6} {'seqs':>5} {'hit rate':>8}")  # fmt: skip
            for node in cluster.nodes:
                try:
                    s = client.node_stats(node.address).counters
                except PagedKVError as exc:
                    print(f"{node.node_id:<10} {node.address:<22} unreachable: {exc}")
                    continue
                usage = s["used_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0
                rate = s["prefix_hit_tokens"] / s["prefix_query_tokens"] if s["prefix_query_tokens"] else 0.0
                host = s["host_used_blocks"] + s["host_cached_blocks"]
                print(f"{node.node_id:<10} {node.address:<22} {usage:>6.1%} {s['used_blocks']:>6} "
                      f"{s['cached_blocks']:>6} {s['free_blocks']:>6} {host:>6} "
                      f"{s['num_sequences']:>5} {rate:>8.1%}")  # fmt: skip
    except PagedKVError as exc:
        raise SystemExit(f"pagedkv status: {exc}") from None
