"""A secured cluster of real processes, and the tools of a hostile client against it.

The cluster: its own redis-server, a coordinator with two tenants ("alpha", the
victim, and "beta", the attacker, whose quota is QUOTA_BLOCKS), two nodes; a
fresh cluster secret; TLS on every port (a throwaway CA from deploy/tls/make-certs.sh;
TLS does not authenticate clients here, so the attacker speaks it too). The nodes'
bulk listeners time out idle and slow connections after BULK_TIMEOUT_S.

The attacker has what anyone who reaches the ports has: the CA's certificate, the
generated stubs and the bulk codec, its own tenant's token, and for some tests the
victim's sequence ids and node ids (ids are not secrets).
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.client import CacheClient
from pagedkv.client.config import ClientConfig
from pagedkv.cluster import LocalCluster, NodeOptions
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos import wire
from pagedkv.protos.spec import ModelSpec
from pagedkv.protos.tickets import ClusterKeys
from pagedkv.protos.tls import TlsConfig, secure_channel

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {"alpha": "token-alpha-0123456789", "beta": "token-beta-0123456789"}
QUOTA_BLOCKS = 64  # beta's
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=32, dtype="float32", block_size=16)
Q_HEADS = 4
NUM_BLOCKS = 256
BULK_TIMEOUT_S = 2.0
MAX_PER_PEER = 8


def make_certs(out: Path) -> TlsConfig:
    if shutil.which("openssl") is None:
        import pytest

        pytest.skip("openssl is not on the PATH (the TLS certificates are made with it)")
    script = ROOT / "deploy" / "tls" / "make-certs.sh"
    subprocess.run(["sh", str(script), str(out), "localhost", "127.0.0.1"], check=True, capture_output=True)
    return TlsConfig(str(out / "tls.crt"), str(out / "tls.key"), str(out / "ca.crt"))


def kv(token_ids: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_layers, len(token_ids), SPEC.num_kv_heads, SPEC.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@dataclass
class Victim:
    """alpha's sequence: where it lives and the exact bytes it must keep."""

    seq: Any
    address: str
    node_seq_id: str
    ticket: bytes
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class Secured:
    cluster: LocalCluster
    tls: TlsConfig  # the servers' (cert, key, CA)
    client_tls: TlsConfig  # what any client has: the CA
    keys: ClusterKeys  # the cluster secret (tests mint leaked and forged tickets with it)
    clients: dict[str, CacheClient] = field(default_factory=dict)
    victim: Victim | None = None

    def client(self, tenant: str, **config: Any) -> CacheClient:
        cfg = ClientConfig(tls=self.client_tls, **config)
        return CacheClient(
            coordinator=self.cluster.coordinator_address, token=TOKENS[tenant], spec=SPEC, config=cfg
        )

    def node_stub(self, address: str) -> pb_grpc.CacheNodeStub:
        return pb_grpc.CacheNodeStub(secure_channel(address, self.client_tls))

    def coordinator_stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(secure_channel(self.cluster.coordinator_address, self.client_tls))

    def bulk_port(self, address: str) -> int:
        return int(self.node_stub(address).Stats(pb.Empty(), timeout=5).bulk_port)

    def bulk_tcp(self, address: str, timeout_s: float = 5.0) -> ssl.SSLSocket:
        """A raw TLS connection to the node's bulk TCP port (what any peer can open)."""
        sock = socket.create_connection(("127.0.0.1", self.bulk_port(address)), timeout=timeout_s)
        ctx = ssl.create_default_context(cafile=self.client_tls.ca_file)
        return ctx.wrap_socket(sock, server_hostname="127.0.0.1")

    def bulk_unix(self, address: str, timeout_s: float = 5.0) -> socket.socket:
        """A raw connection to the node's same-host socket (its name from HELLO)."""
        with self.bulk_tcp(address) as tcp:
            caps = wire.hello(tcp, 1)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect("\0" + caps.local_name)
        return sock

    def health(self, address: str) -> str:
        with secure_channel(address, self.client_tls) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def node_addresses(self) -> list[str]:
        return list(self.cluster.node_addresses)

    def assert_intact(self) -> None:
        """The victim's KV byte-identical, every node's invariants hold, every server SERVING."""
        v = self.victim
        assert v is not None
        k, vv = v.seq.read_kv()
        assert torch.equal(k, v.k) and torch.equal(vv, v.v), "the victim's KV changed"
        assert v.seq.num_cached_tokens == 0
        alpha = self.clients["alpha"]
        for address in self.node_addresses():
            alpha.node(address).control.check_integrity()
            assert self.health(address) == "SERVING"
        assert self.health(self.cluster.coordinator_address) == "SERVING"


def start(tmp: Path) -> Secured:
    tls = make_certs(tmp / "certs")
    tenants = tmp / "tenants.json"
    tenants.write_text(
        json.dumps({"tokens": {v: k for k, v in TOKENS.items()}, "quotas": {"beta": QUOTA_BLOCKS}})
    )
    node = NodeOptions(
        num_layers=SPEC.num_layers,
        num_kv_heads=SPEC.num_kv_heads,
        head_dim=SPEC.head_dim,
        dtype=SPEC.dtype,
        block_size=SPEC.block_size,
        num_blocks=NUM_BLOCKS,
        host_blocks=64,
        extra_args=(
            f"--bulk-idle-timeout-s={BULK_TIMEOUT_S}",
            f"--bulk-request-timeout-s={BULK_TIMEOUT_S}",
            f"--bulk-max-per-peer={MAX_PER_PEER}",
        ),
    )
    cluster = LocalCluster(2, node, log_dir=str(tmp), tenants_file=str(tenants), tls=tls).start()
    keys = ClusterKeys.from_file(cluster.secret_file)
    return Secured(cluster, tls, TlsConfig(ca_file=tls.ca_file), keys)


def status_of(fn: Any, request: Any, metadata: Any = None, timeout_s: float = 10.0) -> tuple[str, str]:
    """(status code name, details) of one raw rpc ("OK", "" when it succeeded); for a
    server-streaming rpc the stream is drained."""
    try:
        reply = fn(request, timeout=timeout_s, metadata=metadata)
        if (
            hasattr(reply, "__iter__")
            and not isinstance(reply, bytes | str)
            and not hasattr(reply, "ListFields")
        ):
            for _ in reply:
                pass
    except grpc.RpcError as err:
        return err.code().name, err.details() or ""  # type: ignore[attr-defined]
    return "OK", ""


def send(sock: socket.socket, frame: wire.Frame, payload: bytes = b"") -> None:
    sock.sendall(frame.pack() + payload)


def reply(sock: socket.socket) -> wire.Frame:
    return wire.read_reply(sock)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")
