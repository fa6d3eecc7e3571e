"""`pagedkv coordinator`: run the control plane.

Every flag has an environment variable (PAGEDKV_*) as its default, for
containers. Without --redis the state lives in an embedded in-process store
(fine for one coordinator on one machine; use Redis for restarts and replicas).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from prometheus_client import start_http_server

from .auth import Tenants
from .core import Coordinator, CoordinatorConfig
from .metrics import CoordinatorMetrics
from .service import create_server
from .store import open_store


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="pagedkv coordinator",
        description="Run the pagedkv coordinator: membership, placement, page tables and the global "
        "prefix index. Flags default to the PAGEDKV_* environment variables named in brackets.",
    )
    p.add_argument(
        "--listen",
        default=env("PAGEDKV_LISTEN", "127.0.0.1:50050"),
        help="host:port to serve gRPC on [PAGEDKV_LISTEN] (default 127.0.0.1:50050; port 0 = any)",
    )
    p.add_argument(
        "--redis",
        default=env("PAGEDKV_REDIS_URL", ""),
        help="redis://host:port/db holding all state [PAGEDKV_REDIS_URL]; empty = embedded store",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("PAGEDKV_METRICS_PORT", "0")),
        help="serve Prometheus /metrics on this port [PAGEDKV_METRICS_PORT] (0 = off)",
    )
    p.add_argument(
        "--tenants",
        default=env("PAGEDKV_TENANTS_FILE", ""),
        help="JSON file mapping bearer tokens to tenants and tenants to block quotas "
        "[PAGEDKV_TENANTS_FILE]; empty = no auth, one tenant 'default'",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=float,
        default=float(env("PAGEDKV_LEASE_TTL_S", "3")),
        help="a node is dead after this long without a heartbeat [PAGEDKV_LEASE_TTL_S] (default 3)",
    )
    p.add_argument("--log-level", default=env("PAGEDKV_LOG_LEVEL", "INFO"), help="logging level")
    return p  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    tenants = Tenants.load(args.tenants)
    store = open_store(args.redis or "memory://")
    coordinator = Coordinator(store, CoordinatorConfig(lease_ttl_s=args.lease_ttl_s, quotas=tenants.quotas))
    metrics = CoordinatorMetrics(coordinator)
    server, port = create_server(coordinator, args.listen, tenants=tenants, metrics=metrics)
    coordinator.start()
    server.start()
    if args.metrics_port:
        start_http_server(args.metrics_port, registry=metrics.registry)
    host = args.listen.rsplit(":", 1)[0]
    print(f"pagedkv coordinator listening on {host}:{port} (store: {args.redis or 'embedded'})", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace_s=5)
    coordinator.stop()
    store.close()
