"""`pagedkv node`: run one cache node (gRPC on --listen, Prometheus on --metrics-port).

Every flag has an environment default (PAGEDKV_<FLAG>, e.g. PAGEDKV_NUM_BLOCKS),
so a container is configured by env alone. SIGTERM / SIGINT stop it gracefully:
health flips to NOT_SERVING, running calls get --grace-s to finish.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading

from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
          "tib": 1 << 40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """ "2GiB" -> 2147483648; "512MB" -> 512000000; "1024" -> 1024."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _env(name: str, default: str | None) -> str | None:
    return os.environ.get(f"PAGEDKV_{name}", default)


def _bulk_port(value: str) -> int | None:
    """--bulk-port: "auto" -> 0 (any free port), "0"/"off" -> None (no bulk channel), else the port."""
    if value in ("auto", ""):
        return 0
    if value in ("0", "off"):
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bulk-port {value!r}: a port, 'auto' or 'off'") from None
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"--bulk-port {port} outside 1..65535")
    return port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv node",
        description="Run one cache node: a preallocated KV block pool for one model shape, "
        "served over gRPC. Every flag defaults to the environment variable PAGEDKV_<FLAG>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    spec = p.add_argument_group("model spec (the one KV shape this node serves)")
    spec.add_argument(
        "--num-layers",
        type=int,
        default=int(_env("NUM_LAYERS", "32") or 32),
        help="transformer layers (KV of every layer lives in each block)",
    )
    spec.add_argument(
        "--num-kv-heads",
        type=int,
        default=int(_env("NUM_KV_HEADS", "8") or 8),
        help="key/value heads per layer (after GQA grouping)",
    )
    spec.add_argument(
        "--head-dim", type=int, default=int(_env("HEAD_DIM", "128") or 128), help="head dimension"
    )
    spec.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=_env("DTYPE", "bfloat16"),
        help="KV dtype; requests in another dtype are refused",
    )
    spec.add_argument(
        "--block-size",
        type=int,
        default=int(_env("BLOCK_SIZE", "16") or 16),
        help="tokens per block (the unit of sharing and eviction)",
    )
    pool = p.add_argument_group("memory (give blocks or bytes; bytes are rounded down to whole blocks)")
    pool.add_argument(
        "--num-blocks", type=int, default=_env("NUM_BLOCKS", None), help="device pool size in blocks"
    )
    pool.add_argument(
        "--pool-bytes",
        type=parse_bytes,
        default=_env("POOL_BYTES", "1GiB"),
        help="device pool size in bytes, e.g. 2GiB (used when --num-blocks is not set)",
    )
    pool.add_argument(
        "--host-blocks",
        type=int,
        default=_env("HOST_BLOCKS", None),
        help="host (swap / offload) tier size in blocks",
    )
    pool.add_argument(
        "--host-bytes",
        type=parse_bytes,
        default=_env("HOST_BYTES", "0"),
        help="host tier size in bytes (used when --host-blocks is not set); 0 disables it",
    )
    p.add_argument(
        "--policy",
        choices=["lru", "lfu", "score", "slru"],
        default=_env("POLICY", "lru"),
        help="eviction policy for cached blocks (score: least attention mass first; slru: scan-resistant)",
    )
    p.add_argument(
        "--device", default=_env("DEVICE", ""), help="torch device; empty picks cuda when present, else cpu"
    )
    p.add_argument(
        "--listen", default=_env("LISTEN", "0.0.0.0:50051"), help="gRPC address host:port (port 0: any)"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(_env("METRICS_PORT", "9400") or 9400),
        help="HTTP port for Prometheus /metrics (0: any free port, -1: off)",
    )
    p.add_argument(
        "--bulk-port",
        type=_bulk_port,
        default=_env("BULK_PORT", "auto"),
        help="raw TCP side channel (large KV transfers, the per-step attend calls) on the --listen host "
        "(auto: any free port; 0 or off: none, clients use gRPC); advertised in the node's Stats",
    )
    cluster = p.add_argument_group("cluster (leave --coordinator empty for a standalone node)")
    cluster.add_argument(
        "--coordinator", default=_env("COORDINATOR", ""), help="coordinator host:port to register with"
    )
    cluster.add_argument(
        "--advertise",
        default=_env("ADVERTISE", ""),
        help="host:port workers reach this node at (default: the --listen address, with the bound port)",
    )
    cluster.add_argument(
        "--node-id", default=_env("NODE_ID", ""), help="stable node name (default: the advertised address)"
    )
    p.add_argument(
        "--compute-thread",
        choices=["on", "off"],
        default=_env("COMPUTE_THREAD", "off"),
        help="on: every engine call runs on one thread of the node's, so the process keeps one torch "
        "thread pool whose threads spin between ops (GOMP_SPINCOUNT): faster kernels, for a node with "
        "cores of its own; off: on the handler thread that received it, where libgomp's oversubscription "
        "guard keeps the pools from spinning: better when workers share the node's cores (on a 2-core "
        "host, decode at batch 1 ran 100-118 tok/s with it on vs 203-219 off)",
    )
    p.add_argument(
        "--max-workers", type=int, default=int(_env("MAX_WORKERS", "16") or 16), help="gRPC handler threads"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=float(_env("GRACE_S", "10") or 10),
        help="seconds running calls get to finish on SIGTERM",
    )
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .engine import CacheEngine, EngineConfig  # torch loads only when the node runs
    from .metrics import NodeMetrics
    from .server import create_server

    try:
        spec = ModelSpec(args.num_layers, args.num_kv_heads, args.head_dim, args.dtype, args.block_size)
        num_blocks = (
            int(args.num_blocks) if args.num_blocks is not None else spec.blocks_for_bytes(args.pool_bytes)
        )
        host_blocks = (
            int(args.host_blocks) if args.host_blocks is not None else spec.blocks_for_bytes(args.host_bytes)
        )
        engine = CacheEngine(
            EngineConfig(
                spec,
                num_blocks,
                host_blocks,
                policy=args.policy,
                device="" if args.device == "auto" else args.device,
                compute_thread=args.compute_thread == "on",
            )
        )
    except InvalidArgument as exc:
        raise SystemExit(f"pagedkv node: {exc}") from None
    metrics = NodeMetrics()
    server, port = create_server(
        engine, args.listen, max_workers=args.max_workers, metrics=metrics, bulk_port=args.bulk_port
    )
    server.start()
    host = args.listen.rsplit(":", 1)[0]
    print(f"pagedkv node listening on {host}:{port} ({num_blocks} blocks of {spec.bytes_per_block} B, "
          f"{host_blocks} host blocks, {engine.device}, policy {args.policy})", flush=True)  # fmt: skip
    if server.bulk is not None:
        print(f"bulk KV channel on {host}:{server.bulk.port}", flush=True)
    if args.metrics_port >= 0:
        http, _ = metrics.serve(args.metrics_port)
        print(f"metrics on http://{host}:{http.server_address[1]}/metrics", flush=True)

    link = None
    if args.coordinator:
        from .coordinator_link import CoordinatorLink

        advertise = args.advertise or f"{host}:{port}"
        link = CoordinatorLink(engine, args.coordinator, args.node_id or advertise, advertise).start()
        print(f"joining coordinator {args.coordinator} as {args.node_id or advertise}", flush=True)

    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            print(f"signal {signum}: draining for up to {args.grace_s}s", flush=True)
            threading.Thread(target=server.stop, args=(args.grace_s,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.wait_for_termination()
    if link is not None:
        link.stop()
    print("pagedkv node stopped", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
