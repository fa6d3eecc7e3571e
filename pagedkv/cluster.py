"""`pagedkv up`: a local cluster of real processes -- a coordinator and N cache
nodes on free ports, with Redis when one is given or a `redis-server` is on the
PATH (started on a free port), else the coordinator's embedded store.

The nodes serve one model shape: flags (--num-layers, --num-kv-heads, --head-dim,
--dtype, --block-size) or a transformers model's config.json (--model PATH). It
prints every port it opened: each process's gRPC address, each node's bulk KV port
and every /metrics endpoint.

`LocalCluster` is also what the demo and the integration tests start, so the
path a newcomer runs is the path the tests check. It runs secured: a fresh
cluster secret in its log folder (or --cluster-secret-file) authenticates the
nodes to the coordinator and signs the tickets workers present to the nodes, so
nothing but the coordinator's own clients reach the nodes' sequences; --tls-*
put every port on TLS (workers then need ClientConfig(tls=...)).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .health import check as health_check
from .model_config import kv_shape
from .process_env import child_env
from .protos import pagedkv_pb2 as pb
from .protos import pagedkv_pb2_grpc as pb_grpc
from .protos.errors import InvalidArgument
from .protos.spec import ModelSpec
from .protos.tickets import SECRET_ENV, SECRET_FILE_ENV
from .protos.tls import ENV as TLS_ENV
from .protos.tls import TlsConfig, secure_channel
from .trust_args import add_trust_args, tls_from_args
from .usage import UsageError, available_memory_bytes, human_bytes, parse_bytes, positive_int, run

PORT_TRIES = 3  # starts of a process whose port, picked free, was taken before it bound it


class PortTaken(RuntimeError):
    """A process of the cluster exited because a port it was given is in use."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class NodeOptions:
    """The model shape and pool of every node in a local cluster."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 2048
    host_blocks: int = 1024
    policy: str = "lru"
    bulk_port: str = "auto"  # each node's bulk KV port: auto (a free one) or off
    extra_args: tuple[str, ...] = ()  # more `pagedkv node` flags, as given
    model_id: str = ""  # the weights the KV belongs to ("": not named)

    def args(self) -> list[str]:
        return [
            f"--num-layers={self.num_layers}",
            f"--num-kv-heads={self.num_kv_heads}",
            f"--head-dim={self.head_dim}",
            f"--dtype={self.dtype}",
            f"--block-size={self.block_size}",
            f"--num-blocks={self.num_blocks}",
            f"--host-blocks={self.host_blocks}",
            f"--policy={self.policy}",
            f"--bulk-port={self.bulk_port}",
            *([f"--model-id={self.model_id}"] if self.model_id else []),
            *self.extra_args,
        ]

    @classmethod
    def for_spec(cls, spec: ModelSpec, **options: Any) -> NodeOptions:
        """Nodes serving `spec` (its shape and model), with the other options given."""
        shape = spec.to_dict()
        return cls(model_id=shape.pop("model"), **shape, **options)

    def spec(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "model": self.model_id,
        }

    def describe(self) -> str:
        s = ModelSpec(**self.spec())
        pool = human_bytes(self.num_blocks * s.bytes_per_block)
        return (
            (f"{s.model}: " if s.model else "")
            + f"{s.num_layers} layers x {s.num_kv_heads} KV heads x head_dim {s.head_dim}, {s.dtype}, "
            f"{s.block_size} tokens/block; per node {self.num_blocks} blocks ({pool}) "
            f"+ {self.host_blocks} host blocks"
        )


@dataclass(frozen=True)
class NodeEndpoints:
    """What one running node listens on."""

    node_id: str
    address: str
    bulk_port: int  # 0: off
    metrics_address: str  # "": off


@dataclass
class LocalCluster:
    num_nodes: int = 2
    node: NodeOptions = field(default_factory=NodeOptions)
    redis_url: str = ""  # "" = start redis-server if on PATH (use_redis), else embedded
    use_redis: bool = True
    lease_ttl_s: float = 3.0
    host: str = "127.0.0.1"
    log_dir: str = ""
    tenants_file: str = ""
    coordinator_address: str = ""
    coordinator_metrics_port: int | None = 0  # 0: a free one picked at start; None: off
    node_addresses: list[str] = field(default_factory=list)
    node_metrics_ports: list[int] = field(default_factory=list)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    store: str = "embedded"
    secure: bool = True  # a cluster secret (a fresh one in log_dir unless secret_file names one)
    secret_file: str = ""
    tls: TlsConfig | None = None  # TLS on every port (each process's own cert: this one's)
    env: dict[str, str] = field(default_factory=dict)  # what every process gets (the two above)

    # -- processes ----------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(Path(self.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the process
        env = child_env({"PYTHONUNBUFFERED": "1", **self.env})
        if not self.env.get(SECRET_FILE_ENV):
            env.pop(SECRET_FILE_ENV, None)  # (an insecure cluster: not the caller's secret either)
            env.pop(SECRET_ENV, None)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def _pagedkv(self, name: str, args: list[str]) -> subprocess.Popen:
        return self._spawn(name, [sys.executable, "-m", "pagedkv", *args])

    def _wait_healthy(self, name: str, address: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                line = self.last_log_line(name)
                error = PortTaken if proc.returncode == 2 and "already in use" in line else RuntimeError
                raise error(f"{name} exited with {proc.returncode}: {line} (log: {self.log_dir}/{name}.log)")
            if health_check(address, timeout_s=1.0, tls=self.tls) == "SERVING":
                return
            time.sleep(0.05)
        raise TimeoutError(
            f"{name} at {address} not healthy after {timeout_s}s; see {self.log_dir}/{name}.log"
        )

    def last_log_line(self, name: str) -> str:
        """The last line a process wrote (a failed pagedkv command's one-line error)."""
        try:
            lines = (Path(self.log_dir) / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1] if lines else ""

    def _trust_env(self) -> None:
        """The cluster secret and TLS every process of the cluster reads (PAGEDKV_*)."""
        if self.secure and not self.secret_file:
            path = Path(self.log_dir) / "cluster-secret"
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(secrets.token_hex(32) + "\n")
            self.secret_file = str(path)
        if self.secure:
            self.env[SECRET_FILE_ENV] = self.secret_file
        if self.tls is not None:
            tls = self.tls
            self.env.update(
                {
                    TLS_ENV["cert_file"]: tls.cert_file,
                    TLS_ENV["key_file"]: tls.key_file,
                    TLS_ENV["ca_file"]: tls.ca_file,
                    TLS_ENV["require_client_cert"]: "require" if tls.require_client_cert else "none",
                    TLS_ENV["server_name"]: tls.server_name,
                }
            )

    def start(self) -> LocalCluster:
        if not self.log_dir:
            self.log_dir = tempfile.mkdtemp(prefix="pagedkv-cluster-")
        self._trust_env()
        redis_bin = shutil.which("redis-server")
        if not self.redis_url and self.use_redis and redis_bin:
            port = free_port(self.host)
            self._spawn(
                "redis",
                [redis_bin, "--port", str(port), "--bind", self.host, "--save", "", "--appendonly", "no"],
            )
            self.redis_url = f"redis://{self.host}:{port}/0"
            self._wait_redis()
        self.store = self.redis_url or "embedded"
        self.start_coordinator()
        for i in range(self.num_nodes):
            self.start_node(i)
        self.wait_registered(self.num_nodes)
        return self

    def _wait_redis(self, timeout_s: float = 10.0) -> None:
        host, port = self.redis_url.split("//")[1].split("/")[0].rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
            time.sleep(0.05)
        raise TimeoutError(f"redis-server at {self.redis_url} did not answer PING")

    def _start_on_ports(self, name: str, repicks: bool, launch: Callable[[bool], str]) -> str:
        """launch(pick) picks the ports it owns when `pick`, spawns `name` and returns the address
        to health-check. Ports picked here may be taken between the pick and the bind (an outgoing
        connection's ephemeral port): picked again then, when `repicks`; ports the caller gave, or
        kept from a first start for a restart, are not."""
        for attempt in range(PORT_TRIES):
            address = launch(attempt == 0 or repicks)
            try:
                self._wait_healthy(name, address)
                return address
            except PortTaken:
                if not repicks or attempt == PORT_TRIES - 1:
                    raise
        raise AssertionError("unreachable")  # (the last try returns or raises)

    def start_coordinator(self) -> None:
        picked = not self.coordinator_address, self.coordinator_metrics_port == 0

        def launch(pick: bool) -> str:
            if pick and picked[0]:
                self.coordinator_address = f"{self.host}:{free_port()}"
            if pick and picked[1]:
                self.coordinator_metrics_port = free_port(self.host)  # kept across restarts
            args = [
                "coordinator",
                f"--listen={self.coordinator_address}",
                f"--lease-ttl-s={self.lease_ttl_s}",
            ]
            if self.coordinator_metrics_port is not None:
                args.append(f"--metrics-port={self.coordinator_metrics_port}")
            if self.redis_url:
                args.append(f"--redis={self.redis_url}")
            if self.tenants_file:
                args.append(f"--tenants={self.tenants_file}")
            self._pagedkv("coordinator", args)
            return self.coordinator_address

        self._start_on_ports("coordinator", any(picked), launch)

    def start_node(self, i: int) -> str:
        name = f"node-{i}"
        # Picked here (so the cluster knows them; kept across restarts).
        picked = i >= len(self.node_addresses), i >= len(self.node_metrics_ports)
        if picked[0]:
            self.node_addresses.append("")
        if picked[1]:
            self.node_metrics_ports.append(0)

        def launch(pick: bool) -> str:
            if pick and picked[0]:
                self.node_addresses[i] = f"{self.host}:{free_port()}"
            if pick and picked[1]:
                self.node_metrics_ports[i] = free_port(self.host)
            address = self.node_addresses[i]
            args = ["node", f"--listen={address}", f"--node-id={name}", f"--advertise={address}"]
            args += [
                f"--coordinator={self.coordinator_address}",
                f"--metrics-port={self.node_metrics_ports[i]}",
            ]
            self._pagedkv(name, args + self.node.args())
            return address

        return self._start_on_ports(name, any(picked), launch)

    def wait_registered(self, num_nodes: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.stats().nodes) >= num_nodes:
                return
            time.sleep(0.05)
        raise TimeoutError(f"{num_nodes} nodes did not register within {timeout_s}s")

    def stats(self) -> pb.CoordStatsResponse:
        with secure_channel(self.coordinator_address, self.tls) as channel:
            return pb_grpc.CoordinatorStub(channel).Stats(pb.Empty(), timeout=5)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(10)

    def stop(self) -> None:
        """SIGTERM everything (nodes first, Redis last), then SIGKILL what lingers."""
        order = sorted(self.procs, key=lambda n: (n == "redis", n == "coordinator", n))
        for name in order:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in order:
            try:
                self.procs[name].wait(15)
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait(5)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def endpoints(self) -> list[NodeEndpoints]:
        """Every node's gRPC, bulk (from its Stats) and metrics endpoints."""
        out = []
        for i, address in enumerate(self.node_addresses):
            with secure_channel(address, self.tls) as channel:
                bulk = pb_grpc.CacheNodeStub(channel).Stats(pb.Empty(), timeout=5).bulk_port
            metrics = f"{self.host}:{self.node_metrics_ports[i]}" if i < len(self.node_metrics_ports) else ""
            out.append(NodeEndpoints(f"node-{i}", address, bulk, metrics))
        return out

    def describe(self) -> str:
        """One line per process with every port it opened (the first word after the name is
        its gRPC address), then the model shape and the log folder."""
        metrics = (
            f"   metrics http://{self.host}:{self.coordinator_metrics_port}/metrics"
            if self.coordinator_metrics_port
            else ""
        )
        lines = [f"coordinator  {self.coordinator_address}{metrics}   (store: {self.store})"]
        for e in self.endpoints():
            host = e.address.rsplit(":", 1)[0]
            bulk = f"   bulk {host}:{e.bulk_port}" if e.bulk_port else "   bulk off"
            node_metrics = f"   metrics http://{e.metrics_address}/metrics" if e.metrics_address else ""
            lines.append(f"{e.node_id:<12} {e.address}{bulk}{node_metrics}")
        lines.append(f"model spec   {self.node.describe()}")
        secret = f"cluster secret {self.secret_file}" if self.secure else "no cluster secret (insecure)"
        lines.append(f"security     {secret}; TLS {'on' if self.tls is not None else 'off'}")
        lines.append(f"logs         {self.log_dir}")
        return "\n".join(lines)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--nodes", type=positive_int("--nodes"), default=2, help="cache nodes to start (default 2)"
    )
    p.add_argument(
        "--redis", default="", help="use this Redis (redis://host:port/db) instead of starting one"
    )
    p.add_argument(
        "--embedded",
        action="store_true",
        help="use the coordinator's embedded store even when redis-server is on the PATH",
    )
    p.add_argument(
        "--num-blocks",
        type=positive_int("--num-blocks"),
        default=None,
        help="device blocks per node (default 2048, or what --pool-bytes holds)",
    )
    p.add_argument(
        "--pool-bytes",
        type=parse_bytes,
        default=None,
        help="device pool per node in bytes, e.g. 256MiB (instead of --num-blocks)",
    )
    p.add_argument("--host-blocks", type=int, default=None, help="host-tier blocks per node (default 1024)")
    p.add_argument(
        "--host-bytes",
        type=parse_bytes,
        default=None,
        help="host tier per node in bytes (instead of --host-blocks; 0 = none)",
    )
    p.add_argument("--policy", choices=["lru", "lfu", "score", "slru"], default="lru", help="eviction policy")
    p.add_argument("--lease-ttl-s", type=float, default=3.0, help="node lease (default 3 s)")
    p.add_argument(
        "--bulk-port",
        choices=["auto", "off"],
        default="auto",
        help="each node's bulk KV port for large transfers (default: a free one)",
    )
    p.add_argument(
        "--coordinator-port", type=int, default=0, help="the coordinator's gRPC port (default: a free one)"
    )
    add_trust_args(p)


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The model shape the nodes serve: --model PATH (a transformers config.json) and/or flags,
    flags winning. Without either, the small float32 shape NodeOptions defaults to."""
    g = p.add_argument_group("model spec (the KV shape every node serves; must match the workers' model)")
    g.add_argument(
        "--model",
        default="",
        help="a transformers model folder (or its config.json): "
        "layers, KV heads, head_dim and dtype come from it",
    )
    g.add_argument("--num-layers", type=positive_int("--num-layers"), help="transformer layers (default 2)")
    g.add_argument(
        "--num-kv-heads", type=positive_int("--num-kv-heads"), help="KV heads per layer (default 2)"
    )
    g.add_argument("--head-dim", type=positive_int("--head-dim"), help="head dimension (default 32)")
    g.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="KV dtype (default float32)")
    g.add_argument("--block-size", type=positive_int("--block-size"), help="tokens per block (default 16)")
    g.add_argument(
        "--model-id",
        help="the weights the KV belongs to (e.g. org/name@revision): workers of another model are "
        "refused, whatever their shape (default: not named)",
    )


def node_options_from_args(args: argparse.Namespace) -> NodeOptions:
    """The NodeOptions of add_shape_args' flags (the model's config first, then each flag)."""
    shape: dict = kv_shape(args.model) if args.model else {}
    for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "model_id"):
        if getattr(args, name, None) is not None:
            shape[name] = getattr(args, name)
    return NodeOptions(**shape)


def cluster_from_args(args: argparse.Namespace, node: NodeOptions | None = None) -> LocalCluster:
    node = node or NodeOptions()
    try:
        spec = ModelSpec(**node.spec())
    except InvalidArgument as exc:
        raise UsageError(str(exc)) from None
    if args.num_blocks is not None:
        node.num_blocks = args.num_blocks
    elif args.pool_bytes is not None:
        node.num_blocks = spec.blocks_for_bytes(args.pool_bytes)
        if node.num_blocks < 1:
            raise UsageError(f"--pool-bytes {args.pool_bytes} holds no block of {spec.bytes_per_block} B")
    if args.host_blocks is not None:
        node.host_blocks = args.host_blocks
    elif args.host_bytes is not None:
        node.host_blocks = spec.blocks_for_bytes(args.host_bytes)
    node.policy = args.policy
    node.bulk_port = getattr(args, "bulk_port", "auto")
    port = getattr(args, "coordinator_port", 0)
    return LocalCluster(
        args.nodes,
        node,
        redis_url=args.redis,
        use_redis=not args.embedded,
        lease_ttl_s=args.lease_ttl_s,
        coordinator_address=f"127.0.0.1:{port}" if port else "",
        secret_file=getattr(args, "cluster_secret_file", ""),
        tls=tls_from_args(args, server=True) if hasattr(args, "tls_cert") else None,
    )


def main(argv: list[str] | None = None) -> None:
    from .usage import Parser

    p = Parser(prog="pagedkv up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cluster_args(p)
    add_shape_args(p)
    args = p.parse_args(argv)
    run("pagedkv up", lambda: up(args))


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def up(args: argparse.Namespace) -> None:
    cluster = cluster_from_args(args, node_options_from_args(args))
    node, bytes_per_block = cluster.node, ModelSpec(**cluster.node.spec()).bytes_per_block
    need = cluster.num_nodes * (node.num_blocks + node.host_blocks) * bytes_per_block
    have = available_memory_bytes()
    if have is not None and need > have:  # each node checks its own pool; this is all of them
        raise UsageError(
            f"{cluster.num_nodes} nodes of {node.num_blocks} + {node.host_blocks} host blocks need "
            f"{human_bytes(need)}, this machine has {human_bytes(have)} available: lower --num-blocks / "
            "--pool-bytes, --host-blocks / --host-bytes or --nodes"
        )
    if args.coordinator_port:
        from .usage import check_port_free

        check_port_free("coordinator gRPC", "--coordinator-port", cluster.host, args.coordinator_port)
    print("starting a local pagedkv cluster ...", flush=True)
    try:
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as exc:
            raise UsageError(f"{exc}") from None
        print(cluster.describe(), flush=True)
        print(
            "Ctrl-C stops everything. `pagedkv status --coordinator "
            f"{cluster.coordinator_address}` shows usage.",
            flush=True,
        )
        # Both stop the cluster, also when started from a shell that ignores SIGINT (a background job).
        signal.signal(signal.SIGINT, _stop)
        signal.signal(signal.SIGTERM, _stop)
        while all(p.poll() is None for p in cluster.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in cluster.procs.items() if p.poll() is not None]
        print(f"process(es) exited: {dead}; stopping", flush=True)
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
    finally:
        cluster.stop()
