"""`pagedkv node`: run one cache node (gRPC on --listen, Prometheus on --metrics-port).

Every flag has an environment default (PAGEDKV_<FLAG>, e.g. PAGEDKV_NUM_BLOCKS),
so a container is configured by env alone. SIGTERM / SIGINT stop it gracefully:
health flips to NOT_SERVING, running calls get --grace-s to finish.

Everything a user can get wrong (a port in use, a pool larger than the machine, a device
it does not have, a missing certificate) is checked before the pool is allocated and reported
as one line, exit code 2 (pagedkv/usage.py).

Security (deploy/README.md): it listens on loopback unless told (--listen). In a cluster,
the cluster secret (--cluster-secret-file) makes it take control calls from its coordinator
only and data calls with the coordinator's tickets only; standalone, --token-file makes every
call need that bearer token; --tls-* put TLS on its gRPC and bulk TCP ports.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

from pagedkv import __version__
from pagedkv.logs import add_logging_args, setup_logging
from pagedkv.trust_args import add_trust_args, keys_from_args, tls_from_args
from pagedkv.usage import (
    Parser,
    UsageError,
    available_memory_bytes,
    check_port_free,
    human_bytes,
    parse_bytes,
    port_in_use,
    port_or_off,
    positive_float,
    positive_int,
    run,
    split_host_port,
)

from ..protos.errors import InvalidArgument
from ..protos.spec import ModelSpec
from ..protos.tls import TlsConfig
from .gate import NodeTrust  # (no torch: the pool's imports wait until the node runs)

log = logging.getLogger("pagedkv.node")


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
    # String defaults go through each flag's type, so a bad PAGEDKV_* value is reported
    # like a bad flag (one line, exit 2) instead of failing while the parser is built.
    p = Parser(
        prog="pagedkv node",
        description="Run one cache node: a preallocated KV block pool for one model shape, "
        "served over gRPC. Every flag defaults to the environment variable PAGEDKV_<FLAG>.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    spec = p.add_argument_group("model spec (the one KV shape this node serves)")
    spec.add_argument(
        "--num-layers",
        type=positive_int("--num-layers"),
        default=_env("NUM_LAYERS", "32"),
        help="transformer layers (KV of every layer lives in each block)",
    )
    spec.add_argument(
        "--num-kv-heads",
        type=positive_int("--num-kv-heads"),
        default=_env("NUM_KV_HEADS", "8"),
        help="key/value heads per layer (after GQA grouping)",
    )
    spec.add_argument(
        "--head-dim", type=positive_int("--head-dim"), default=_env("HEAD_DIM", "128"), help="head dimension"
    )
    spec.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default=_env("DTYPE", "bfloat16"),
        help="KV dtype; requests in another dtype are refused",
    )
    spec.add_argument(
        "--block-size",
        type=positive_int("--block-size"),
        default=_env("BLOCK_SIZE", "16"),
        help="tokens per block (the unit of sharing and eviction)",
    )
    spec.add_argument(
        "--model-id",
        default=_env("MODEL_ID", ""),
        help="the weights this node's KV belongs to (e.g. org/name@revision): workers of another "
        "model are refused, whatever their shape (default: not named)",
    )
    pool = p.add_argument_group("memory (give blocks or bytes; bytes are rounded down to whole blocks)")
    pool.add_argument(
        "--num-blocks",
        type=positive_int("--num-blocks"),
        default=_env("NUM_BLOCKS", None),
        help="device pool size in blocks",
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
        "--device",
        default=_env("DEVICE", ""),
        help="torch device (cpu, cuda, cuda:1); empty or auto picks cuda when present, else cpu",
    )
    p.add_argument(
        "--listen",
        default=_env("LISTEN", "127.0.0.1:50051"),
        help="gRPC address host:port (port 0: any); 0.0.0.0:PORT serves other hosts: give it a cluster "
        "secret or a token, and TLS",
    )
    p.add_argument(
        "--metrics-port",
        type=port_or_off("--metrics-port"),
        default=_env("METRICS_PORT", "9400"),
        help="HTTP port for Prometheus /metrics on the --listen host (0: any free port, off: none)",
    )
    p.add_argument(
        "--bulk-port",
        type=_bulk_port,
        default=_env("BULK_PORT", "auto"),
        help="raw TCP side channel (large KV transfers, the per-step attend calls) on the --listen "
        "host (auto: any free port; 0 or off: none, clients use gRPC); advertised in the node's Stats",
    )
    bulk = p.add_argument_group("bulk channel limits (what no client can take from it)")
    bulk.add_argument(
        "--bulk-max-connections",
        type=positive_int("--bulk-max-connections"),
        default=_env("BULK_MAX_CONNECTIONS", "64"),
        help="connections per bulk listener (TCP, and the same-host socket); more are closed at once",
    )
    bulk.add_argument(
        "--bulk-max-per-peer",
        type=positive_int("--bulk-max-per-peer"),
        default=_env("BULK_MAX_PER_PEER", "16"),
        help="bulk connections per peer (an IP address; a local process)",
    )
    bulk.add_argument(
        "--bulk-idle-timeout-s",
        type=positive_float("--bulk-idle-timeout-s"),
        default=_env("BULK_IDLE_TIMEOUT_S", "60"),
        help="a bulk connection that sends nothing for this long is closed",
    )
    bulk.add_argument(
        "--bulk-request-timeout-s",
        type=positive_float("--bulk-request-timeout-s"),
        default=_env("BULK_REQUEST_TIMEOUT_S", "30"),
        help="a bulk request must arrive within this, plus its payload at 4 MiB/s",
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
        "--token-file",
        default=_env("NODE_TOKEN_FILE", ""),
        help="a standalone node (no --coordinator): every call but Stats, Ping and health needs "
        "`authorization: Bearer <the file's first line>` (or $PAGEDKV_NODE_TOKEN)",
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
        "--max-workers",
        type=positive_int("--max-workers"),
        default=_env("MAX_WORKERS", "16"),
        help="gRPC handler threads",
    )
    p.add_argument(
        "--grace-s",
        type=positive_float("--grace-s"),
        default=_env("GRACE_S", "10"),
        help="seconds running calls get to finish on SIGTERM",
    )
    add_trust_args(p)
    add_logging_args(p)
    return p


def node_trust(args: argparse.Namespace, node_id: str) -> tuple[NodeTrust, TlsConfig | None]:
    """(NodeTrust, TlsConfig or None) of the flags; UsageError for a bad combination."""
    keys = keys_from_args(args)
    tls = tls_from_args(args, server=True)
    token = os.environ.get("PAGEDKV_NODE_TOKEN", "")
    if args.token_file:
        try:
            token = open(args.token_file).readline().strip()  # noqa: SIM115 - one line
        except OSError as exc:
            raise UsageError(f"--token-file {args.token_file}: {exc.strerror or exc}") from None
        if not token:
            raise UsageError(f"--token-file {args.token_file}: the first line is empty")
    if token and args.coordinator:
        raise UsageError(
            "--token-file is for a standalone node: a node in a cluster takes its coordinator's tickets "
            "(give it --cluster-secret-file instead)"
        )
    if keys is not None and not args.coordinator:
        log.warning(
            "a cluster secret is for a node in a cluster (--coordinator): ignored on a standalone node"
        )
        keys = None
    if args.coordinator and keys is None:
        log.warning(
            "no cluster secret (--cluster-secret-file): this node's ports take any caller's data and "
            "control calls; run it on a trusted network only"
        )
    return NodeTrust(keys, token, node_id), tls


def check_device(device: str) -> str:
    """The torch device to use ('' = cuda when present, else cpu); UsageError for one this
    machine does not have."""
    import torch

    if device in ("", "auto"):
        return ""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r} is not a torch device (cpu, cuda, cuda:1, ...)") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"--device {device}: this machine has no CUDA device (or torch {torch.__version__} was "
                "built without CUDA): run with --device cpu, or install a CUDA build of torch"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise UsageError(f"--device {device}: pagedkv nodes run on cpu or cuda")
    return device


def check_memory(spec: ModelSpec, num_blocks: int, host_blocks: int, device: str) -> None:
    """Refuse a pool the machine cannot hold, before allocating it (the allocator's own
    failure is a traceback, or the OOM killer later)."""
    import torch

    on_cuda = device.startswith("cuda") or (device == "" and torch.cuda.is_available())
    device_bytes, host_bytes = num_blocks * spec.bytes_per_block, host_blocks * spec.bytes_per_block
    checks = [(host_bytes + (0 if on_cuda else device_bytes), available_memory_bytes(), "memory")]
    if on_cuda:
        free, _total = torch.cuda.mem_get_info(torch.device(device or "cuda"))
        checks.append((device_bytes, free, f"free memory on {device or 'cuda'}"))
    for need, have, what in checks:
        if have is not None and need > have:
            raise UsageError(
                f"the pool needs {human_bytes(need)} ({num_blocks} device + {host_blocks} host blocks of "
                f"{human_bytes(spec.bytes_per_block)}) but this machine has {human_bytes(have)} of {what} "
                "available: lower --num-blocks / --pool-bytes (and --host-blocks / --host-bytes)"
            )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    run("pagedkv node", lambda: serve(args))


def serve(args: argparse.Namespace) -> None:
    host, listen_port = split_host_port(args.listen, "--listen")
    check_port_free("gRPC", "--listen", host, listen_port)
    trust, tls = node_trust(args, args.node_id)  # (its registration names it: CoordinatorLink)
    if args.bulk_port:
        check_port_free("bulk KV", "--bulk-port", host, args.bulk_port)
    if args.metrics_port:
        check_port_free("metrics", "--metrics-port", host, args.metrics_port)
    if args.coordinator:
        split_host_port(args.coordinator, "--coordinator")
    try:
        spec = ModelSpec(
            args.num_layers, args.num_kv_heads, args.head_dim, args.dtype, args.block_size, args.model_id
        )
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    num_blocks = args.num_blocks if args.num_blocks is not None else spec.blocks_for_bytes(args.pool_bytes)
    host_blocks = args.host_blocks if args.host_blocks is not None else spec.blocks_for_bytes(args.host_bytes)
    if num_blocks < 1:
        raise UsageError(
            f"--pool-bytes {args.pool_bytes} holds no block of {spec.bytes_per_block} B: give a larger pool"
        )
    if host_blocks < 0:
        raise UsageError(f"--host-blocks {host_blocks} must be 0 or more")

    from .engine import CacheEngine, EngineConfig  # torch loads only when the node runs
    from .metrics import NodeMetrics
    from .serve import BulkLimits
    from .server import create_server

    device = check_device(args.device)
    check_memory(spec, num_blocks, host_blocks, device)
    try:
        engine = CacheEngine(
            EngineConfig(
                spec,
                num_blocks,
                host_blocks,
                policy=args.policy,
                device=device,
                compute_thread=args.compute_thread == "on",
            )
        )
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    metrics = NodeMetrics()
    metrics.describe(
        version=__version__,
        spec=spec.to_dict(),
        bytes_per_block=spec.bytes_per_block,
        device=str(engine.device),
        policy=args.policy,
    )
    try:
        server, port = create_server(
            engine,
            args.listen,
            max_workers=args.max_workers,
            metrics=metrics,
            bulk_port=args.bulk_port,
            trust=trust,
            tls=tls,
            bulk_limits=BulkLimits(
                max_connections=args.bulk_max_connections,
                max_per_peer=args.bulk_max_per_peer,
                idle_timeout_s=args.bulk_idle_timeout_s,
                frame_timeout_s=args.bulk_request_timeout_s,
            ),
        )
    except (OSError, RuntimeError) as exc:  # the probe above raced with another process
        taken = "bulk KV" if isinstance(exc, OSError) and args.bulk_port else "gRPC"
        raise port_in_use(
            taken,
            "--bulk-port" if taken == "bulk KV" else "--listen",
            host,
            args.bulk_port if taken == "bulk KV" else listen_port,
        ) from None
    metrics_address = ""
    if args.metrics_port is not None:
        try:
            http, _ = metrics.serve(args.metrics_port, addr=host)
        except OSError:
            server.stop(0)
            raise port_in_use("metrics", "--metrics-port", host, args.metrics_port) from None
        metrics_address = f"{host}:{http.server_address[1]}"
    if args.coordinator:  # fenced from its first call: no data call before it holds a lease
        server.gate.keep_lease()
    server.start()
    shown = args.listen.rsplit(":", 1)[0]
    print(
        f"pagedkv node listening on {shown}:{port} ({num_blocks} blocks of {spec.bytes_per_block} B, "
        f"{host_blocks} host blocks, {engine.device}, policy {args.policy})",
        flush=True,
    )
    if server.bulk is not None:
        print(f"bulk KV channel on {shown}:{server.bulk.port}", flush=True)
    if metrics_address:
        print(f"metrics on http://{metrics_address}/metrics", flush=True)

    link = None
    if args.coordinator:
        from .coordinator_link import CoordinatorLink

        advertise = args.advertise or f"{shown}:{port}"
        # what Prometheus (and `pagedkv up`) should scrape: the advertised host, the bound port
        scrape = (
            f"{advertise.rsplit(':', 1)[0]}:{metrics_address.rsplit(':', 1)[1]}" if metrics_address else ""
        )
        link = CoordinatorLink(
            engine,
            args.coordinator,
            args.node_id or advertise,
            advertise,
            metrics_address=scrape,
            keys=trust.keys,
            tls=tls,
            gate=server.gate,
        ).start()
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
