"""`pagedkv status`: the nodes of a running cluster, their usage and hit rates.

Talks to the coordinator and each node through the generated stubs alone (no client
library, so no torch): it runs from any install of pagedkv, a coordinator's included.
"""

from __future__ import annotations

import os

import grpc

from .protos import pagedkv_pb2 as pb
from .protos import pagedkv_pb2_grpc as pb_grpc
from .protos.tls import TlsConfig, secure_channel
from .trust_args import add_trust_args, tls_from_args
from .usage import Parser, run


def _fail(address: str, what: str, err: grpc.RpcError) -> SystemExit:
    detail = err.details() or err.code().name  # type: ignore[attr-defined]
    return SystemExit(f"pagedkv status: {what} {address}: {err.code().name}: {detail}")  # type: ignore[attr-defined]


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="pagedkv status", description=__doc__)
    p.add_argument(
        "--coordinator",
        default=os.environ.get("PAGEDKV_COORDINATOR", "127.0.0.1:50050"),
        help="coordinator host:port [PAGEDKV_COORDINATOR] (default 127.0.0.1:50050)",
    )
    p.add_argument(
        "--token", default=os.environ.get("PAGEDKV_TOKEN", ""), help="bearer token [PAGEDKV_TOKEN]"
    )
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline of each call (default 5)")
    add_trust_args(p, secret=False)
    args = p.parse_args(argv)
    metadata = (("authorization", f"Bearer {args.token}"),) if args.token else ()
    found: list[TlsConfig | None] = []
    run("pagedkv status", lambda: found.append(tls_from_args(args)))
    tls = found[0]

    with secure_channel(args.coordinator, tls) as channel:
        try:
            cluster = pb_grpc.CoordinatorStub(channel).Stats(
                pb.Empty(), timeout=args.timeout_s, metadata=metadata
            )
        except grpc.RpcError as err:
            raise _fail(args.coordinator, "coordinator", err) from None
    c = cluster.counters
    hit = c["cached_tokens"] / c["prompt_tokens"] if c.get("prompt_tokens") else 0.0
    live, opens, reaped = c.get("nodes_live", 0), c.get("opens", 0), c.get("nodes_reaped", 0)
    print(
        f"coordinator {args.coordinator}: {live} live nodes, {opens} opens, "
        f"prefix hit rate {hit:.1%} at open, {reaped} nodes reaped"
    )
    print(
        f"{'node':<10} {'address':<22} {'usage':>6} {'used':>6} {'cached':>6} {'free':>6} "
        f"{'host':>6} {'seqs':>5} {'hit rate':>8}  spec"
    )
    for node in cluster.nodes:
        spec = node.spec
        shape = f"{spec.num_layers}x{spec.num_kv_heads}x{spec.head_dim} {spec.dtype} /{spec.block_size}"
        with secure_channel(node.address, tls) as channel:
            try:
                s = pb_grpc.CacheNodeStub(channel).Stats(pb.Empty(), timeout=args.timeout_s).counters
            except grpc.RpcError as err:
                print(f"{node.node_id:<10} {node.address:<22} unreachable: {err.code().name}")  # type: ignore[attr-defined]
                continue
        usage = s["used_blocks"] / s["num_blocks"] if s["num_blocks"] else 0.0
        rate = s["prefix_hit_tokens"] / s["prefix_query_tokens"] if s["prefix_query_tokens"] else 0.0
        host = s["host_used_blocks"] + s["host_cached_blocks"]
        print(
            f"{node.node_id:<10} {node.address:<22} {usage:>6.1%} {s['used_blocks']:>6} "
            f"{s['cached_blocks']:>6} {s['free_blocks']:>6} {host:>6} "
            f"{s['num_sequences']:>5} {rate:>8.1%}  {shape}"
        )
