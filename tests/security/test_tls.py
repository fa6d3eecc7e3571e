"""TLS on every port: a plaintext client gets nothing from the secured cluster's
ports; mutual TLS (in-process servers) refuses a client without a certificate on
gRPC and on the bulk TCP port; a node listens on loopback unless told; a
standalone node started with a token refuses calls without it on every path."""

from __future__ import annotations

import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from hostile import Q_HEADS, SPEC, Secured, kv, make_certs

from pagedkv.cache_node import cli as node_cli
from pagedkv.cache_node.engine import CacheEngine, EngineConfig
from pagedkv.cache_node.gate import NodeTrust
from pagedkv.cache_node.server import NodeServer, create_server
from pagedkv.client import CacheClient
from pagedkv.client.config import ClientConfig
from pagedkv.protos import pagedkv_pb2 as pb
from pagedkv.protos import pagedkv_pb2_grpc as pb_grpc
from pagedkv.protos import wire
from pagedkv.protos.errors import Unauthenticated, Unavailable
from pagedkv.protos.tls import TlsConfig


def test_plaintext_clients_get_nothing_from_tls_ports(cluster: Secured) -> None:
    for address in [cluster.cluster.coordinator_address, *cluster.node_addresses()]:
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CacheNodeStub(ch).Stats(pb.Empty(), timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
    plain = CacheClient(coordinator=cluster.cluster.coordinator_address, token="x", spec=SPEC)
    with pytest.raises(Unavailable):
        plain.lookup([1, 2, 3], timeout_s=3)
    plain.close()


def test_a_node_listens_on_loopback_unless_told() -> None:
    args = node_cli.build_parser().parse_args([])
    assert args.listen.startswith("127.0.0.1:")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TlsConfig:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def standalone(certs: TlsConfig) -> Iterator[tuple[NodeServer, int, CacheEngine]]:
    """A standalone node with mutual TLS and a bearer token."""
    engine = CacheEngine(EngineConfig(SPEC, 64, device="cpu"))
    mtls = TlsConfig(certs.cert_file, certs.key_file, certs.ca_file, require_client_cert=True)
    server, port = create_server(engine, "127.0.0.1:0", trust=NodeTrust(token="node-token-123"), tls=mtls)
    server.start()
    try:
        yield server, port, engine
    finally:
        server.stop(0)


def _client(port: int, tls: TlsConfig, transports: tuple[str, ...], token: str | None) -> CacheClient:
    cfg = ClientConfig(tls=tls, transports=transports, bulk_min_bytes=0, deadline_s=5)
    return CacheClient(f"127.0.0.1:{port}", cfg, token=token)


def test_mutual_tls_refuses_a_client_without_a_certificate(certs: TlsConfig, standalone: tuple) -> None:
    server, port, engine = standalone
    anonymous = TlsConfig(ca_file=certs.ca_file)
    with _client(port, anonymous, ("grpc",), "node-token-123") as c, pytest.raises(Unavailable):
        c.open("s", [1, 2, 3])
    assert server.bulk is not None
    hello = wire.Frame(wire.OP_HELLO, 1).pack()
    for identity in (anonymous, certs):  # the bulk TCP port: refused without a certificate, served with one
        ctx = identity.client_context()
        with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5) as raw:
            try:
                with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
                    sock.sendall(hello)  # (TLS 1.3: a missing certificate is refused at the first read)
                    answered = wire.read_reply(sock).op == wire.OP_HELLO
            except (ssl.SSLError, OSError, wire.ProtocolError):
                answered = False
        assert answered == (identity is certs)
    assert engine.stats()["num_sequences"] == 0


def test_a_standalone_node_with_a_token_refuses_calls_without_it(certs: TlsConfig, standalone: tuple) -> None:
    _, port, engine = standalone
    for transports in (("grpc",), ("tcp", "grpc"), ("shm", "unix", "tcp", "grpc")):
        with (
            _client(port, certs, transports, None) as c,
            pytest.raises(Unauthenticated, match="bearer token"),
        ):
            c.open("s", [1, 2, 3])
        with (
            _client(port, certs, transports, "wrong") as c,
            pytest.raises(Unauthenticated, match="wrong bearer"),
        ):
            c.open("s", [1, 2, 3])
        with _client(port, certs, transports, "node-token-123") as c:  # the owner, over mTLS
            seq = c.open(f"s-{len(transports)}", [7, 8, 9, len(transports)])
            k, v = kv([7, 8, 9, len(transports)], seed=1)
            seq.append([7, 8, 9, len(transports)], k, v)
            seq.attend(0, torch.zeros(Q_HEADS, SPEC.head_dim))
            assert torch.equal(seq.read_kv()[0], k)
            seq.close()
    assert engine.stats()["num_sequences"] == 0
    engine.check_integrity()


def test_the_dev_certificate_script_names_every_host(tmp_path: Path) -> None:
    tls = make_certs(tmp_path)
    text = subprocess.run(
        ["openssl", "x509", "-in", tls.cert_file, "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:localhost" in text and "IP Address:127.0.0.1" in text
    assert TlsConfig(tls.cert_file, tls.key_file, tls.ca_file).server_context() is not None
