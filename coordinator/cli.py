"""`pagedkv coordinator`: run the control plane.

Every flag has an environment variable (PAGEDKV_*) as its default, for
containers. Without --redis the state lives in an embedded in-process store
(fine for one coordinator on one machine; use Redis for restarts and replicas).

A mistake in a flag, the tenants file or the Redis URL, or a port already taken, is
one line on stderr and exit code 2 (pagedkv/usage.py). Redis being down is not a
mistake: the coordinator starts, answers UNAVAILABLE, and recovers when Redis does.

Security (deploy/README.md): --tenants authenticates workers; the cluster secret
(--cluster-secret-file) authenticates nodes and signs the tickets workers present
to them; --tls-* put TLS on its port and on its channels to the nodes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from prometheus_client import start_http_server

from pagedkv import __version__
from pagedkv.logs import add_logging_args, setup_logging
from pagedkv.trust_args import add_trust_args, keys_from_args, tls_from_args
from pagedkv.usage import (
    Parser,
    UsageError,
    budget_float,
    check_port_free,
    port_in_use,
    port_or_off,
    positive_float,
    run,
    split_host_port,
)

from ..protos.errors import InvalidArgument, PagedKVError
from ..protos.serving import raise_open_files_limit
from .auth import DEFAULT_TICKET_TTL_S, ClusterAccess, Tenants
from .core import Coordinator, CoordinatorConfig
from .metrics import CoordinatorMetrics
from .service import create_server
from .store import open_store

log = logging.getLogger("pagedkv.coordinator")


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = Parser(
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
        type=port_or_off("--metrics-port"),
        default=env("PAGEDKV_METRICS_PORT", "off"),
        help="serve Prometheus /metrics on this port of the --listen host [PAGEDKV_METRICS_PORT] "
        "(0 = any free port, off = none; default off)",
    )
    p.add_argument(
        "--frame-port",
        type=port_or_off("--frame-port"),
        default=env("PAGEDKV_FRAME_PORT", "0"),
        help="framed port on the --listen host: Open, Close and the nodes' beats and events without "
        "gRPC's per-call cost, advertised in the replies [PAGEDKV_FRAME_PORT] (0 = any free port, "
        "the default; off = none: every call takes gRPC). TLS as the gRPC port",
    )
    p.add_argument(
        "--tenants",
        default=env("PAGEDKV_TENANTS_FILE", ""),
        help="JSON file mapping bearer tokens to tenants and tenants to block quotas "
        "[PAGEDKV_TENANTS_FILE]; empty = no auth, one tenant 'default'",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=positive_float("--lease-ttl-s"),
        default=env("PAGEDKV_LEASE_TTL_S", "3"),
        help="a node is dead after this long without a heartbeat [PAGEDKV_LEASE_TTL_S] (default 3)",
    )
    p.add_argument(
        "--max-beats-per-s",
        type=budget_float("--max-beats-per-s"),
        default=env("PAGEDKV_MAX_BEATS_PER_S", "500"),
        help="the fleet's heartbeats a second the lease is sized for: it doubles (up to 16x "
        "--lease-ttl-s) while the nodes' beats, one each quarter lease, would pass this, so a large "
        "fleet beats less often and is declared dead later [PAGEDKV_MAX_BEATS_PER_S] (default 500; "
        "0: the lease stays --lease-ttl-s)",
    )
    p.add_argument(
        "--event-flush-s",
        type=positive_float("--event-flush-s"),
        default=env("PAGEDKV_EVENT_FLUSH_S", "0.01"),
        help="under a stream of nodes' event reports, apply them to the store at most this often, "
        "in one round trip for all [PAGEDKV_EVENT_FLUSH_S] (default 0.01; after a quiet spell a "
        "report is applied at once)",
    )
    p.add_argument(
        "--ticket-ttl-s",
        type=positive_float("--ticket-ttl-s"),
        default=env("PAGEDKV_TICKET_TTL_S", str(int(DEFAULT_TICKET_TTL_S))),
        help="how long a worker's ticket for a sequence is valid [PAGEDKV_TICKET_TTL_S] (default 86400: "
        "a sequence open longer is looked up again, client.sequence(id))",
    )
    add_trust_args(p)
    add_logging_args(p)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    run("pagedkv coordinator", lambda: serve(args))


def serve(args: argparse.Namespace) -> None:
    raise_open_files_limit()  # a connection per node on the framed port
    host, port = split_host_port(args.listen, "--listen")
    check_port_free("gRPC", "--listen", host, port)
    if args.metrics_port:
        check_port_free("metrics", "--metrics-port", host, args.metrics_port)
    if args.frame_port:
        check_port_free("framed", "--frame-port", host, args.frame_port)
    try:
        tenants = Tenants.load(args.tenants)
    except InvalidArgument as exc:
        raise UsageError(f"{exc} (--tenants; deploy/tenants.example.json shows the format)") from None
    keys = keys_from_args(args)
    tls = tls_from_args(args, server=True)
    if keys is None:
        log.warning(
            "no cluster secret (--cluster-secret-file): any process that reaches this port can register "
            "as a node, and nodes check no tickets; run on a trusted network only"
        )
    access = ClusterAccess(keys, tls, ticket_ttl_s=args.ticket_ttl_s)
    try:
        store = open_store(args.redis or "memory://")
    except InvalidArgument as exc:
        raise UsageError(f"--redis: {exc} (e.g. redis://127.0.0.1:6379/0)") from None
    try:
        store.ping()
    except PagedKVError as exc:
        log.warning("Redis at %s does not answer (%s); serving UNAVAILABLE until it does", args.redis, exc)
    config = CoordinatorConfig(
        lease_ttl_s=args.lease_ttl_s,
        quotas=tenants.quotas,
        access=access,
        event_flush_s=args.event_flush_s,
        max_beats_per_s=args.max_beats_per_s,
    )
    coordinator = Coordinator(store, config)
    metrics = CoordinatorMetrics(
        coordinator,
        tenants=set(tenants.tokens.values()),
        quotas=tenants.quotas,
        info={"version": __version__, "store": "redis" if args.redis else "embedded"},
    )
    if hasattr(store, "observer"):  # the Redis store reports each call's latency and outcome
        store.observer = metrics.observe_redis
    try:
        server, port = create_server(
            coordinator, args.listen, tenants=tenants, metrics=metrics, tls=tls, frame_port=args.frame_port
        )
    except (OSError, RuntimeError):  # the probe above raced with another process
        store.close()
        raise port_in_use("gRPC", "--listen", host, port) from None
    metrics_address = ""
    if args.metrics_port is not None:
        try:
            http, _ = start_http_server(args.metrics_port, addr=host, registry=metrics.registry)
        except OSError:
            store.close()
            raise port_in_use("metrics", "--metrics-port", host, args.metrics_port) from None
        metrics_address = f"{host}:{http.server_address[1]}"
    coordinator.start()
    server.start()
    shown = args.listen.rsplit(":", 1)[0]
    print(f"pagedkv coordinator listening on {shown}:{port} (store: {args.redis or 'embedded'})", flush=True)
    for framed in server.companions:
        print(f"framed port {shown}:{framed.port} (Open, Close, Heartbeat, ReportEvents)", flush=True)
    if metrics_address:
        print(f"metrics on http://{metrics_address}/metrics", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.stop(grace_s=5)
    coordinator.stop()
    store.close()
